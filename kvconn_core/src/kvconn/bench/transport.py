"""The command line of ``kvconn bench --transport``: bytes/s of the same
chunked writes through kvconn and through the transport's raw API, side by
side in one run (its parts: the bench's README.md)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape

from kvconn.bench.output import check_output_paths, spinner, write_json
from kvconn.bench.shapes import DEFAULT_SHAPES, Shape
from kvconn.bench.sizes import MiB, size_arg
from kvconn.bench.transport_report import print_report
from kvconn.bench.transport_run import run_backend
from kvconn.plugins import get_backend

#: The options only the transport bench reads (``add_arguments``' dests).
OPTIONS = frozenset({"repeat", "shape", "bytes_per_run", "room_bytes", "inflight", "profile"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The transport bench's options (``--backend`` and ``--json`` are the bench's)."""
    g = p.add_argument_group("--transport: kvconn vs raw transport bytes/s")
    g.add_argument(
        "--transport",
        action="store_true",
        help="run the transport throughput bench instead (--backend takes a comma list)",
    )
    g.add_argument("--repeat", type=int, default=5, help="interleaved repetitions (median reported)")
    g.add_argument(
        "--shape",
        action="append",
        default=None,
        metavar="SHAPE",
        help="chunk shape, repeatable: PAGE_BYTES[xCHUNK_PAGES][:scattered] (a flat region, e.g. "
        "4KiBx1024:scattered), or kv:LAYERSxCHUNK_PAGES[:scattered] (an engine's per-layer K and V "
        f"buffers, 16-token fp16 pages of 8 heads x 128, e.g. kv:32x64:scattered); default "
        f"{', '.join(DEFAULT_SHAPES)}",
    )
    g.add_argument(
        "--bytes-per-run", type=size_arg, default=256 * MiB, help="bytes per measurement and shape"
    )
    g.add_argument("--room-bytes", type=size_arg, default=16 * MiB, help="room size (at least one chunk)")
    g.add_argument("--inflight", type=int, default=2, help="rooms decode keeps requested at once")
    g.add_argument(
        "--profile",
        action="store_true",
        help="time kvconn's phases per chunk and room (adds a hook wrapper: ~2 us a chunk)",
    )


def main(args: argparse.Namespace, options: Mapping[str, str], console: Console, err: Console) -> int:
    """Run ``--transport`` with the parsed ``--backend-option`` ``options``."""
    if args.repeat < 1 or args.inflight < 1:
        raise ValueError("--repeat and --inflight must be >= 1")
    if args.bytes_per_run < 1 or args.room_bytes < 1 or args.seed < 0:
        raise ValueError("--bytes-per-run and --room-bytes must be >= 1, --seed >= 0")
    check_output_paths(args.json)
    shapes = [Shape.parse(s) for s in (args.shape or DEFAULT_SHAPES)]
    names = [n.strip() for n in args.backend.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--backend names no backend: {args.backend!r}")
    for name in names:  # every name, before minutes of measuring the first ones
        get_backend(name)
    reports = []
    with spinner(err, args.no_progress) as progress:
        for name in names:
            task = progress.add_task(escape(name), total=None)

            def step(what: str, task: Any = task, name: str = name) -> None:
                progress.update(task, description=escape(f"{name}: {what}"))

            reports.append(run_backend(name, options, shapes, args, step))
            progress.remove_task(task)
    for rep in reports:
        print_report(console, rep)
    if args.json:
        write_json(args.json, {"transport": reports})
    return 0 if all(r["verified"] for r in reports) else 1
