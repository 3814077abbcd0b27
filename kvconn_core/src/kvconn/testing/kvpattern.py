"""An engine's KV cache in numpy, with contents decode can check byte by byte.

:class:`EngineShape` is a model's KV geometry (layers, page size, heads,
head size, page order, MLA or not). It gives each side of a transfer its
per-layer buffers (K and V per layer; one latent buffer per layer with
MLA) and its :class:`~kvconn.layout.KVLayout` for a tensor-parallel rank.

A byte's value depends only on its logical place (room, buffer, the page's
index within the room, token, global head, byte of the head): a prefill rank
fills its source pages with :func:`fill_page`, and decode, whatever its TP
size and page order, checks a page with :func:`page_matches`. A byte that
went to another buffer, head, token or page shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvconn.layout import ExtraSlots, KVLayout, PagedBuffer
from kvconn.testing.patterns import CANARY

if TYPE_CHECKING:
    import numpy.typing as npt

#: Free pages at decode hold this: never a pattern byte (those are 0x40..0x7F).
_MAX_INDEX = 1 << 12  # pages per room the pattern tells apart


@attrs.frozen
class EngineShape:
    """A model's KV geometry, the same on both sides of a transfer."""

    layers: int
    pages: int
    tokens: int = 16
    heads: int = 8  #: KV heads in all (each TP rank holds heads / tp_size)
    head_bytes: int = 256  #: head dim x dtype size (128 x fp16)
    order: str = "HND"
    replicated: bool = False  #: MLA: one latent buffer per layer, on every rank whole
    extras_bytes: int = 0  #: per-room extras (aux) slot size, in one more buffer; 0: none
    extras_slots: int = 8

    @property
    def num_buffers(self) -> int:
        return self.layers if self.replicated else 2 * self.layers

    def page_bytes(self, tp_size: int) -> int:
        if self.replicated:
            return self.tokens * self.heads * self.head_bytes
        if self.heads % tp_size:
            raise ValueError(f"{self.heads} heads do not split over {tp_size} ranks")
        return self.tokens * (self.heads // tp_size) * self.head_bytes

    def layout(self, tp_size: int = 1, tp_rank: int = 0) -> KVLayout:
        page = self.page_bytes(tp_size)
        sizes = (page * self.pages,) * self.num_buffers
        extras: tuple[ExtraSlots, ...] = ()
        if self.extras_bytes:
            sizes += (self.extras_bytes * self.extras_slots,)
            extras = (ExtraSlots(self.num_buffers, self.extras_bytes, self.extras_slots),)
        if self.replicated:
            parts = tuple(PagedBuffer(page, self.pages, buffer=i) for i in range(self.num_buffers))
            return KVLayout(parts, sizes, tp_size, tp_rank, replicated=True, extras=extras)
        heads = self.heads // tp_size
        return KVLayout.uniform(
            sizes,
            self.pages,
            self.tokens,
            heads,
            self.head_bytes,
            self.order,
            tp_size,
            tp_rank,
            extras=extras,
            kv_buffers=self.num_buffers,
        )

    def buffers(self, tp_size: int = 1, fill: int = 0) -> list[npt.NDArray[np.uint8]]:
        """The rank's per-layer buffers (and its extras buffer), as an engine allocates them."""
        page = self.page_bytes(tp_size)
        arrays = [np.full(page * self.pages, fill, dtype=np.uint8) for _ in range(self.num_buffers)]
        if self.extras_bytes:
            arrays.append(np.full(self.extras_bytes * self.extras_slots, fill, dtype=np.uint8))
        return arrays

    def extras_contents(self, room: int) -> npt.NDArray[np.uint8]:
        """A room's extras (the same on every rank: one of them writes it)."""
        return _bytes(np.arange(self.extras_bytes, dtype=np.int64) + (room + 1) * (1 << 24))

    def _slot(self, arrays: Sequence[npt.NDArray[np.uint8]], slot: int) -> npt.NDArray[np.uint8]:
        return arrays[self.num_buffers][slot * self.extras_bytes : (slot + 1) * self.extras_bytes]

    def fill_extras(self, arrays: Sequence[npt.NDArray[np.uint8]], room: int, slot: int) -> None:
        self._slot(arrays, slot)[:] = self.extras_contents(room)

    def extras_match(self, arrays: Sequence[npt.NDArray[np.uint8]], room: int, slot: int) -> bool:
        return bool(np.array_equal(self._slot(arrays, slot), self.extras_contents(room)))

    def to_args(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> EngineShape:
        return cls(**args)


def _labels(
    shape: EngineShape, layout: KVLayout, buffer: int, room: int, index: int
) -> npt.NDArray[np.int64]:
    """The logical label of every byte of one page of ``buffer`` on this side."""
    part = layout.buffers[buffer]
    if layout.replicated:
        within = np.arange(part.page_bytes, dtype=np.int64)
        span = part.page_bytes
    else:
        t, lh, hb = part.tokens, part.heads, part.head_bytes
        token, head, byte = np.meshgrid(np.arange(t), np.arange(lh), np.arange(hb), indexing="ij")
        gh = layout.tp_rank * lh + head
        within = (token * shape.heads + gh) * hb + byte
        if part.order == "HND":
            within = within.transpose(1, 0, 2)
        within = within.ravel().astype(np.int64)
        span = t * shape.heads * hb
    return within + ((room * shape.num_buffers + buffer) * _MAX_INDEX + index % _MAX_INDEX) * span


def _bytes(labels: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    mixed = (labels.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(58)
    out: npt.NDArray[np.uint8] = (mixed.astype(np.uint8) & np.uint8(0x3F)) | np.uint8(0x40)
    return out


def page_contents(
    shape: EngineShape, layout: KVLayout, buffer: int, room: int, index: int
) -> npt.NDArray[np.uint8]:
    """What this side holds in ``buffer`` for the ``index``-th page of ``room``."""
    return _bytes(_labels(shape, layout, buffer, room, index))


def _page(arr: npt.NDArray[np.uint8], part: PagedBuffer, page: int) -> npt.NDArray[np.uint8]:
    start = part.offset + page * part.stride
    return arr[start : start + part.page_bytes]


def fill_page(
    shape: EngineShape,
    layout: KVLayout,
    arrays: Sequence[npt.NDArray[np.uint8]],
    room: int,
    index: int,
    page: int,
) -> None:
    """Put the ``index``-th page of ``room`` into ``page`` of every buffer."""
    for i, part in enumerate(layout.buffers):
        _page(arrays[i], part, page)[:] = page_contents(shape, layout, i, room, index)


def wrong_buffers(
    shape: EngineShape,
    layout: KVLayout,
    arrays: Sequence[npt.NDArray[np.uint8]],
    room: int,
    index: int,
    page: int,
) -> list[int]:
    """The buffers whose ``page`` does not hold the ``index``-th page of ``room``."""
    return [
        i
        for i, part in enumerate(layout.buffers)
        if not np.array_equal(_page(arrays[i], part, page), page_contents(shape, layout, i, room, index))
    ]


def page_matches(
    shape: EngineShape,
    layout: KVLayout,
    arrays: Sequence[npt.NDArray[np.uint8]],
    room: int,
    index: int,
    page: int,
) -> bool:
    """Whether ``page`` holds the ``index``-th page of ``room`` in every buffer."""
    return not wrong_buffers(shape, layout, arrays, room, index, page)


def fill_canary(layout: KVLayout, arrays: Sequence[npt.NDArray[np.uint8]], pages: Sequence[int]) -> None:
    for i, part in enumerate(layout.buffers):
        for page in pages:
            _page(arrays[i], part, page)[:] = CANARY


def dirty_bytes(layout: KVLayout, arrays: Sequence[npt.NDArray[np.uint8]], pages: Sequence[int]) -> int:
    """Bytes of ``pages`` that are no longer canary (a late write)."""
    return sum(
        int((_page(arrays[i], part, page) != CANARY).sum())
        for i, part in enumerate(layout.buffers)
        for page in pages
    )
