"""``kvconn bench --transport``'s measurements: for every shape and
repetition, the plan's rooms through kvconn and through the raw path, back to
back in alternating order so machine noise hits both alike.

* **kvconn**: this process is the page owner (one :class:`DecodeEndpoint`
  per shape, so each has its own page size), a child process is the prefill
  rank (:mod:`kvconn.bench.transport_child`). Decode asks for rooms (at most
  ``inflight`` at a time); the child's engine stand-in sends each room's
  chunks with ``Sender.send`` from ``on_request``; the worker posts them
  through the hooks, waits at the DONE barrier, the ledger concludes the
  room and the rank sends its status; a room counts when ``Receiver.poll()``
  says SUCCESS here. Timed from the first request to the last SUCCESS.
* **raw**: a second child process writes the very same segments (the same
  source and destination offsets, lowered by the same :class:`PageLayout`)
  into the same regions through the transport's raw API, one chunk at a
  time, each waited for before the next (:mod:`kvconn.bench.raw`). Timed
  here from the command to the child's reply.

Neither side fills source pages while timed (the source holds a fixed
pattern, written once): the comparison is of the transfer paths. After every
measurement a few destination pages (zeroed first) are checked against the
source.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import attrs

from kvconn.bench import cpu
from kvconn.bench.raw import CLOSE_S
from kvconn.bench.results import TARGET, ShapeResult, breakdown
from kvconn.bench.shapes import (
    Plan,
    Shape,
    check_pages,
    kv_shapes,
    kv_side,
    make_plan,
    page_offsets,
    room_id,
    source_pattern,
)
from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import Message, RoomStatus
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.runtime.layout import PageLayout
from kvconn.testing.child import Child, ChildError, StderrLog
from kvconn.transport import capabilities_of


class _Endpoint(DecodeEndpoint):
    """A decode endpoint that also wakes the bench on every room status, so
    it waits for SUCCESS without a busy poll stealing the transport's core."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.changed = threading.Event()
        super().__init__(*args, **kwargs)

    def _on_message(self, msg: Message) -> None:
        super()._on_message(msg)
        if isinstance(msg, RoomStatus):
            self.changed.set()


def _child(args: dict[str, Any]) -> Child:
    """A child process of this bench (:mod:`kvconn.bench.transport_child`)."""
    name = f"bench {args['role']} child"
    return Child("kvconn.bench.transport_child", args, log=StderrLog(), name=name, failure=ChildError)


def _kvconn_run(
    ep: _Endpoint,
    plan: Plan,
    shape_index: int,
    run: int,
    rooms: int,
    log: dict[int, list[float]] | None = None,
) -> float:
    """Rooms ``0..rooms-1`` of ``plan`` through kvconn; seconds from the first
    request to the last SUCCESS. ``log``: room -> [requested, seen SUCCESS]."""
    t0 = time.perf_counter()
    active: deque[Receiver] = deque()
    issued = done = 0
    last_progress = time.monotonic()
    while done < rooms:
        ep.changed.clear()  # before looking: a status arriving later wakes the wait
        while active:
            state = active[0].poll()
            if state is KVPoll.FAILED:
                raise RuntimeError(f"room {active[0].room} failed: {active[0].failure()}")
            if state is not KVPoll.SUCCESS:
                break
            rx = active.popleft()
            rx.finish()
            if log is not None:
                log[rx.room].append(time.monotonic())
            done += 1
            last_progress = time.monotonic()
        while issued < rooms and len(active) < plan.inflight:
            room = room_id(shape_index, run, issued)
            if log is not None:
                log[room] = [time.monotonic()]
            active.append(ep.receiver(room, plan.dst[issued]))
            issued += 1
        if done < rooms:
            ep.changed.wait(1.0)
            if time.monotonic() - last_progress > 60:
                raise RuntimeError(f"no room concluded for 60 s ({done}/{rooms} done)")
    return time.perf_counter() - t0


def _lowering(plan: Plan, lower: Callable[[list[int], list[int]], Any]) -> tuple[float, float]:
    """(segments per chunk, median microseconds to lower a chunk) over the plan."""
    counts, times = [], []
    for j in range(plan.rooms):
        for src, dst in plan.chunks(j):
            t0 = time.perf_counter()
            table = lower(src, dst)
            times.append(time.perf_counter() - t0)
            counts.append(len(table))
    return statistics.mean(counts), statistics.median(times) * 1e6


