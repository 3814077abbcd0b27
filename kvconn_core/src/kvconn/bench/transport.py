"""``kvconn bench --transport``: bytes/s of the same chunked writes through
kvconn and through the transport's raw API, side by side in one run.

For every shape (by default 1024 scattered 4 KiB pages per chunk, one 1 MiB
page per chunk, one 64 MiB page per chunk) and every repetition, two
measurements run back to back, in alternating order so machine noise hits
both alike:

* **kvconn**: this process is the page owner (one :class:`DecodeEndpoint`
  per shape, so each has its own page size), a child process is the prefill
  rank (:class:`PrefillRank`, one worker). Decode asks for rooms (at most
  ``inflight`` at a time); the child's engine stand-in sends each room's
  chunks with ``Sender.send`` from ``on_request``; the worker posts them
  through the hooks, waits at the DONE barrier, the ledger concludes the
  room and the rank sends its status; a room counts when ``Receiver.poll()``
  says SUCCESS here. Timed from the first request to the last SUCCESS.
* **raw**: a second child process writes the very same segments (the same
  source and destination offsets, lowered by the same :class:`PageLayout`)
  into the same regions through the transport's raw API, one chunk at a
  time, each waited for before the next (``kvconn_<name>.raw.RawWriter``:
  nixl ``initialize_xfer`` + ``transfer`` + ``check_xfer_state``, Mooncake
  ``batch_transfer_async_write`` + ``get_batch_transfer_status``; a backend
  without such a module, e.g. loopback, has its writer's own post/barrier
  path called directly: no pluggy, ledger or control plane). Timed here
  from the command to the child's reply.

Neither side fills source pages while timed (the source holds a fixed
pattern, written once): the comparison is of the transfer paths. After every
measurement a few destination pages (zeroed first) are checked against the
source.

Run as a module, this file is also the two child processes:
``python -m kvconn.bench.transport rank|raw`` with a JSON config on stdin's
first line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import numpy as np
from rich.console import Console
from rich.table import Table

from kvconn.bench import cpu
from kvconn.bench.child import Child, read_config
from kvconn.bench.raw import HookRaw, open_raw
from kvconn.bench.sizes import MiB, format_size, parse_size, size_arg
from kvconn.bench.stats import median_interval
from kvconn.chunk import Chunk, Segment
from kvconn.config import Config
from kvconn.hookspecs import hookimpl
from kvconn.layout import KVLayout
from kvconn.plugins import get_backend
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import Message, RoomStatus
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.runtime.layout import PageLayout
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.kvpattern import EngineShape
from kvconn.transport import Settlement, capabilities_of

TARGET = 0.95  #: kvconn's bytes/s at least this fraction of raw's
DEFAULT_SHAPES = ("4096x1024:scattered", "1048576x1", "67108864x1")
_SHAPE_SHIFT, _RUN_SHIFT = 40, 20
_SPREAD = 4  #: scattered shapes draw a room's pages from a slot 4x its size


# --------------------------------------------------------------------------
# shapes and plans


#: A KV page of the ``kv:`` shapes, in each layer's K and V buffer: 16 tokens
#: x 8 KV heads x head dim 128 x fp16 (a Llama-3-8B page on one TP rank).
KV_TOKENS, KV_HEADS, KV_HEAD_BYTES = 16, 8, 256


@attrs.frozen
class Shape:
    """``chunk_pages`` pages of ``page_bytes`` per chunk; ``scattered``: the
    pages of a chunk are random, non-adjacent pages on both sides.

    ``layers`` > 0: an engine's KV cache instead, in per-layer K and V numpy
    buffers that the endpoints register (no copy): a page is a slot of
    ``page_bytes`` in each of the ``2 x layers`` buffers, and a chunk of
    scattered pages is ``2 x layers x chunk_pages`` segments."""

    page_bytes: int
    chunk_pages: int = 1
    scattered: bool = False
    layers: int = 0

    @property
    def buffers(self) -> int:
        """Buffers a page spans (1: a flat region)."""
        return 2 * self.layers if self.layers else 1

    @property
    def chunk_bytes(self) -> int:
        return self.page_bytes * self.chunk_pages * self.buffers

    @property
    def name(self) -> str:
        size = format_size(self.page_bytes)
        kind = " scattered" if self.scattered else ""
        if self.layers:
            return f"{self.layers} layers x K/V x {self.chunk_pages} x {size}{kind}"
        if self.chunk_pages == 1:
            return f"1 x {size}"
        return f"{self.chunk_pages} x {size}{kind}"

    def engine(self, pages: int) -> EngineShape:
        """The KV geometry of a ``kv:`` shape, over ``pages`` pages."""
        return EngineShape(self.layers, pages, KV_TOKENS, KV_HEADS, KV_HEAD_BYTES)

    @classmethod
    def parse(cls, spec: str) -> Shape:
        """``PAGE_BYTES[xCHUNK_PAGES][:scattered]``, e.g. ``4096x1024:scattered``;
        or ``kv:LAYERSxCHUNK_PAGES[:scattered]``, e.g. ``kv:32x64:scattered``."""
        if spec.lower().startswith("kv:"):
            return cls._parse_kv(spec)
        body, _, flag = spec.partition(":")
        if flag not in ("", "scattered"):
            raise ValueError(f"shape {spec!r}: the only flag is ':scattered'")
        page, _, pages = body.lower().partition("x")
        try:
            shape = cls(parse_size(page), int(pages or 1), flag == "scattered")
        except ValueError:
            raise ValueError(f"shape {spec!r} is not PAGE_BYTES[xCHUNK_PAGES][:scattered]") from None
        if shape.page_bytes < 8 or shape.chunk_pages < 1:
            raise ValueError(f"shape {spec!r}: page_bytes >= 8 and chunk pages >= 1")
        return shape

    @classmethod
    def _parse_kv(cls, spec: str) -> Shape:
        body, _, flag = spec[3:].partition(":")
        if flag not in ("", "scattered"):
            raise ValueError(f"shape {spec!r}: the only flag is ':scattered'")
        layers, _, pages = body.lower().partition("x")
        try:
            n_layers, n_pages = int(layers), int(pages or 1)
        except ValueError:
            raise ValueError(f"shape {spec!r} is not kv:LAYERSxCHUNK_PAGES[:scattered]") from None
        if n_layers < 1 or n_pages < 1:
            raise ValueError(f"shape {spec!r}: layers and chunk pages >= 1")
        page = KV_TOKENS * KV_HEADS * KV_HEAD_BYTES
        return cls(page, n_pages, flag == "scattered", n_layers)


@attrs.frozen
class Plan:
    """One shape's rooms: the same for kvconn and raw, in every repetition."""

    shape: Shape
    room_chunks: int
    inflight: int
    pool_pages: int  #: decode pages
    source_pages: int  #: source pages (shard-sized, one rank)
    src: list[list[int]]  #: per room j: its source pages, in chunk order
    dst: list[list[int]]  #: per room j: its destination pages

    @property
    def rooms(self) -> int:
        return len(self.src)

    @property
    def room_bytes(self) -> int:
        return self.room_chunks * self.shape.chunk_bytes

    @property
    def run_bytes(self) -> int:
        return self.rooms * self.room_bytes

    def chunks(self, j: int) -> Iterator[tuple[list[int], list[int]]]:
        cp = self.shape.chunk_pages
        for first in range(0, len(self.src[j]), cp):
            yield self.src[j][first : first + cp], self.dst[j][first : first + cp]


