"""kvconn: move KV cache pages from prefill to decode, and never hand a page
out again before proof that no write can still reach it.

Subcommands: "backends" lists the installed transport backends and checks
that each one opens here; "bench" runs the abort-mid-transfer benchmark (or
"bench --transport": kvconn against each transport's raw API);
"conformance" runs the plugin conformance suite against a backend.
"""

from __future__ import annotations

# Only the standard library's lightest modules at the top: a Ctrl-C while
# the rest imports (rich, pluggy, a subcommand's numpy and zmq: a second or
# more on a loaded machine) lands inside main(), which says so in one line.
import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconn.plugins import BackendInfo

#: Exit code of a run stopped by Ctrl-C (128 + SIGINT), as the shell reports it.
INTERRUPTED_EXIT = 130

#: Seconds one backend's probe may take (a native library that hangs).
PROBE_TIMEOUT_S = 60.0
#: Bytes of the region and writer a probe opens.
PROBE_BYTES = 4096


def probe_child(name: str) -> None:
    """In a child process: open a small region and writer of backend ``name``
    and connect them, which loads its native library as a run would; see
    whether device memory can be allocated here if it claims ``vram``. Prints
    one JSON line, then exits at once (a native library's exit-time noise is
    no part of the answer)."""
    import json

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's per-run warnings
    out: dict[str, Any] = {"ok": False, "error": "", "vram": None}
    try:
        from kvconn.plugins import get_backend

        backend = get_backend(name)
        region = backend.open_region(PROBE_BYTES, {})
        try:
            writer = backend.open_writer(PROBE_BYTES, {})
            try:
                writer.connect("probe", region.metadata)
            finally:
                writer.close()
        finally:
            region.close()
        out["ok"] = True
        if "vram" in backend.capabilities.memory:
            try:
                from kvconn.memory import Memory

                Memory(PROBE_BYTES, "vram").free()
                out["vram"] = ""
            except Exception as exc:
                out["vram"] = _one_line(exc)
    except Exception as exc:
        out["error"] = _one_line(exc)
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _probe(name: str) -> dict[str, Any]:
    """Run :func:`probe_child` for ``name`` in a process of its own (a
    native library that crashes takes only the probe down)."""
    import json
    import subprocess

    code = "import sys\nfrom kvconn.cli import probe_child\nprobe_child(sys.argv[1])\n"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, name],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"opening a region and a writer took over {PROBE_TIMEOUT_S:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and "ok" in msg:
            return msg
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    cause = lines[-1] if lines else "no output"
    return {"ok": False, "error": f"the probe process exited with {proc.returncode}: {cause}"}


def _detail(info: BackendInfo, probe: dict[str, Any] | None) -> str:
    from rich.markup import escape

    caps = info.capabilities
    if caps is None:
        return f"[red]failed to load: {escape(info.error or '')}[/red]"
    memory = ",".join(sorted(caps.memory))
    if probe is not None and probe.get("vram"):
        memory += f" (vram not here: {probe['vram']})"
    text = escape(
        f"writer_fence={caps.writer_fence} memory={memory} "
        f"cross_host={caps.cross_host} owner_fence={caps.owner_fence} "
        f"max_write_timeout_s={caps.max_write_timeout_s}"
    )
    if probe is not None and not probe["ok"]:
        text += f"\n[red]does not open here: {escape(probe['error'])}[/red]"
    return text


