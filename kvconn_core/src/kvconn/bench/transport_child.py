"""The two child processes of ``kvconn bench --transport``, each a
:class:`kvconn.testing.child.Child` given its arguments, ``role`` among
them, as JSON:

* ``rank``: a prefill rank (:class:`PrefillRank`, one worker) whose engine
  stand-in sends a room's chunks with ``Sender.send`` as soon as decode asks;
  with ``profile``, a hook wrapper times each chunk in the transport's hooks.
* ``raw``: writes the very same segments through the transport's raw API
  (:mod:`kvconn.bench.raw`), one chunk at a time, on each ``run`` command.

``python -m kvconn.bench.transport_child ARGS_JSON``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import deque
from collections.abc import Generator, Sequence
from typing import Any

from kvconn.bench.raw import HookRaw, open_raw
from kvconn.bench.shapes import Shape, kv_side, source_pattern, split_room
from kvconn.chunk import Chunk, Segment
from kvconn.config import Config
from kvconn.hookspecs import hookimpl
from kvconn.layout import KVLayout
from kvconn.plugins import get_backend
from kvconn.runtime.layout import PageLayout
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.child import load_args, quiet_interrupts
from kvconn.transport import Settlement


def _rank_child(cfg: dict[str, Any]) -> None:
    """A prefill rank whose 'engine' sends a room's chunks as soon as decode asks."""
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
        shape, _, j = split_room(room)
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
        arrays, layout = kv_side(kv, int(cfg["source_pages"]), pattern)
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


def _raw_child(cfg: dict[str, Any]) -> None:
    """Writes the same segments through the raw API on command."""
    pattern = source_pattern(int(cfg["source_bytes"]), int(cfg["seed"]))
    kv = Shape(**cfg["kv"]) if cfg.get("kv") else None
    if kv is not None:
        arrays, src_layout = kv_side(kv, int(cfg["source_pages"]), pattern)
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


if __name__ == "__main__":
    quiet_interrupts()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = load_args(sys.argv[1]) if len(sys.argv) == 2 else {}
    if args.get("role") == "rank":
        _rank_child(args)
    elif args.get("role") == "raw":
        _raw_child(args)
    else:
        raise SystemExit('usage: python -m kvconn.bench.transport_child \'{"role": "rank"|"raw", ...}\'')