def make_plan(shape: Shape, run_bytes: int, room_bytes: int, inflight: int, seed: int) -> Plan:
    room_chunks = max(1, room_bytes // shape.chunk_bytes)
    rooms = max(1, run_bytes // (room_chunks * shape.chunk_bytes))
    inflight = max(1, min(inflight, rooms))
    room_pages = room_chunks * shape.chunk_pages
    # A KV shape's pages span many buffers: a slot of its own size, shuffled,
    # scatters them as well (few pages stay adjacent on both sides) at a
    # quarter of the memory.
    spread = _SPREAD if shape.scattered and not shape.layers else 1
    slot_pages = room_pages * spread
    rng = random.Random(seed ^ shape.page_bytes ^ (shape.chunk_pages << 32))
    src: list[list[int]] = []
    dst: list[list[int]] = []
    for j in range(rooms):
        # Room j uses slot j % inflight of decode's pool: rooms in flight
        # together never share a page (room j + inflight starts after j ends).
        base = (j % inflight) * slot_pages
        if shape.scattered:
            src.append(rng.sample(range(slot_pages), room_pages))
            dst.append([base + p for p in rng.sample(range(slot_pages), room_pages)])
        else:
            src.append(list(range(room_pages)))
            dst.append(list(range(base, base + room_pages)))
    return Plan(shape, room_chunks, inflight, inflight * slot_pages, slot_pages, src, dst)


def _kv_shapes(shapes: Sequence[Shape]) -> bool:
    """Whether the run is of ``kv:`` shapes (one rank serves them all, so
    they cannot mix with flat ones, nor differ in layers)."""
    layers = {s.layers for s in shapes}
    if len(layers) > 1 and 0 in layers:
        raise ValueError("kv: shapes and flat shapes cannot run together (run them one after another)")
    if len(layers) > 1:
        raise ValueError("kv: shapes of one run must have the same number of layers")
    return bool(shapes) and shapes[0].layers > 0


def _kv_side(shape: Shape, pages: int, source: bytes | None = None) -> tuple[list[Any], KVLayout]:
    """An engine's per-layer buffers of ``pages`` pages (filled from the flat
    ``source`` bytes, buffer after buffer) and their layout (TP 1)."""
    engine = shape.engine(pages)
    arrays = engine.buffers()
    if source is not None:
        at = 0
        for arr in arrays:
            arr[:] = np.frombuffer(source, dtype=np.uint8, count=arr.nbytes, offset=at)
            at += arr.nbytes
    return arrays, engine.layout()


def _page_offsets(shape: Shape, pool_pages: int, page: int) -> list[int]:
    """Flat offsets of ``page`` in each buffer of a side of ``pool_pages`` pages."""
    buffer_bytes = pool_pages * shape.page_bytes
    return [b * buffer_bytes + page * shape.page_bytes for b in range(shape.buffers)]


def source_pattern(nbytes: int, seed: int) -> bytes:
    """The bytes both children hold in their source memory. (numpy's
    generator: ``random.randbytes`` overflows at 256 MiB, a room of 256 MiB
    needs that much source.)"""
    return np.random.default_rng(seed).bytes(nbytes)


def room_id(shape_index: int, run: int, j: int) -> int:
    return (shape_index << _SHAPE_SHIFT) | (run << _RUN_SHIFT) | j


# --------------------------------------------------------------------------
# children


def _rank_child() -> None:
    """A prefill rank whose 'engine' sends a room's chunks as soon as decode asks."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = read_config()
    backend = get_backend(cfg["backend"])
    src_plans: list[list[list[int]]] = cfg["src"]
    chunk_pages: list[int] = cfg["chunk_pages"]
    config = Config(
        write_timeout_s=float(cfg["write_timeout_s"]),
        abort_timeout_s=float(cfg["abort_timeout_s"]),
        backend_options=dict(cfg["options"]),
    )
    senders: deque[Any] = deque()
    profiler = _Profiler() if cfg.get("profile") else None

    def on_request(room: int, npages: int) -> None:
        if profiler is not None:
            profiler.requests[room] = time.monotonic()
        shape, j = room >> _SHAPE_SHIFT, room & ((1 << _RUN_SHIFT) - 1)
        src, cp = src_plans[shape][j], chunk_pages[shape]
        sender = rank.sender(room)
        for first in range(0, len(src), cp):
            sender.send(src[first : first + cp], last=first + cp >= len(src))
        senders.append(sender)
        while senders and senders[0].settled():
            senders.popleft().clear()

    observers = [profiler] if profiler is not None else []
    pattern = source_pattern(int(cfg["source_bytes"]), int(cfg["seed"]))
    if cfg.get("kv"):
        kv = Shape(**cfg["kv"])
        arrays, layout = _kv_side(kv, int(cfg["source_pages"]), pattern)
        rank = PrefillRank(
            backend, 0, None, config, observers, on_request=on_request, buffers=arrays, layout=layout
        )
    else:
        rank = PrefillRank(backend, 0, int(cfg["source_bytes"]), config, observers, on_request=on_request)
        rank.writer.write(0, pattern)
    print(json.dumps({"address": rank.address}), flush=True)
    sys.stdin.read()  # serve until the parent closes stdin
    if profiler is not None:
        doc = {"chunks": profiler.chunks, "requests": list(profiler.requests.items())}
        print(json.dumps({"profile": doc}), flush=True)
    rank.close()


class _Profiler:
    """``--profile``: when each chunk entered on_post and left on_done_barrier,
    and when each room's request reached the rank (CLOCK_MONOTONIC, which
    every process on the host shares)."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, int, float, float]] = []  # room, index, post start, barrier end
        self.requests: dict[int, float] = {}
        self._post: dict[tuple[int, int], float] = {}

    @hookimpl(wrapper=True)
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> Generator[None, object, object]:
        self._post[chunk.room, chunk.index] = time.monotonic()
        return (yield)

    @hookimpl(wrapper=True)
    def on_done_barrier(
        self, chunk: Chunk, posted: object, deadline: float
    ) -> Generator[None, Settlement | None, Settlement | None]:
        result = yield
        t0 = self._post.pop((chunk.room, chunk.index))
        self.chunks.append((chunk.room, chunk.index, t0, time.monotonic()))
        return result


def _raw_child() -> None:
    """Writes the same segments through the raw API on command."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = read_config()
    pattern = source_pattern(int(cfg["source_bytes"]), int(cfg["seed"]))
    kv = Shape(**cfg["kv"]) if cfg.get("kv") else None
    if kv is not None:
        arrays, src_layout = _kv_side(kv, int(cfg["source_pages"]), pattern)
        writer, how = open_raw(cfg["backend"], arrays, dict(cfg["options"]))
    else:
        writer, how = open_raw(cfg["backend"], int(cfg["source_bytes"]), dict(cfg["options"]))
        writer.write(0, pattern)
    native = not isinstance(writer, HookRaw)
    chunks: list[list[list[Any]]] = []  # [shape][room] -> per chunk: segments
    for i, sh in enumerate(cfg["shapes"]):
        writer.connect(f"s{i}", bytes.fromhex(sh["metadata"]))
        flat = PageLayout(int(sh["page_bytes"]), 1)
        dst_layout = KVLayout.from_bytes(bytes.fromhex(sh["layout"])) if kv is not None else None
        cp = int(sh["chunk_pages"])
        rooms = []
        for src, dst in zip(sh["src"], sh["dst"], strict=True):
            segs: list[Any] = []
            for first in range(0, len(src), cp):
                src_pages, dst_pages = src[first : first + cp], dst[first : first + cp]
                if dst_layout is not None:
                    lowered = src_layout.segments(dst_layout, src_pages, dst_pages)
                else:
                    lowered = flat.segments(0, src_pages, dst_pages)
                segs.append(lowered.rows if native else lowered)  # rows: the array a raw API user holds
            rooms.append(segs)
        chunks.append(rooms)
    print(json.dumps({"ready": how}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") != "run":
            break
        i = int(cmd["shape"])
        t0 = time.perf_counter()
        total = 0
        for room in chunks[i][: int(cmd["rooms"])]:
            for segs in room:
                total += writer.transfer(f"s{i}", segs)
        seconds = time.perf_counter() - t0
        print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)
    writer.close()


# --------------------------------------------------------------------------
# the page owner and the measurements


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
        sh = self.plan.shape
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
            "kvconn_ms_per_chunk": statistics.median(self.kvconn_s)
            * 1e3
            / (self.plan.rooms * self.plan.room_chunks),
            "raw_ms_per_chunk": statistics.median(self.raw_s)
            * 1e3
            / (self.plan.rooms * self.plan.room_chunks),
            "verify_bad_pages": self.bad_pages,
            "segments_per_chunk": self.segments_per_chunk,
            "lowering_us_per_chunk": self.lowering_us_per_chunk,
            "cpu": _with_overhead(
                {
                    "kvconn": _cpu_summary(self.kvconn_cpu, self.plan),
                    "raw": _cpu_summary(self.raw_cpu, self.plan),
                },
                self.segments_per_chunk,
            ),
        }


def _with_overhead(cpu_: dict[str, dict[str, float]], segments: float) -> dict[str, Any]:
    """``cpu_`` plus kvconn's own CPU per chunk and per segment: its two
    processes' CPU time less the raw path's (owner + writer) for the same chunks."""
    kv, raw = cpu_["kvconn"], cpu_["raw"]
    keys = ("decode_ms_per_chunk", "rank_ms_per_chunk", "raw_writer_ms_per_chunk")
    if not all(k in {**kv, **raw} for k in keys):
        return cpu_
    kv_ms = kv.get("decode_ms_per_chunk", 0.0) + kv.get("rank_ms_per_chunk", 0.0)
    raw_ms = raw.get("decode_ms_per_chunk", 0.0) + raw.get("raw_writer_ms_per_chunk", 0.0)
    extra_us = (kv_ms - raw_ms) * 1e3
    out: dict[str, Any] = dict(cpu_)
    out["kvconn_extra_us_per_chunk"] = extra_us
    out["kvconn_extra_us_per_segment"] = extra_us / segments if segments else 0.0
    return out


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


def _cpu_summary(samples: Sequence[Mapping[str, float]], plan: Plan) -> dict[str, float]:
    """Medians over measurements: ``<process>_ms_per_chunk`` for each process,
    and the machine's ``busy`` / ``steal`` / ``idle`` percent."""
    chunks = plan.rooms * plan.room_chunks
    out = {}
    for k in sorted({k for s in samples for k in s}):
        median = statistics.median(s[k] for s in samples if k in s)
        if k in ("busy", "steal", "idle"):
            out[k] = median
        else:
            out[f"{k}_ms_per_chunk"] = median * 1e3 / chunks
    return out


class _CpuMeter:
    """CPU used by the bench's processes (this one: decode's page owner; the
    rank child; the raw child) and the machine's shares, around one measurement."""

    def __init__(self, pids: Mapping[str, int | None]) -> None:
        self._pids = dict(pids)
        self._start: dict[str, float | None] = {}
        self._machine: tuple[int, ...] | None = None
        self.result: dict[str, float] = {}

    def __enter__(self) -> _CpuMeter:
        self._start = {name: cpu.process_seconds(pid) for name, pid in self._pids.items()}
        self._machine = cpu.sample()
        self.result = {}
        return self

    def __exit__(self, *exc: object) -> None:
        self.result = dict(cpu.shares(self._machine, cpu.sample()))
        for name, pid in self._pids.items():
            t0, t1 = self._start.get(name), cpu.process_seconds(pid)
            if t0 is not None and t1 is not None:
                self.result[name] = t1 - t0


def check_pages(plan: Plan) -> list[tuple[int, int]]:
    """(src page, dst page) pairs spot-checked after each run: the first page
    of the first room and the last of the last room, each against the source
    page of the last room that wrote it. Rooms sharing a slot of the pool run
    one after another, so in a run of many scattered rooms a later room may
    have written the first room's page with a page of its own."""
    final: dict[int, int] = {}
    for src, dst in zip(plan.src, plan.dst, strict=True):
        final.update(zip(dst, src, strict=True))
    return sorted({(final[d], d) for d in (plan.dst[0][0], plan.dst[-1][-1])})


def run_backend(
    name: str,
    options: Mapping[str, str],
    shapes: Sequence[Shape],
    repeat: int,
    run_bytes: int,
    room_bytes: int,
    inflight: int,
    seed: int,
    step: Callable[[str], None] = lambda _: None,
    profile: bool = False,
) -> dict[str, Any]:
    """Measure every shape ``repeat`` times on backend ``name``; the report dict."""
    backend = get_backend(name)
    kv = _kv_shapes(shapes)
    plans = [make_plan(s, run_bytes, room_bytes, inflight, seed) for s in shapes]
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
    rank = Child(
        "kvconn.bench.transport",
        "rank",
        {
            **common,
            "src": [p.src for p in plans],
            "chunk_pages": [p.shape.chunk_pages for p in plans],
            "write_timeout_s": min(20.0, abort_s / 2),
            "abort_timeout_s": abort_s,
            "profile": profile,
        },
        "address",
    )
    room_log: dict[int, list[float]] | None = {} if profile else None
    child_profile: dict[str, Any] = {}
    endpoints: list[_Endpoint] = []
    raw: Child | None = None
    try:
        config = Config(
            write_timeout_s=min(20.0, abort_s / 2), abort_timeout_s=abort_s, backend_options=options
        )
        for p in plans:
            if kv:
                arrays, layout = _kv_side(p.shape, p.pool_pages)
                ep = _Endpoint(backend, prefill=[rank.hello], config=config, buffers=arrays, layout=layout)
            else:
                ep = _Endpoint(backend, p.pool_pages, p.shape.page_bytes, [rank.hello], config)
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
        raw = Child("kvconn.bench.transport", "raw", {**common, "shapes": shapes_cfg}, "ready")
        raw_how = str(raw.hello)
        results = [ShapeResult(p) for p in plans]
        for p, ep, res in zip(plans, endpoints, results, strict=True):
            if ep.layout is not None:
                src_layout = p.shape.engine(source_pages).layout()
                lower: Callable[[list[int], list[int]], Any] = partial(src_layout.segments, ep.layout)
            else:
                lower = partial(PageLayout(p.shape.page_bytes, 1).segments, 0)
            res.segments_per_chunk, res.lowering_us_per_chunk = _lowering(p, lower)
        meter = _CpuMeter({"decode": None, "rank": rank.proc.pid, "raw_writer": raw.proc.pid})

        def measure_raw(i: int, rooms: int) -> tuple[float, float]:
            assert raw is not None
            t0 = time.perf_counter()
            raw.send({"op": "run", "shape": i, "rooms": rooms})
            reply = raw.recv("seconds")
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
                        for at in _page_offsets(p.shape, p.pool_pages, d):
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
                        src_at = _page_offsets(p.shape, source_pages, s)
                        dst_at = _page_offsets(p.shape, p.pool_pages, d)
                        if any(
                            ep.region.read(b, pb) != source[a : a + pb]
                            for a, b in zip(src_at, dst_at, strict=True)
                        ):
                            res.bad_pages += 1
    finally:
        if raw is not None:
            raw.close()
        for ep in endpoints:
            ep.close()
        child_profile = rank.close().get("profile", {})
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
        run = (room >> _RUN_SHIFT) & ((1 << (_SHAPE_SHIFT - _RUN_SHIFT)) - 1)
        if room >> _SHAPE_SHIFT == shape_index and run >= 1:
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
    out["raw_child_ms_per_chunk"] = (
        statistics.median(res.raw_child_s) * 1e3 / (res.plan.rooms * res.plan.room_chunks)
    )
    return out


# --------------------------------------------------------------------------
# CLI


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
        metavar="PAGE_BYTES[xCHUNK_PAGES][:scattered]",
        help=f"chunk shape (repeatable; default {', '.join(DEFAULT_SHAPES)})",
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


def main(args: argparse.Namespace, console: Console, err: Console) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvconn.bench.cli import _options, check_output_paths

    if args.repeat < 1 or args.inflight < 1:
        raise ValueError("--repeat and --inflight must be >= 1")
    if args.bytes_per_run < 1 or args.room_bytes < 1 or args.seed < 0:
        raise ValueError("--bytes-per-run and --room-bytes must be >= 1, --seed >= 0")
    check_output_paths(args.json)
    shapes = [Shape.parse(s) for s in (args.shape or DEFAULT_SHAPES)]
    options = _options(args.backend_option)
    names = [n.strip() for n in args.backend.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--backend names no backend: {args.backend!r}")
    reports = []
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
        disable=args.no_progress,
        transient=True,
    ) as progress:
        for name in names:
            task = progress.add_task(name, total=None)

            def step(what: str, task: Any = task, name: str = name) -> None:
                progress.update(task, description=f"{name}: {what}")

            reports.append(
                run_backend(
                    name,
                    options,
                    shapes,
                    args.repeat,
                    args.bytes_per_run,
                    args.room_bytes,
                    args.inflight,
                    args.seed,
                    step,
                    args.profile,
                )
            )
            progress.remove_task(task)
    for rep in reports:
        print_report(console, rep)
    if args.json:
        text = json.dumps({"transport": reports}, indent=2)
        if args.json == "-":
            sys.stdout.write(text + "\n")
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if all(r["verified"] for r in reports) else 1


#: Above this machine-wide busy share during kvconn's runs the report warns:
#: the CPUs were saturated, so kvconn's control plane took its CPU time from
#: a transport that copies with the CPU.
SATURATED_BUSY = 90.0


def _print_cpu(console: Console, rep: dict[str, Any]) -> None:
    parts = {"kvconn": ("decode", "rank"), "raw": ("decode", "raw_writer")}
    rows = [
        r
        for r in rep["shapes"]
        if all(f"{p}_ms_per_chunk" in r["cpu"][side] for side, ps in parts.items() for p in ps)
    ]
    if not rows:
        return  # not Linux: no /proc
    t = Table(title=f"CPU per chunk on {rep['backend']}, every process (ms; medians)")
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
        extra = r["cpu"].get("kvconn_extra_us_per_chunk")
        own = (
            "-"
            if extra is None
            else f"{extra:.0f}, {r['cpu']['kvconn_extra_us_per_segment']:.2f} ({r['segments_per_chunk']:.0f})"
        )
        t.add_row(
            r["shape"],
            *cells,
            own,
            f"{r['lowering_us_per_chunk']:.0f}",
            f"{kv.get('busy', 0):.0f}% / {raw.get('busy', 0):.0f}%",
            f"{kv.get('steal', 0):.0f}% / {raw.get('steal', 0):.0f}%",
        )
        if kv.get("busy", 0) >= SATURATED_BUSY and not r["target_met"]:
            saturated.append(r["shape"])
    console.print(t)
    if saturated:
        console.print(
            f"[yellow]CPUs saturated[/yellow] during kvconn's runs of {', '.join(saturated)}: its control "
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
    t = Table(title=f"kvconn bench --transport: {rep['backend']}" + (f" ({opts})" if opts else ""))
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
            r["shape"],
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
        f"pairs: kvconn / raw of each repetition (alternating which ran first); the interval holds "
        f"their median with probability >= {confidence:.0%}. The target is met or missed when all of "
        "it is on one side; unclear: measure again (--repeat), or on a quieter machine."
    )
    _print_cpu(console, rep)
    prof = [r for r in rep["shapes"] if r.get("profile")]
    if prof:
        pt = Table(title=f"--profile: where kvconn's time goes on {rep['backend']} (ms per chunk)")
        pt.add_column("")
        for r in prof:
            pt.add_column(r["shape"], justify="right")

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
    if missed:
        console.print(f"[red]5% target NOT met[/red] on {rep['backend']} for: {', '.join(missed)} ({pairs})")
    else:
        console.print(f"[green]5% target met[/green] on {rep['backend']} for every shape ({pairs})")


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role == "rank":
        _rank_child()
    elif role == "raw":
        _raw_child()
    else:
        raise SystemExit("usage: python -m kvconn.bench.transport rank|raw  (config JSON on stdin)")
