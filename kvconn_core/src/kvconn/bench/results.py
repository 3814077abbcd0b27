"""``kvconn bench --transport``'s figures: one shape's measurements
(:class:`ShapeResult`) summed up into the report's numbers and verdict, and
``--profile``'s breakdown of where kvconn's wall time went.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvconn.bench.shapes import Plan, split_room
from kvconn.bench.stats import median_interval

TARGET = 0.95  #: kvconn's bytes/s at least this fraction of raw's


@attrs.define
class ShapeResult:
    plan: Plan
    kvconn_s: list[float] = attrs.Factory(list)
    raw_s: list[float] = attrs.Factory(list)
    raw_child_s: list[float] = attrs.Factory(list)
    #: per measurement: CPU seconds of each process, and the machine's shares
    kvconn_cpu: list[dict[str, float]] = attrs.Factory(list)
    raw_cpu: list[dict[str, float]] = attrs.Factory(list)
    bad_pages: int = 0
    #: per chunk of the plan, the segments kvconn lowers it to, and the
    #: median time that lowering takes (kvconn pays it in Sender.send)
    segments_per_chunk: float = 0.0
    lowering_us_per_chunk: float = 0.0

    def summary(self) -> dict[str, Any]:
        n = self.plan.run_bytes
        kv = [n / s / 1e9 for s in self.kvconn_s]
        raw = [n / s / 1e9 for s in self.raw_s]
        kv_med, raw_med = statistics.median(kv), statistics.median(raw)
        pair = [k / r for k, r in zip(kv, raw, strict=True)]
        ratio = kv_med / raw_med if raw_med else 0.0
        interval = median_interval(pair)
        verdict = interval.verdict(TARGET)
        sh, chunks = self.plan.shape, self.plan.run_chunks
        cpu_ = {"kvconn": _cpu_summary(self.kvconn_cpu, chunks), "raw": _cpu_summary(self.raw_cpu, chunks)}
        return {
            "shape": sh.name,
            "page_bytes": sh.page_bytes,
            "chunk_pages": sh.chunk_pages,
            "chunk_bytes": sh.chunk_bytes,
            "scattered": sh.scattered,
            "room_chunks": self.plan.room_chunks,
            "rooms_per_run": self.plan.rooms,
            "rooms_in_flight": self.plan.inflight,
            "bytes_per_run": n,
            "repeats": len(kv),
            "kvconn_gbps": kv_med,
            "raw_gbps": raw_med,
            "ratio": ratio,
            "ratio_pairwise_median": statistics.median(pair),
            "ratio_pairwise_all": pair,
            #: holds the median pairwise ratio with probability interval_confidence
            "ratio_interval": [interval.low, interval.high],
            "interval_confidence": interval.confidence,
            #: met / missed: the whole interval is on that side of TARGET; else unclear
            "verdict": verdict,
            "target_met": verdict == "met",
            "kvconn_gbps_all": kv,
            "raw_gbps_all": raw,
            "raw_child_gbps": statistics.median(n / s / 1e9 for s in self.raw_child_s),
            "kvconn_ms_per_chunk": statistics.median(self.kvconn_s) * 1e3 / chunks,
            "raw_ms_per_chunk": statistics.median(self.raw_s) * 1e3 / chunks,
            "verify_bad_pages": self.bad_pages,
            "segments_per_chunk": self.segments_per_chunk,
            "lowering_us_per_chunk": self.lowering_us_per_chunk,
            "cpu": _with_overhead(cpu_, self.segments_per_chunk),
        }


def _with_overhead(cpu_: dict[str, dict[str, float]], segments: float) -> dict[str, Any]:
    """``cpu_`` plus kvconn's own CPU per chunk and per segment: its two
    processes' CPU time less the raw path's (owner + writer) for the same
    chunks; ``cpu_`` alone where a process's CPU is unknown (no /proc)."""
    kv, raw = cpu_["kvconn"], cpu_["raw"]
    try:
        kv_ms = kv["decode_ms_per_chunk"] + kv["rank_ms_per_chunk"]
        raw_ms = raw["decode_ms_per_chunk"] + raw["raw_writer_ms_per_chunk"]
    except KeyError:
        return cpu_
    extra_us = (kv_ms - raw_ms) * 1e3
    per_segment = extra_us / segments if segments else 0.0
    return {**cpu_, "kvconn_extra_us_per_chunk": extra_us, "kvconn_extra_us_per_segment": per_segment}


