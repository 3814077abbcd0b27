"""What ``kvconn bench`` refuses before anything starts, each in one line that
names the option: sizes past this machine's memory, a plot that cannot be
written, a metrics port in use, ``--curve-points`` that are not numbers."""

from __future__ import annotations

import argparse
import os
import socket

from kvconn.bench.sizes import approx_size, memory_available
from kvconn.bench.workload import Workload, source_pages

#: ``--curve`` axes whose points count something (rooms, ranks, segments, tombstones).
WHOLE_POINTS = frozenset({"rooms", "ranks", "segments", "tombstones"})
#: The options that size a run's memory, in the order a message names them.
SIZING = ("--pages", "--page-bytes", "--pool-pages", "--concurrency", "--decodes", "--stream-requests")
#: Python's bookkeeping per page of a decode pool (free list, owners), roughly.
PER_POOL_PAGE_BYTES = 64


def points_arg(text: str) -> str:
    """``--curve-points`` as argparse checks it: comma-separated numbers
    (kept as text: each curve reads its points its own way)."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    for value in values:
        try:
            float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a number (comma-separated numbers, e.g. 8,512)"
            ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} names no point (comma-separated numbers, e.g. 8,512)")
    return text


def curve_points_error(curve: str | None, points: str | None) -> str | None:
    """What is wrong with ``--curve-points`` for this ``--curve`` (argparse's
    own wording, for ``parser.error``), or None."""
    if points is None or curve not in WHOLE_POINTS:
        return None
    fractional = [x.strip() for x in points.split(",") if x.strip() and not float(x).is_integer()]
    if not fractional:
        return None
    return f"argument --curve-points: --curve {curve} takes whole numbers, got {fractional[0]!r}"


def check_plot(path: str, curve: str | None) -> None:
    """A plot matplotlib cannot write (no matplotlib, a format it has not),
    refused before a run of minutes."""
    if curve:
        raise ValueError(f"--plot draws the two modes' release latency; --curve {curve} has no plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'kvconn-core[plot]'") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    if os.path.splitext(path)[1].lstrip(".").lower() not in formats:
        raise ValueError(
            f"--plot {path}: matplotlib writes {', '.join(sorted(formats))}; "
            "end the file name in one of them (e.g. out.png)"
        )


def check_ports_free(first: int, ranks: int) -> None:
    """The ports ``--metrics-port`` needs (decode's, then each rank's) are
    free on 127.0.0.1; else one line naming the port taken."""
    for port in range(first, first + 1 + ranks):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                who = "decode's" if port == first else f"prefill rank {port - first - 1}'s"
                raise OSError(
                    f"--metrics-port {first}: port {port} ({who} metrics) is not free on 127.0.0.1: "
                    f"{exc.strerror or exc}"
                ) from None


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def sizing_defaults(parser: argparse.ArgumentParser) -> dict[str, object]:
    """The defaults of :data:`SIZING`: a refusal names the options changed from them."""
    return {flag: parser.get_default(_dest(flag)) for flag in SIZING}


def check_memory(args: argparse.Namespace, wl: Workload) -> None:
    """A run whose pages cannot fit in this machine's memory (the kernel
    would kill it, or a limit end it in a MemoryError) refused, naming the
    options that size it (``args.sizing_defaults``: :func:`sizing_defaults`)."""
    sources = source_pages(wl)
    pool = wl.decodes * wl.pool_pages * (wl.page_bytes + PER_POOL_PAGE_BYTES)
    raw = wl.pool_pages * wl.page_bytes + sources * wl.page_bytes if args.compare_raw else 0
    need = pool + sources * wl.page_bytes + raw
    have, bound = memory_available(shared=args.backend == "loopback")
    if need <= have:
        return
    defaults = getattr(args, "sizing_defaults", {})
    changed = [f for f in SIZING if f in defaults and getattr(args, _dest(f)) != defaults[f]]
    flags = " ".join(f"{f} {getattr(args, _dest(f))}" for f in changed) or "these sizes"
    raise ValueError(
        f"{flags} needs about {approx_size(need)} of memory (a pool of {wl.decodes * wl.pool_pages:,} "
        f"pages of {approx_size(wl.page_bytes)}, sources of {sources:,}{', the raw run' if raw else ''}), "
        f"over the {approx_size(have)} this machine has ({bound}): lower "
        + " or ".join(changed or ["--pages", "--page-bytes"])
    )
