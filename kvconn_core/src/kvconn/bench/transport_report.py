"""``kvconn bench --transport``'s tables, printed from the report dict
(the same dict ``--json`` writes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvconn.bench.results import PROFILE_PARTS, TARGET
from kvconn.bench.sizes import format_size

#: Above this machine-wide busy share during kvconn's runs the report warns:
#: the CPUs were saturated, so kvconn's control plane took its CPU time from
#: a transport that copies with the CPU.
SATURATED_BUSY = 90.0


def _print_cpu(console: Console, rep: dict[str, Any]) -> None:
    # Without every process's CPU (not Linux: no /proc) results.py adds no overhead.
    rows = [r for r in rep["shapes"] if "kvconn_extra_us_per_chunk" in r["cpu"]]
    if not rows:
        return
    parts = {"kvconn": ("decode", "rank"), "raw": ("decode", "raw_writer")}
    t = Table(title=escape(f"CPU per chunk on {rep['backend']}, every process (ms; medians)"))
    for col in (
        "shape",
        "kvconn: decode + rank",
        "raw: owner + writer",
        "kvconn's own: us/chunk, us/segment (segments)",
        "lowering us/chunk",
        "machine busy kvconn / raw",
        "steal",
    ):
        t.add_column(col, justify="left" if col == "shape" else "right")
    saturated = []
    for r in rows:
        kv, raw = r["cpu"]["kvconn"], r["cpu"]["raw"]
        cells = []
        for side, c in (("kvconn", kv), ("raw", raw)):
            a, b = (c[f"{p}_ms_per_chunk"] for p in parts[side])
            cells.append(f"{a + b:.3f} = {a:.3f} + {b:.3f}")
        own = r["cpu"]["kvconn_extra_us_per_chunk"], r["cpu"]["kvconn_extra_us_per_segment"]
        t.add_row(
            escape(r["shape"]),
            *cells,
            f"{own[0]:.0f}, {own[1]:.2f} ({r['segments_per_chunk']:.0f})",
            f"{r['lowering_us_per_chunk']:.0f}",
            f"{kv.get('busy', 0):.0f}% / {raw.get('busy', 0):.0f}%",
            f"{kv.get('steal', 0):.0f}% / {raw.get('steal', 0):.0f}%",
        )
        if kv.get("busy", 0) >= SATURATED_BUSY and not r["target_met"]:
            saturated.append(r["shape"])
    console.print(t)
    console.print(
        "kvconn's own: kvconn's CPU time (decode + rank) less raw's (owner + writer) for the same chunks, "
        "per chunk and per segment. Below 0 when kvconn's processes used less CPU than raw's: the two "
        "wait for a write to land differently (a raw API's status call may spin, kvconn's barrier "
        "sleeps between polls), and small figures are within the measurement's noise."
    )
    if saturated:
        console.print(
            f"[yellow]CPUs saturated[/yellow] during kvconn's runs of {escape(', '.join(saturated))}: its control "
            "plane (decode + rank, above) took CPU time from a transport that copies with the CPU, and "
            "threads waited for a core. More cores, or a transport whose copies the NIC does, "
            "narrow that gap (docs/bench.md)."
        )


_VERDICT_STYLE = {
    "met": "[green]yes[/green]",
    "missed": "[red]NO[/red]",
    "unclear": "[yellow]unclear[/yellow]",
}


def print_report(console: Console, rep: dict[str, Any]) -> None:
    opts = ", ".join(f"{k}={v}" for k, v in rep["backend_options"].items())
    t = Table(title=escape(f"kvconn bench --transport: {rep['backend']}" + (f" ({opts})" if opts else "")))
    for col, just in (
        ("shape (per chunk)", "left"),
        ("room / run", "right"),
        ("kvconn GB/s", "right"),
        ("raw GB/s", "right"),
        ("kvconn / raw", "right"),
        ("pairs: median \\[interval]", "right"),
        (f">= {TARGET:.0%}", "center"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rep["shapes"]:
        ok = _VERDICT_STYLE[r["verdict"]]
        if r["verify_bad_pages"]:
            ok += f" [red]({r['verify_bad_pages']} pages WRONG)[/red]"
        lo, hi = r["ratio_interval"]
        t.add_row(
            escape(r["shape"]),
            f"{format_size(r['chunk_bytes'] * r['room_chunks'])} / {format_size(r['bytes_per_run'])}",
            f"{r['kvconn_gbps']:.3f}  [{min(r['kvconn_gbps_all']):.2f}-{max(r['kvconn_gbps_all']):.2f}]",
            f"{r['raw_gbps']:.3f}  [{min(r['raw_gbps_all']):.2f}-{max(r['raw_gbps_all']):.2f}]",
            f"{r['ratio']:.1%}",
            f"{r['ratio_pairwise_median']:.1%} [{lo:.1%}-{hi:.1%}]",
            ok,
        )
    console.print(t)
    confidence = min(r["interval_confidence"] for r in rep["shapes"])
    console.print(
        "kvconn / raw: kvconn's median GB/s over raw's median GB/s, each taken over all repetitions. "
        "pairs: kvconn / raw within each repetition (the two ran back to back, alternating which ran "
        "first), and the median of those; the two differ when the machine's speed drifts between "
        f"repetitions, and only pairs judge the target. The interval holds the pairs' median with "
        f"probability >= {confidence:.0%}: met or missed when all of it is on one side; unclear: "
        "measure again (--repeat), or on a quieter machine."
    )
    _print_cpu(console, rep)
    prof = [r for r in rep["shapes"] if r.get("profile")]
    if prof:
        pt = Table(title=escape(f"--profile: where kvconn's time goes on {rep['backend']} (ms per chunk)"))
        pt.add_column("")
        for r in prof:
            pt.add_column(escape(r["shape"]), justify="right")

        def prow(label: str, fn: Callable[[dict[str, Any]], float]) -> None:
            pt.add_row(label, *(f"{fn(r):.3f}" for r in prof))

        prow("kvconn wall", lambda r: r["kvconn_ms_per_chunk"])
        for name, _ in PROFILE_PARTS:
            key = f"{name}_ms_per_chunk"
            pt.add_row(f"  {name}", *(f"{r['profile'][key]:.3f}" for r in prof))
        pt.add_row(
            "  transport, room's chunk 1/2/3/later",
            *(
                " / ".join("-" if v is None else f"{v:.3f}" for v in r["profile"]["transport_ms_by_position"])
                for r in prof
            ),
        )
        prow("raw wall", lambda r: r["raw_ms_per_chunk"])
        prow("  raw in child", lambda r: r["profile"]["raw_child_ms_per_chunk"])
        prow("request (ms/room)", lambda r: r["profile"]["request_ms"])
        prow("status (ms/room)", lambda r: r["profile"]["status_ms"])
        console.print(pt)
        for name, what in PROFILE_PARTS:
            console.print(f"  {name}: {what}")
        console.print(
            "  transport, room's chunk 1/2/3/later: the median chunk in the hooks by its place in the"
            " room; the first ones share the machine with the control plane (status, next request)"
        )
    missed = [f"{r['shape']} ({r['verdict']})" for r in rep["shapes"] if not r["target_met"]]
    pairs = f"{rep['shapes'][0]['repeats']} pairs; raw path: {rep['raw_path']}"
    backend = escape(rep["backend"])
    if missed:
        console.print(
            f"[red]5% target NOT met[/red] on {backend} for: {escape(', '.join(missed))} ({escape(pairs)})"
        )
    else:
        console.print(f"[green]5% target met[/green] on {backend} for every shape ({escape(pairs)})")
    console.print(
        "exit code: 1 only if a spot-checked page came out wrong (the bytes are checked after every "
        "measurement); the 95% target is judged here and does not gate the exit code: it depends on "
        "this machine's cores and load."
    )