def _backends(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from kvconn.plugins import ALLOW_ENV, discover, installed_names, unknown_allowed

    console = Console()
    err = Console(stderr=True)
    unknown = unknown_allowed()
    if unknown:
        err.print(
            escape(
                f"kvconn backends: {ALLOW_ENV}={os.environ.get(ALLOW_ENV, '')!r} names "
                f"{', '.join(unknown)}, which no installed backend is "
                f"(installed: {', '.join(installed_names()) or 'none'})"
            )
        )
    infos = discover()
    if not infos:
        if unknown:
            return 1  # said above
        err.print(
            escape(
                f"kvconn backends: no backend to list ({ALLOW_ENV} admits none of the installed ones)"
                if os.environ.get(ALLOW_ENV, "").strip()
                else "kvconn backends: no backend is installed (kvconn-core ships loopback: reinstall it)"
            )
        )
        return 1
    loaded = [i.name for i in infos if i.backend is not None]
    probes: dict[str, dict[str, Any]] = {}
    if not args.no_probe and loaded:
        with ThreadPoolExecutor(max_workers=len(loaded)) as pool:
            probes = dict(zip(loaded, pool.map(_probe, loaded), strict=True))
    table = Table(title="kvconn backends" + ("" if args.no_probe else " (each opened here)"))
    for col in ("name", "distribution", "version", "capabilities / error"):
        table.add_column(col)
    for info in infos:
        table.add_row(
            escape(info.name),
            escape(info.distribution),
            escape(info.version),
            _detail(info, probes.get(info.name)),
        )
    console.print(table)
    ok = all(i.backend is not None for i in infos) and all(p["ok"] for p in probes.values())
    return 0 if ok and not unknown else 1


#: How to install a third-party module a subcommand imports, when it is missing
#: (a partial install, or one that skipped dependencies).
INSTALL_HINTS = {
    "pytest": "pip install 'pytest>=8'  (a dependency of kvconn-core: reinstall it with `pip install ./kvconn_core`)",
    "matplotlib": "pip install 'kvconn-core[plot]'",
}


class MissingDependency(Exception):
    """A subcommand needs a module that is not installed; says how to install it."""

    def __init__(self, command: str, module: str) -> None:
        hint = INSTALL_HINTS.get(module, f"pip install {module}")
        super().__init__(
            f"kvconn {command} needs the Python package {module!r}, which is not installed: {hint}"
        )
        self.command = command
        self.module = module


def _import_subcommand(command: str, module: str) -> Any:
    """Import a subcommand's module; a missing third-party module is a
    MissingDependency (a missing part of kvconn itself stays a bug, raised as is)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == "kvconn":
            raise
        raise MissingDependency(command, missing) from exc


def _lazy(command: str, module: str, parser: argparse.ArgumentParser) -> Any:
    def run(args: argparse.Namespace) -> int:
        mod = _import_subcommand(command, module)
        code: int = mod.main(parser, args)
        return code

    return run


def _add_arguments(command: str, module: str, parser: argparse.ArgumentParser) -> None:
    """Let the chosen subcommand's module declare its options before parsing."""
    add = getattr(_import_subcommand(command, module), "add_arguments", None)
    if add is not None:
        add(parser)


#: The distributions kvconn ships beside kvconn-core, named by ``--version`` when installed.
COMPANIONS = ("kvconn-nixl", "kvconn-mooncake", "kvconn-vllm", "kvconn-sglang")


def _version() -> str:
    """kvconn-core's version (``kvconn.__version__``, which its metadata is
    built from), and each companion distribution's installed here."""
    from importlib.metadata import PackageNotFoundError, version

    from kvconn import __version__

    others = []
    for dist in COMPANIONS:
        try:
            others.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    return __version__ + (f" ({', '.join(others)})" if others else "")


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    caught: list[int] = []

    def on_interrupt(signum: int, frame: Any) -> None:
        caught.append(signum)  # seen even where a library's bare `except:` swallows what it raises
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, on_interrupt)
    except ValueError:  # not the main thread: Python's own handler stays
        previous = None
    try:
        return _main(argv, args_in, caught)
    except KeyboardInterrupt:
        # Ctrl-C before a subcommand took the signal over (kvconn bench does,
        # once its modules are imported) or in one that does not.
        command = next((a for a in args_in if not a.startswith("-")), "")
        print(f"kvconn{' ' + command if command else ''}: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED_EXIT
    finally:
        # A subcommand that ignores SIGINT until the exit (kvconn bench after
        # an interrupted run's teardown) keeps it ignored: Python's handler,
        # put back, would let one more Ctrl-C kill the process (exit -2).
        if previous is not None and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)


def _main(argv: Sequence[str] | None, args_in: list[str], caught: list[int]) -> int:
    from kvconn.plugins import ALLOW_ENV

    parser = argparse.ArgumentParser(
        prog="kvconn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    backends = sub.add_parser(
        "backends",
        help="list installed transport backends, each opened here",
        description="List the installed transport backends and open a small region and writer of "
        f"each (in a process of its own), so a missing native library shows here, not in a run. "
        f"{ALLOW_ENV} (comma-separated names) restricts which may load. Exit code 1 if one does "
        "not load or open.",
    )
    backends.add_argument(
        "--no-probe", action="store_true", help="only load each backend's module; open nothing"
    )
    backends.set_defaults(func=_backends)
    # Each subcommand module adds its own arguments; imported only when used.
    for name, module, help_text in (
        ("bench", "kvconn.bench.cli", "abort-mid-transfer benchmark: verify and measure"),
        ("conformance", "kvconn.conformance.cli", "run the conformance suite against a backend"),
    ):
        sub_parser = sub.add_parser(name, help=help_text)
        sub_parser.set_defaults(func=_lazy(name, module, sub_parser))
        if name in args_in[:1]:
            # Before parsing: a module that cannot be imported would otherwise
            # leave its options unregistered, and argparse would blame the user.
            try:
                _add_arguments(name, module, sub_parser)
            except MissingDependency as exc:
                print(f"kvconn: error: {exc}", file=sys.stderr)
                return 2
    args = parser.parse_args(argv)
    if caught:  # a Ctrl-C while the subcommand's modules imported, swallowed on the way
        raise KeyboardInterrupt
    try:
        code: int = args.func(args)
    except MissingDependency as exc:  # an import a subcommand makes only when it runs
        print(f"kvconn: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
