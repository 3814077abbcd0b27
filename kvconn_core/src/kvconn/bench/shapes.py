"""``kvconn bench --transport``'s workload: chunk shapes and the plan of
rooms both paths write (the same source and destination pages for kvconn and
raw, in every repetition), the source pattern, and which pages are checked.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from kvconn.bench.sizes import format_size, parse_size
from kvconn.layout import KVLayout
from kvconn.testing.kvpattern import EngineShape

DEFAULT_SHAPES = ("4096x1024:scattered", "1048576x1", "67108864x1")
#: A room id packs (shape index, run, room of the run): see :func:`room_id`.
SHAPE_SHIFT, RUN_SHIFT = 40, 20
_SPREAD = 4  #: scattered shapes draw a room's pages from a slot 4x its size


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
        kv = spec.lower().startswith("kv:")
        body, _, flag = spec[3 if kv else 0 :].partition(":")
        if flag not in ("", "scattered"):
            raise ValueError(f"shape {spec!r}: the only flag is ':scattered'")
        first, _, pages = body.lower().partition("x")
        try:
            size, chunk_pages = int(first) if kv else parse_size(first), int(pages or 1)
        except ValueError:
            form = "kv:LAYERSxCHUNK_PAGES" if kv else "PAGE_BYTES[xCHUNK_PAGES]"
            raise ValueError(f"shape {spec!r} is not {form}[:scattered]") from None
        if kv:
            if size < 1 or chunk_pages < 1:
                raise ValueError(f"shape {spec!r}: layers and chunk pages >= 1")
            return cls(KV_TOKENS * KV_HEADS * KV_HEAD_BYTES, chunk_pages, flag == "scattered", size)
        if size < 8 or chunk_pages < 1:
            raise ValueError(f"shape {spec!r}: page_bytes >= 8 and chunk pages >= 1")
        return cls(size, chunk_pages, flag == "scattered")


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

    @property
    def run_chunks(self) -> int:
        return self.rooms * self.room_chunks

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


def kv_shapes(shapes: Sequence[Shape]) -> bool:
    """Whether the run is of ``kv:`` shapes (one rank serves them all, so
    they cannot mix with flat ones, nor differ in layers)."""
    layers = {s.layers for s in shapes}
    if len(layers) > 1 and 0 in layers:
        raise ValueError("kv: shapes and flat shapes cannot run together (run them one after another)")
    if len(layers) > 1:
        raise ValueError("kv: shapes of one run must have the same number of layers")
    return bool(shapes) and shapes[0].layers > 0


def kv_side(shape: Shape, pages: int, source: bytes | None = None) -> tuple[list[Any], KVLayout]:
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


def page_offsets(shape: Shape, pool_pages: int, page: int) -> list[int]:
    """Flat offsets of ``page`` in each buffer of a side of ``pool_pages`` pages."""
    buffer_bytes = pool_pages * shape.page_bytes
    return [b * buffer_bytes + page * shape.page_bytes for b in range(shape.buffers)]


def source_pattern(nbytes: int, seed: int) -> bytes:
    """The bytes both children hold in their source memory. (numpy's
    generator: ``random.randbytes`` overflows at 256 MiB, a room of 256 MiB
    needs that much source.)"""
    return np.random.default_rng(seed).bytes(nbytes)


def room_id(shape_index: int, run: int, j: int) -> int:
    """Room ``j`` of repetition ``run`` (0: the warm-up) of shape ``shape_index``."""
    return (shape_index << SHAPE_SHIFT) | (run << RUN_SHIFT) | j


def split_room(room: int) -> tuple[int, int, int]:
    """(shape index, run, j) of a :func:`room_id`."""
    return (
        room >> SHAPE_SHIFT,
        (room >> RUN_SHIFT) & ((1 << (SHAPE_SHIFT - RUN_SHIFT)) - 1),
        room & ((1 << RUN_SHIFT) - 1),
    )


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
