"""The fault matrix's table (:mod:`kvconn.testing.scenarios`), as ``kvconn
bench`` prints it: one row per fault, each cell kvconn's figure, then the
timeout-only mode's; kvconn's in red where it misses its target. Under it,
the targets kvconn missed, row by row, and the load the rows ran at."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

from kvconn.testing import scenarios

Row = Mapping[str, Any]


def _capacity(o: Row) -> str:
    if o["capacity_back_s"] is not None:
        return f"{o['capacity_back_s']:.2f} s"
    return "n/a" if str(o["capacity_note"]).startswith("n/a") else "not back"


#: (column, kvconn's cell, kvconn misses its target)
COLUMNS: tuple[tuple[str, Callable[[Row], str], Callable[[Row], bool]], ...] = (
    ("corrupted", lambda o: str(o["corrupted"]), lambda o: bool(o["corrupted"])),
    ("hung", lambda o: str(o["hung"]), lambda o: bool(o["hung"])),
    ("answered", lambda o: str(o["answered"]), lambda o: any(m.startswith("answered") for m in o["misses"])),
    ("recomputed", lambda o: str(o["recomputed"]), lambda o: False),
    ("failed", lambda o: str(o["failed"]), lambda o: False),
    ("pinned page-s", lambda o: f"{o['pinned_page_seconds']:.0f}", lambda o: False),
    ("back after proof", _capacity, lambda o: any(m.startswith("pages") for m in o["misses"])),
    ("false downs", lambda o: str(o["false_rank_downs"]), lambda o: bool(o["false_rank_downs"])),
)


def table(faults: Sequence[Row]) -> Table:
    t = Table(
        title=escape(
            f"production faults (loopback, {scenarios.RATE:g} requests/s; writer deadline {scenarios.WRITE_S:g} s, "
            f"peer timeout {scenarios.PEER_S:g} s, decode deadline {scenarios.DEADLINE_S:g} s). Each cell: "
            "kvconn / timeout-only; a request not ended within its bound hung"
        )
    )
    t.add_column("fault")
    t.add_column("requests", justify="right")
    t.add_column("bound", justify="right")
    for name, _, _ in COLUMNS:
        t.add_column(name, justify="right")
    by = {(f["fault"], f["mode"]): f for f in faults}
    for fault in scenarios.FAULTS:
        k, leg = by.get((fault, "kvconn")), by.get((fault, "legacy"))
        if k is None or leg is None:
            continue
        if k["skipped"] or k["error"] or leg["error"]:
            why = f"not run: {k['skipped']}" if k["skipped"] else f"error: {k['error'] or leg['error']}"
            t.add_row(escape(fault), "-", "-", escape(why), *["-"] * (len(COLUMNS) - 1))
            continue
        cells = []
        for _, cell, missed in COLUMNS:
            mine = escape(cell(k))
            cells.append(f"{'[red]' + mine + '[/red]' if missed(k) else mine} / {escape(cell(leg))}")
        n = str(k["requests"]) if k["requests"] == leg["requests"] else f"{k['requests']} / {leg['requests']}"
        t.add_row(escape(fault), n, f"{k['bound_s']:.2f} s", *cells)
    return t


def notes(faults: Sequence[Row]) -> list[str]:
    """The targets kvconn missed (each with what its requests failed or hung
    on), and the load."""
    lines = []
    for f in faults:
        if f["mode"] == "kvconn" and f["misses"]:
            why = "; ".join(f"{n} x {reason}" for reason, n in f["reasons"][:2])
            lines.append(
                f"kvconn missed in {f['fault']}: {', '.join(f['misses'])}" + (f" ({why})" if why else "")
            )
    loads = [f["load"] for f in faults if not f["skipped"] and not f["error"]]
    if loads:
        lines.append(
            f"faults ran at a 1-minute load average of {min(loads):.0f}-{max(loads):.0f} "
            "(both modes at once, each fault's processes fresh)"
        )
    return lines
