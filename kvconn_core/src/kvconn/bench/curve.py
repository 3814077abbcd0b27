"""``kvconn bench --curve rooms|ranks|storm``: kvconn's mode at each point of
one axis, back to back in one run, and each point's ratios to the first.
(``--curve segments|tombstones|fleet`` are benches of their own: see
:data:`OWN` and :func:`run_own`.)

* ``rooms``: requests in flight (``--concurrency``), default 8 and 512;
* ``ranks``: prefill rank processes (``--ranks``), default 2 and 8;
* ``storm``: the share of requests decode aborts mid-transfer
  (``--abort-fraction``), default 0.1 and 0.9; the storm's release p99 is
  also stated against the decode deadline (``--abort-timeout``).

Every other option is the abort bench's, the same at every point: the
figures differ by the axis alone. The machine's load differs too, which is
why the points run in one process, one after the other, and the CPU share
of each is printed beside it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from kvconn.bench import fleet, segments, tombstones
from kvconn.bench.mode_result import ModeResult
from kvconn.bench.output import spinner, write_json
from kvconn.bench.preflight import WHOLE_POINTS
from kvconn.bench.stats import ratio
from kvconn.bench.workload import ModeRun, Settings, Workload, plan, pool_pages

#: Each axis: the Workload field it varies.
AXES = {"rooms": "concurrency", "ranks": "ranks", "storm": "abort_fraction"}
#: Each curve's points without ``--curve-points``.
DEFAULT_POINTS: dict[str, tuple[float, ...]] = {
    "rooms": (8, 512),
    "ranks": (2, 8),
    "storm": (0.1, 0.9),
    "segments": (118, 1000, 5000, 20000),
    "tombstones": (10000, 100000),
    "fleet": (0.1, 1, 10),
}


#: Curves with a module of their own (of the same name), and the options each
#: reads besides ``--curve``, ``--curve-points`` and the output's (``--json``,
#: ``-v``, ``--no-progress``): cli.py refuses any other.
OWN: dict[str, frozenset[str]] = {
    "segments": frozenset({"backend", "backend_option", "repeat", "seed"}),
    "tombstones": frozenset(),
    "fleet": frozenset({"seed"}),
}
CHOICES = sorted([*AXES, *OWN])


def run_own(args: argparse.Namespace, options: dict[str, str], console: Console, err: Console) -> int:
    """``--curve segments|tombstones|fleet``: print its report, write its
    JSON; exit code 1 if a segments point's checked bytes came out wrong."""
    with spinner(err, args.no_progress) as progress:
        task = progress.add_task(f"--curve {args.curve}", total=None)
        return _run_own(args, options, console, lambda what: progress.update(task, description=what))


def _run_own(
    args: argparse.Namespace, options: dict[str, str], console: Console, step: Callable[[str], None]
) -> int:
    code = 0
    if args.curve == "segments":
        sizes = [int(n) for n in points("segments", args.curve_points)]
        report = segments.run(args, options, sizes, step)
        segments.print_report(console, report)
        code = 0 if all(b["verified"] for b in report["backends"]) else 1
    elif args.curve == "tombstones":
        rows = []
        for rooms in points("tombstones", args.curve_points):
            step(f"{rooms:,} tombstones")
            rows.append(tombstones.measure(int(rooms)))
            console.print(tombstones.report(rows[-1]))
        report = {"curve": "tombstones", "points": rows}
    else:
        base = fleet.Fleet(seed=args.seed)
        rows = []
        for scale in points("fleet", args.curve_points):
            step(f"fleet x {scale:g}")
            rows.append(fleet.simulate(base.scaled(scale)))
        console.print(fleet.report(rows, base))
        report = {"curve": "fleet", "points": rows}
    if args.json:
        write_json(args.json, report)
    return code


def points(curve: str, text: str | None) -> list[float]:
    """The curve's points: ``text`` (comma-separated numbers, checked by
    :func:`kvconn.bench.preflight.points_arg`; whole where the curve counts
    something) or its defaults."""
    if not text:
        return list(DEFAULT_POINTS[curve])
    values = [float(x) for x in text.split(",") if x.strip()]
    if curve in WHOLE_POINTS:
        values = [int(v) for v in values]
    if curve in AXES and len(values) < 2:
        raise ValueError(f"--curve-points needs at least two points, got {text!r}")
    if curve in OWN and min(values) <= 0:
        raise ValueError(f"--curve-points for --curve {curve} must be > 0, got {text!r}")
    return values


def run(args: argparse.Namespace, base: Workload, settings: Settings, window_s: float) -> dict[str, Any]:
    """Run kvconn's mode at every point of ``args.curve`` (each after a warm-up
    of its streaming rooms, not measured; every point aborts on the same
    schedule, ``window_s``); the report."""
    field = AXES[args.curve]
    rows: list[dict[str, Any]] = []
    for value in points(args.curve, args.curve_points):
        changes: dict[str, Any] = {field: value}
        wl = attrs.evolve(base, **changes)
        if wl.page_bytes % (8 * wl.ranks):
            raise ValueError(f"--page-bytes must split evenly over {wl.ranks} ranks (in 8-byte words)")
        if args.pool_pages is None:
            wl = attrs.evolve(wl, pool_pages=pool_pages(wl.pages, wl.concurrency, wl.stream_requests))
        work, stream_rooms = plan(wl)
        mode = ModeRun(wl, settings)
        try:
            mode.stream(stream_rooms, lambda _: None)
            result = mode.run(work, window_s, lambda _: None)
        finally:
            mode.close()
        rows.append(_row(field, value, result))
    first = rows[0]
    # A point without aborts (a storm's baseline of 0) has no release p99:
    # the p99s compare with the first point that has one.
    first_p99 = next((row["release_p99_ms"] for row in rows if row["release_p99_ms"]), 0.0)
    first_own = next((row["own_share_ms"] for row in rows if row["own_share_ms"]), 0.0)
    for row in rows:
        row["p99_ratio"] = ratio(row["release_p99_ms"], first_p99) if row["release_p99_ms"] else None
        row["throughput_ratio"] = ratio(row["throughput_gbps"], first["throughput_gbps"])
        row["p99_vs_timeout"] = row["release_p99_ms"] / (args.abort_timeout * 1e3)
        row["own_share_ratio"] = ratio(row["own_share_ms"], first_own) if row["own_share_ms"] else None
    return {"curve": args.curve, "axis": field, "window_ms": window_s * 1e3, "points": rows}


