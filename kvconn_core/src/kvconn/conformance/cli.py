"""``kvconn conformance BACKEND [--strict] [--thorough] [--cross-host] [--watch S] [-k EXPR] [-o KEY=VALUE] [-x]``.

What the modes add, and what they cost (loopback, the three side by side
on 2 busy shared cores; see docs/writing-a-transport-plugin.md): the
default run watches each check's released pages 2 s and guards them all to
the end of the run (its last check, at least 15 s after the last release):
281 s there (alone, at load 1-12 on the same 2 shared cores: loopback
112-124 s, tcpdemo 88-134 s, nixl 98-224 s, mooncake 141-180 s).
--strict: a skip no capability rules out fails; 10 s watches and a 30 s guard: +18%.
--thorough: 20000-segment chunks, 8192-page rooms, 10 s watches and a 30 s
guard: +30%.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

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
    with tempfile.TemporaryDirectory(prefix="kvconn-conformance-") as rootdir:
        argv += ["--rootdir", rootdir, "-c", os.devnull]
        plugins: list[object] = []
        if "kvconn.conformance.plugin" not in _loaded_plugins():
            import kvconn.conformance.plugin as plugin

            plugins.append(plugin)
        return int(pytest.main(argv, plugins=plugins))


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
