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


def _lazy(module: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Any:
    def run(args: argparse.Namespace) -> int:
        mod = importlib.import_module(module)
        code: int = mod.main(parser, args)
        return code

    return run


def _add_arguments(module: str, parser: argparse.ArgumentParser) -> None:
    """Let the chosen subcommand's module declare its options before parsing."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    add = getattr(mod, "add_arguments", None)
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
        sub_parser.set_defaults(func=_lazy(module, sub_parser, argv))
        if name in args_in[:1]:
            _add_arguments(module, sub_parser)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