def run_backend(
    name: str,
    options: Mapping[str, str],
    shapes: Sequence[Shape],
    args: argparse.Namespace,
    step: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Measure every shape ``args.repeat`` times on backend ``name``, as
    ``--bytes-per-run``, ``--room-bytes``, ``--inflight``, ``--seed`` and
    ``--profile`` say; the report dict."""
    backend = get_backend(name)
    kv = kv_shapes(shapes)
    seed, repeat, profile = args.seed, args.repeat, args.profile
    plans = [make_plan(s, args.bytes_per_run, args.room_bytes, args.inflight, seed) for s in shapes]
    source_pages = max(p.source_pages for p in plans)
    source_bytes = max(p.source_pages * p.shape.page_bytes * p.shape.buffers for p in plans)
    source = source_pattern(source_bytes, seed)
    limit = capabilities_of(backend, options).max_write_timeout_s
    abort_s = max(30.0, (limit or 0) + 5)
    common: dict[str, Any] = {
        "backend": name,
        "options": dict(options),
        "source_bytes": source_bytes,
        "source_pages": source_pages,
        "seed": seed,
        "kv": attrs.asdict(shapes[0]) if kv else None,
    }
    step("starting the prefill rank process")
    rank = _child(
        {
            **common,
            "role": "rank",
            "src": [p.src for p in plans],
            "chunk_pages": [p.shape.chunk_pages for p in plans],
            "write_timeout_s": min(20.0, abort_s / 2),
            "abort_timeout_s": abort_s,
            "profile": profile,
        },
    )
    room_log: dict[int, list[float]] | None = {} if profile else None
    child_profile: dict[str, Any] = {}
    endpoints: list[_Endpoint] = []
    raw: Child | None = None
    try:
        address = str(rank.next_with("address", 120, "the prefill rank's start")["address"])
        config = Config(
            write_timeout_s=min(20.0, abort_s / 2), abort_timeout_s=abort_s, backend_options=options
        )
        for p in plans:
            if kv:
                arrays, layout = kv_side(p.shape, p.pool_pages)
                ep = _Endpoint(backend, prefill=[address], config=config, buffers=arrays, layout=layout)
            else:
                ep = _Endpoint(backend, p.pool_pages, p.shape.page_bytes, [address], config)
            endpoints.append(ep)
        step("starting the raw writer process")
        shapes_cfg = [
            {
                "layout": ep.layout.to_bytes().hex() if ep.layout is not None else "",
                "metadata": ep.region.metadata.hex(),
                "page_bytes": p.shape.page_bytes,
                "chunk_pages": p.shape.chunk_pages,
                "src": p.src,
                "dst": p.dst,
            }
            for p, ep in zip(plans, endpoints, strict=True)
        ]
        raw = _child({**common, "role": "raw", "shapes": shapes_cfg})
        raw_how = str(raw.next_with("ready", 120, "the raw writer's start")["ready"])
        results = [ShapeResult(p) for p in plans]
        for p, ep, res in zip(plans, endpoints, results, strict=True):
            if ep.layout is not None:
                src_layout = p.shape.engine(source_pages).layout()
                lower: Callable[[list[int], list[int]], Any] = partial(src_layout.segments, ep.layout)
            else:
                lower = partial(PageLayout(p.shape.page_bytes, 1).segments, 0)
            res.segments_per_chunk, res.lowering_us_per_chunk = _lowering(p, lower)
        meter = cpu.Meter({"decode": None, "rank": rank.proc.pid, "raw_writer": raw.proc.pid})

        def measure_raw(i: int, rooms: int) -> tuple[float, float]:
            assert raw is not None
            t0 = time.perf_counter()
            raw.send_line(json.dumps({"op": "run", "shape": i, "rooms": rooms}))
            reply = raw.next_with("seconds", 300, f"the raw writer's run of shape {i}")
            return time.perf_counter() - t0, float(reply["seconds"])

        # warm-up: connections, first-touch page faults, caches
        for i, (p, ep) in enumerate(zip(plans, endpoints, strict=True)):
            step(f"warm-up {p.shape.name}")
            _kvconn_run(ep, p, i, 0, min(p.rooms, p.inflight + 1))
            measure_raw(i, min(p.rooms, p.inflight + 1))
        checks_of = [check_pages(p) for p in plans]
        for r in range(repeat):
            for i, (p, ep, res) in enumerate(zip(plans, endpoints, results, strict=True)):
                step(f"repeat {r + 1}/{repeat}: {p.shape.name}")
                checks = checks_of[i]
                for first_kvconn in (True, False) if r % 2 == 0 else (False, True):
                    pb = p.shape.page_bytes
                    for _, d in checks:
                        for at in page_offsets(p.shape, p.pool_pages, d):
                            ep.region.write(at, bytes(pb))
                    with meter as m:
                        if first_kvconn:
                            res.kvconn_s.append(_kvconn_run(ep, p, i, r + 1, p.rooms, room_log))
                        else:
                            wall, child = measure_raw(i, p.rooms)
                            res.raw_s.append(wall)
                            res.raw_child_s.append(child)
                    (res.kvconn_cpu if first_kvconn else res.raw_cpu).append(m.result)
                    for s, d in checks:
                        src_at = page_offsets(p.shape, source_pages, s)
                        dst_at = page_offsets(p.shape, p.pool_pages, d)
                        if any(
                            ep.region.read(b, pb) != source[a : a + pb]
                            for a, b in zip(src_at, dst_at, strict=True)
                        ):
                            res.bad_pages += 1
    finally:
        if raw is not None:
            raw.close(CLOSE_S)
        for ep in endpoints:
            ep.close()
        rank.close(CLOSE_S)  # it reports its profile once its stdin closes
        child_profile = rank.last_with("profile") or {}
    rows = [res.summary() for res in results]
    if room_log is not None and child_profile:
        for i, row in enumerate(rows):
            row["profile"] = breakdown(i, results[i], room_log, child_profile)
    return {
        "backend": name,
        "backend_options": dict(options),
        "raw_path": raw_how,
        "shapes": rows,
        "target": f"kvconn >= {TARGET:.0%} of raw bytes/s (the median's interval over {repeat} pairs)",
        "target_met": all(r["target_met"] for r in rows),
        "verified": all(r["verify_bad_pages"] == 0 for r in rows),
    }
