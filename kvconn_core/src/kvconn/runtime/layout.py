"""Where a rank's share of a page lives in the source and destination regions."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from kvconn.chunk import SegmentTable
from kvconn.layout import KVLayout
from kvconn.protocol.messages import Hello
from kvconn.protocol.rank_events import Pairing

#: From this many pages on, :meth:`PageLayout.segments` lowers with numpy:
#: its ~20 us of fixed cost beats the per-page Python loop (~0.35 us a page)
#: from about 64 pages; below, the loop wins (one page: ~1.5 us against ~20).
VECTOR_MIN_PAGES = 64


@attrs.frozen
class PageLayout:
    """Decode pages are ``page_bytes`` long and every one of ``num_ranks``
    prefill ranks writes its own shard of each page (tensor-parallel heads):
    rank ``r`` owns bytes ``[r * shard, (r + 1) * shard)`` of every page. A
    rank's source pool holds shard-sized pages."""

    page_bytes: int
    num_ranks: int

    def __attrs_post_init__(self) -> None:
        if self.num_ranks < 1 or self.page_bytes < 1 or self.page_bytes % self.num_ranks:
            raise ValueError(f"page_bytes {self.page_bytes} must split evenly over {self.num_ranks} ranks")

    @property
    def shard(self) -> int:
        return self.page_bytes // self.num_ranks

    def dst_offset(self, rank: int, page: int) -> int:
        return page * self.page_bytes + rank * self.shard

    def segments(self, rank: int, src_pages: Sequence[int], dst_pages: Sequence[int]) -> SegmentTable:
        """Lower pages to byte segments, merging runs contiguous on both sides."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
        if len(src_pages) >= VECTOR_MIN_PAGES:
            return self._segments_vector(rank, src_pages, dst_pages)
        return self._segments_loop(rank, src_pages, dst_pages)

    def _segments_loop(self, rank: int, src_pages: Sequence[int], dst_pages: Sequence[int]) -> SegmentTable:
        # dst_offset() inlined: this loop runs per page
        shard, page_bytes = self.shard, self.page_bytes
        rank_offset = rank * shard
        flat: list[int] = []
        src0 = dst0 = length = -1
        for s, d in zip(src_pages, dst_pages, strict=True):
            src, dst = s * shard, d * page_bytes + rank_offset
            if length > 0 and src == src0 + length and dst == dst0 + length:
                length += shard
                continue
            if length > 0:
                flat += (src0, dst0, length)
            src0, dst0, length = src, dst, shard
        if length > 0:
            flat += (src0, dst0, length)
        return SegmentTable.from_flat(flat)

    def _segments_vector(self, rank: int, src_pages: Sequence[int], dst_pages: Sequence[int]) -> SegmentTable:
        shard = self.shard
        src = np.asarray(src_pages, dtype=np.int64) * shard
        dst = np.asarray(dst_pages, dtype=np.int64) * self.page_bytes + rank * shard
        n = len(src)
        if n == 0:
            return SegmentTable(())
        # A page starts a new segment unless it continues the previous one on
        # both sides.
        starts_run = np.empty(n, dtype=bool)
        starts_run[0] = True
        np.not_equal(src[1:], src[:-1] + shard, out=starts_run[1:])
        starts_run[1:] |= dst[1:] != dst[:-1] + shard
        first = np.flatnonzero(starts_run)
        rows = np.empty((len(first), 3), dtype=np.int64)
        rows[:, 0] = src[first]
        rows[:, 1] = dst[first]
        rows[:, 2] = np.diff(first, append=n) * shard
        return SegmentTable(rows)


@attrs.frozen
class EngineLayout:
    """A rank's own :class:`~kvconn.layout.KVLayout` paired with a decode's:
    lowers pages as :class:`PageLayout` does, through both layouts."""

    src: KVLayout
    dst: KVLayout

    def segments(self, rank: int, src_pages: Sequence[int], dst_pages: Sequence[int]) -> SegmentTable:
        return self.src.segments(self.dst, src_pages, dst_pages)


def peer_layout(
    own: KVLayout | None, page_bytes: int, num_ranks: int, layout: bytes
) -> PageLayout | EngineLayout:
    """How this rank lays its pages into a decode that announced ``layout``
    (its KVLayout, or empty for ``page_bytes`` pages split over
    ``num_ranks``). Raises ValueError if the two sides cannot exchange pages."""
    if not layout:
        if own is not None:
            raise ValueError(
                "decode's pages are one region of equal shards; this rank's source is an engine layout"
            )
        return PageLayout(page_bytes, num_ranks)
    if own is None:
        raise ValueError("decode's pages are an engine layout: open this rank with buffers= and layout=")
    dst = KVLayout.from_bytes(layout)
    if own.tp_size != num_ranks:
        raise ValueError(
            f"decode bootstraps {num_ranks} prefill ranks; this rank's layout says tp_size {own.tp_size}"
        )
    own.writes_to(dst)  # raises LayoutError (a ValueError) if the pair does not fit
    if len(own.extras) != len(dst.extras):
        raise ValueError(
            f"decode's layout has {len(dst.extras)} extras buffers, this rank's {len(own.extras)}"
        )
    return EngineLayout(own, dst)


def pairing(
    own: KVLayout | None, source_bytes: int | None, hello: Hello
) -> Pairing[PageLayout | EngineLayout]:
    """What the core needs to know of this rank's pages paired with the
    decode that sent ``hello``: how chunks are lowered into it, or why the
    two do not fit (any error of the layouts' own checks)."""
    try:
        layout = peer_layout(own, hello.page_bytes, hello.num_ranks, hello.layout)
    except Exception as exc:
        return Pairing(None, str(exc) or type(exc).__name__)
    if isinstance(layout, EngineLayout):
        src, dst = layout.src, layout.dst
        writes = src.writes_extras_to(dst)
        return Pairing(layout, "", dst.tp_size, src.num_pages, writes, src.num_slots if writes else 0)
    assert source_bytes is not None  # a rank without a layout allocated its source
    return Pairing(layout, "", 1, source_bytes // layout.shard)
