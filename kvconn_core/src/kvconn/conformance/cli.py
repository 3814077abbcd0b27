"""``kvconn conformance BACKEND [--strict] [--thorough] [--cross-host] [--watch S] [-k EXPR] [-o KEY=VALUE] [-x]``.

The transport conformance suite: what a backend must prove before kvconn
trusts it with decode's pages. Every check runs real processes with the
backend's own transport (decode's endpoint, prefill ranks, bare writers
driving its hooks) and fails unless the transport's answers hold (LANDED
means landed, a fence stops every write in flight, a killed writer leaves
nothing behind, ...), and unless the run put something at stake for it
(writes in flight at a fence, bytes outstanding at a cut, a writer that
reaches the region): each check's summary line says how much. What a
check released stays guarded until the run's last check.

Modes: --strict: a skip no capability rules out fails, 10 s watches, a 30 s
guard. --thorough: 20000-segment chunks, 8192-page rooms, 10 s watches, a
30 s guard. --cross-host (root): decode on one host, writers on two others
(network namespaces sharing nothing but the network). Run times are in
docs/writing-a-transport-plugin.md, section 5.

Exit codes: 0 every selected check passed; 1 a check failed; 2 the command
line is wrong (an unknown backend or option, a -k expression that is
malformed or selects no check); 3 the suite itself broke (please report
it with the output); 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys

import kvconn.conformance._collect as collect
from kvconn.conformance.harness import ABORT_TIMEOUT_S, WRITE_TIMEOUT_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__.split("\n", 2)[2].replace("``", "") if __doc__ else None
    parser.add_argument("backend", help="backend name (see `kvconn backends`)")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="a skip not ruled out by a capability fails; 10 s watches, a 30 s guard",
    )
    parser.add_argument(
        "-k", dest="keyword", default=None, help="only checks matching this pytest -k expression"
    )
    parser.add_argument(
        "-o",
        "--option",
        "--backend-option",
        dest="option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option (repeatable; as in kvconn bench)",
    )
    parser.add_argument(
        "--write-timeout",
        type=float,
        default=WRITE_TIMEOUT_S,
        help=f"writer deadline in s ({WRITE_TIMEOUT_S})",
    )
    parser.add_argument(
        "--abort-timeout",
        type=float,
        default=ABORT_TIMEOUT_S,
        help=f"decode deadline in s ({ABORT_TIMEOUT_S})",
    )
    parser.add_argument(
        "--watch",
        type=float,
        default=None,
        metavar="S",
        help="how long each check watches the pages it released and the regions it fenced for a late "
        "write (2; 10 with --strict or --thorough); the run's last check guards them all to its end",
    )
    parser.add_argument(
        "--thorough",
        action="store_true",
        help="wider chunks (20000 segments, 8192 pages), 10 s watches, a 30 s guard",
    )
    parser.add_argument(
        "--cross-host",
        action="store_true",
        help="decode on one host, writers on two others (network, PID and mount namespaces on this "
        "machine; needs root)",
    )
    parser.add_argument(
        "-x", "--exitfirst", action="store_true", help="stop at the first failed check (a start-up gate)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="terse pytest output")
    parser.add_argument(
        "--durations",
        type=int,
        default=None,
        metavar="N",
        help="list the N slowest checks (pytest's --durations)",
    )


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import pytest

    if not hasattr(args, "backend"):  # the command line was not parsed with add_arguments
        add_arguments(parser)
        parser.error("the conformance arguments were not registered")
    problem = _check_options(args.backend, args.option, args.write_timeout, args.abort_timeout)
    if problem:
        print(f"kvconn conformance: {problem}", file=sys.stderr)
        return 2
    argv = [
        collect.__file__,
        "-p",
        "no:cacheprovider",
        "-rs",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        "--kvconn-backend",
        args.backend,
        "--kvconn-write-timeout",
        str(args.write_timeout),
        "--kvconn-abort-timeout",
        str(args.abort_timeout),
    ]
    if args.strict:
        argv.append("--kvconn-strict")
    if args.thorough:
        argv.append("--kvconn-thorough")
    if args.cross_host:
        argv.append("--kvconn-cross-host")
    if args.watch is not None:
        if args.watch < 0:
            print("kvconn conformance: --watch must be >= 0", file=sys.stderr)
            return 2
        argv += ["--kvconn-watch", str(args.watch)]
    if args.keyword:
        argv += ["-k", args.keyword]
    for item in args.option:
        argv += ["--kvconn-option", item]
    if args.exitfirst:
        argv.append("--exitfirst")
    if args.durations is not None:
        argv.append(f"--durations={args.durations}")
    argv.append("-q" if args.quiet else "-v")
    # No configuration file, no conftest outside the suite's own folder, no
    # cache: nothing of the current directory joins the run. It is pytest's
    # root all the same, so that the checks print as BACKEND::CHECK
    # (plugin.py names them), not as a path.
    here = os.path.dirname(collect.__file__)
    argv += ["--rootdir", os.getcwd(), "--confcutdir", here, "-c", os.devnull]
    plugins: list[object] = []
    if "kvconn.conformance.plugin" not in _loaded_plugins():
        import kvconn.conformance.plugin as plugin

        plugins.append(plugin)
    return exit_code(int(pytest.main(argv, plugins=plugins)), args.keyword)


#: pytest's exit codes (``pytest.ExitCode``), and what ``kvconn
#: conformance`` exits with for each (the documented codes: see the module's
#: docstring) and says on stderr ("" for nothing).
_EXIT = {
    0: (0, ""),
    1: (1, ""),
    2: (130, "interrupted"),
    3: (3, "the suite itself broke (an internal error above): please report it with the output"),
    4: (2, "pytest refused the command line (above){k}"),
    5: (2, "no check selected{k}"),
}
#: What a -k expression is, for the messages above.
_K_HELP = (
    ": -k {expr!r} {what}; -k takes words of the checks' names (docs/writing-a-transport-plugin.md, "
    "section 6) joined by and, or, not and parentheses, e.g. -k 'fence and not partition'"
)


def exit_code(code: int, keyword: str | None) -> int:
    """The documented exit code for pytest's ``code``, saying why on stderr
    when it is not a plain pass or fail."""
    mapped, message = _EXIT.get(code, (3, f"the suite exited with pytest's code {code}"))
    if message:
        detail = ""
        if keyword and code in (4, 5):
            what = "is not a valid expression" if code == 4 else "matches none of the suite's checks"
            detail = _K_HELP.format(expr=keyword, what=what)
        print(f"kvconn conformance: {message.format(k=detail)}", file=sys.stderr)
    return mapped


def _check_options(backend: str, items: list[str], write_timeout_s: float, abort_timeout_s: float) -> str:
    """Why the backend cannot be checked with these options ("" if it can):
    said once, here, rather than by every check of the suite."""
    from kvconn.config import Config
    from kvconn.options import parse_key_values
    from kvconn.plugins import BackendError, get_backend
    from kvconn.transport import capabilities_of

    try:
        Config(write_timeout_s=write_timeout_s, abort_timeout_s=abort_timeout_s)
    except ValueError as exc:
        return f"--write-timeout / --abort-timeout: {exc}"

    try:
        capabilities_of(get_backend(backend), parse_key_values(items, "-o"))
    except (BackendError, ValueError) as exc:
        return str(exc)
    return ""


def _loaded_plugins() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.value for ep in entry_points(group="pytest11")}