def _cpu_summary(samples: Sequence[Mapping[str, float]], chunks: int) -> dict[str, float]:
    """Medians over measurements of ``chunks`` chunks: ``<process>_ms_per_chunk``
    for each process, and the machine's ``busy`` / ``steal`` / ``idle`` percent."""
    out = {}
    for k in sorted({k for s in samples for k in s}):
        median = statistics.median(s[k] for s in samples if k in s)
        if k in ("busy", "steal", "idle"):
            out[k] = median
        else:
            out[f"{k}_ms_per_chunk"] = median * 1e3 / chunks
    return out


#: ``--profile`` components, in the order they add up to kvconn's wall time.
PROFILE_PARTS = (
    ("transport", "in the transport's hooks (on_post entry to on_done_barrier exit)"),
    ("gap_in_room", "worker between two chunks of a room (ledger, hooks, lowering, queue)"),
    ("gap_between_rooms", "worker between rooms (conclusion, status, next room's first chunk)"),
    ("run_start", "first request to first post (control plane in, on_request, queue)"),
    ("run_end", "last barrier to SUCCESS seen at decode (ledger, status message)"),
)


def breakdown(
    shape_index: int, res: ShapeResult, room_log: Mapping[int, list[float]], prof: Mapping[str, Any]
) -> dict[str, Any]:
    """Where one shape's kvconn wall time went, in ms per chunk (measured runs).

    One worker writes the chunks one after another, so a run's wall time is
    exactly the sum of :data:`PROFILE_PARTS`. Also the medians of one room's
    ``request_ms`` (decode's request to the rank's on_request) and
    ``status_ms`` (the room's last barrier to decode seeing SUCCESS)."""
    runs: dict[int, list[tuple[int, float, float, int]]] = {}  # run -> (room, post, barrier end, index)
    for room, index, t0, t1 in prof.get("chunks", []):
        room = int(room)
        shape, run, _ = split_room(room)
        if shape == shape_index and run >= 1:
            runs.setdefault(run, []).append((room, float(t0), float(t1), int(index)))
    requests = {int(room): float(t) for room, t in prof.get("requests", [])}
    parts = dict.fromkeys((name for name, _ in PROFILE_PARTS), 0.0)
    nchunks = 0
    req: list[float] = []
    status: list[float] = []
    by_position: dict[int, list[float]] = {}  # chunk index in its room (3: any later) -> seconds
    for chunks in runs.values():
        chunks.sort(key=lambda c: c[1])
        rooms = {c[0] for c in chunks}
        if not all(r in room_log and len(room_log[r]) == 2 for r in rooms):
            continue
        nchunks += len(chunks)
        for _, t0, t1, index in chunks:
            parts["transport"] += t1 - t0
            by_position.setdefault(min(index, 3), []).append(t1 - t0)
        for a, b in itertools.pairwise(chunks):
            parts["gap_in_room" if a[0] == b[0] else "gap_between_rooms"] += b[1] - a[2]
        parts["run_start"] += chunks[0][1] - min(room_log[r][0] for r in rooms)
        parts["run_end"] += max(room_log[r][1] for r in rooms) - chunks[-1][2]
        last = {room: t1 for room, _, t1, _ in chunks}
        req += [requests[r] - room_log[r][0] for r in rooms if r in requests]
        status += [room_log[r][1] - last[r] for r in rooms]
    if not nchunks:
        return {}
    out: dict[str, Any] = {f"{name}_ms_per_chunk": v * 1e3 / nchunks for name, v in parts.items()}
    out["sum_ms_per_chunk"] = sum(parts.values()) * 1e3 / nchunks
    out["request_ms"] = statistics.median(req) * 1e3 if req else 0.0
    out["status_ms"] = statistics.median(status) * 1e3 if status else 0.0
    # The first chunks of a room share the machine with the control plane
    # (the previous room's status, the next room's request): by position,
    # the median time in the hooks of a room's 1st, 2nd, 3rd and later chunks.
    out["transport_ms_by_position"] = [
        statistics.median(by_position[i]) * 1e3 if i in by_position else None for i in range(4)
    ]
    out["raw_child_ms_per_chunk"] = statistics.median(res.raw_child_s) * 1e3 / res.plan.run_chunks
    return out