def _row(field: str, value: float, r: ModeResult) -> dict[str, Any]:
    s = r.summary()
    lat = s["release_latency_ms"]
    return {
        field: value,
        "requests": r.requests,
        "aborted": r.aborted_mid_transfer + r.prefill_failed,
        "release_p50_ms": lat.get("p50", 0.0),
        "release_p99_ms": lat.get("p99", 0.0),
        "prefill_fail_p99_ms": s["prefill_fail_release_latency_ms"].get("p99", 0.0),
        "throughput_gbps": s["throughput_gbps"],
        "violations": len(r.violations),
        "violation_examples": [v.as_dict() for v in r.violations[:5]],
        "unreleased_end": r.rooms_unreleased_end,
        "releases_by_proof": dict(r.releases_by_proof),
        "cpu": dict(r.cpu),
        **_kvconn_share(r.cpu_per_request_us),
    }


def _kvconn_share(parts: dict[str, Any]) -> dict[str, Any]:
    """What of a point is kvconn's own: its CPU at decode per request and at
    the busiest rank per chunk, a rank's own share of a release (the mean
    over every rank's acks, ms), the page faults per request, and the time
    threads waited for a CPU per request (the machine's share)."""
    if not parts:
        return {"kvconn_decode_us": None, "kvconn_rank_chunk_us": None, "own_share_ms": None,
                "page_faults_per_request": None, "cpu_wait_us": None}  # fmt: skip
    shares = [r["abort_own_ms"] for r in parts["ranks"] if r["abort_own_ms"]["acks"]]
    acks = sum(x["acks"] for x in shares)
    return {
        "kvconn_decode_us": parts["kvconn_decode"],
        "kvconn_rank_chunk_us": parts["kvconn_rank_per_chunk"],
        "own_share_ms": sum(x["mean"] * x["acks"] for x in shares) / acks if acks else None,
        "page_faults_per_request": parts["page_faults"],
        "cpu_wait_us": parts["decode"]["cpu_wait"] + sum(r["cpu_wait"] for r in parts["ranks"]),
    }


def print_report(console: Console, report: dict[str, Any]) -> None:
    field = report["axis"]
    table = Table(title=f"kvconn bench --curve {report['curve']} (kvconn's mode, ratios to the first point)")
    for col in (field, "requests / aborted", "release p50 / p99 ms", "p99 x first", "GB/s", "GB/s x first"):
        table.add_column(col, justify="right")
    table.add_column("p99 / timeout", justify="right")
    table.add_column("prefill-failed p99 ms", justify="right")
    table.add_column("violations, unreleased", justify="right")
    table.add_column("kvconn CPU us: decode/req, rank/chunk", justify="right")
    table.add_column("rank's own share ms (x first)", justify="right")
    table.add_column("faults/req", justify="right")
    table.add_column("CPU busy / stolen, wait us/req", justify="right")
    for row in report["points"]:
        cpu = row["cpu"]
        own = row["own_share_ms"]
        table.add_row(
            f"{row[field]:g}",
            f"{row['requests']} / {row['aborted']}",
            f"{row['release_p50_ms']:.2f} / {row['release_p99_ms']:.2f}",
            _x(row["p99_ratio"]),
            f"{row['throughput_gbps']:.3f}",
            _x(row["throughput_ratio"]),
            f"{row['p99_vs_timeout']:.1e}",
            f"{row['prefill_fail_p99_ms']:.2f}",
            f"{row['violations']}, {row['unreleased_end']}",
            _us(row["kvconn_decode_us"], row["kvconn_rank_chunk_us"]),
            "n/a" if own is None else f"{own:.3f} ({_x(row['own_share_ratio'])})",
            "n/a" if row["page_faults_per_request"] is None else f"{row['page_faults_per_request']:.1f}",
            (f"{cpu.get('busy', 0):.0f}% / {cpu.get('steal', 0):.0f}%" if cpu else "n/a")
            + ("" if row["cpu_wait_us"] is None else f", {row['cpu_wait_us']:.0f}"),
        )
    console.print(table)
    console.print(
        "goals (issue 35): rooms and ranks, p99 within 2x and throughput within 10% of the first point; "
        "storm, 0 violations and every room released by proof. Issue 42: a rank's own share of a "
        "release within 2x of the first point, page faults per request flat."
    )
    for row in report["points"]:
        for v in row["violation_examples"]:
            console.print(
                f"violation at {field} {row[field]:g}: {v['kind']}, room {v['room']}: {v['detail']}"
            )


def _us(decode: float | None, rank: float | None) -> str:
    return "n/a" if decode is None or rank is None else f"{decode:.0f}, {rank:.0f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
