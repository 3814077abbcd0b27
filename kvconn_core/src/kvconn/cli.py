"""The ``kvconn`` command."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from kvconn.plugins import discover


def _backends(args: argparse.Namespace) -> int:
    table = Table(title="kvconn backends")
    for col in ("name", "distribution", "version", "capabilities / error"):
        table.add_column(col)
    infos = discover()
    for info in infos:
        caps = info.capabilities
        if caps is None:
            detail = f"[red]failed to load: {info.error}[/red]"
        else:
            detail = (
                f"writer_fence={caps.writer_fence} memory={','.join(sorted(caps.memory))} "
                f"cross_host={caps.cross_host} max_write_timeout_s={caps.max_write_timeout_s}"
            )
        table.add_row(info.name, info.distribution, info.version, detail)
    Console().print(table)
    return 0 if infos and all(i.backend is not None for i in infos) else 1


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


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvconn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list installed transport backends").set_defaults(func=_backends)
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
    try:
        code: int = args.func(args)
    except MissingDependency as exc:  # an import a subcommand makes only when it runs
        print(f"kvconn: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
