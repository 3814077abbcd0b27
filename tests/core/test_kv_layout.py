"""kvconn.layout.KVLayout: every byte of a decode page comes from exactly one
prefill rank, from the right source page, buffer, token and head, whatever the
TP sizes on both sides and the page orders (HND, NHD), with segments merged
and never across two buffers."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconn.buffers import Buffer, FlatSpace
from kvconn.layout import ExtraSlots, KVLayout, LayoutError, PagedBuffer

UNSET = -2


def _side_labels(layout: KVLayout, total_heads: int, pages: int) -> np.ndarray:
    """Each byte's logical identity (buffer, page, token, global head, byte)
    as an int64, laid out the way ``layout`` lays that side's memory out."""
    flat = np.full(layout.nbytes, UNSET, dtype=np.int64)
    starts = layout.buffer_starts()
    for i, part in enumerate(layout.buffers):
        t, lh, hb = part.tokens, part.heads, part.head_bytes
        page, token, head, byte = np.meshgrid(
            np.arange(pages), np.arange(t), np.arange(lh), np.arange(hb), indexing="ij"
        )
        gh = layout.tp_rank * lh + head
        label = (((i * pages + page) * t + token) * total_heads + gh) * hb + byte
        if part.order == "HND":
            label = label.transpose(0, 2, 1, 3)
        base = starts[part.buffer] + part.offset
        for p in range(pages):
            flat[base + p * part.stride : base + p * part.stride + part.page_bytes] = label[p].ravel()
    return flat


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[KVLayout], list[KVLayout], list[int], list[int], int, int]:
    p, d = draw(st.sampled_from([(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 4), (4, 2), (2, 2)]))
    total_heads = 4 * draw(st.integers(1, 2))
    tokens = draw(st.sampled_from([1, 2, 4]))
    hb = draw(st.sampled_from([1, 2, 8]))
    nbuf = draw(st.integers(1, 4))
    pages = 6
    src_order = draw(st.sampled_from(["HND", "NHD"]))
    dst_order = draw(st.sampled_from(["HND", "NHD"]))
    gap = draw(st.sampled_from([0, 3]))  # page stride larger than the page, and an offset

    def side(tp: int, rank: int, order: str) -> KVLayout:
        heads = total_heads // tp
        page = tokens * heads * hb
        parts = tuple(PagedBuffer(page, pages, page + gap, gap, i, tokens, heads, order) for i in range(nbuf))
        return KVLayout(parts, (gap + pages * (page + gap),) * nbuf, tp, rank)

    srcs = [side(p, r, src_order) for r in range(p)]
    dsts = [side(d, r, dst_order) for r in range(d)]
    n = draw(st.integers(0, pages))
    src_pages = draw(st.permutations(range(pages)))[:n]
    dst_pages = draw(st.permutations(range(pages)))[:n]
    if draw(st.booleans()):
        src_pages, dst_pages = sorted(src_pages), sorted(dst_pages)
    return srcs, dsts, src_pages, dst_pages, total_heads, pages


@settings(max_examples=150, deadline=None)
@given(cases())
def test_every_decode_byte_comes_once_from_its_source(
    case: tuple[list[KVLayout], list[KVLayout], list[int], list[int], int, int],
) -> None:
    srcs, dsts, src_pages, dst_pages, total_heads, pages = case
    src_labels = [_side_labels(s, total_heads, pages) for s in srcs]
    for dst in dsts:
        expected = _side_labels(dst, total_heads, pages)
        got = np.full(dst.nbytes, UNSET, dtype=np.int64)
        writes = np.zeros(dst.nbytes, dtype=np.int64)
        dst_space = FlatSpace([Buffer(1 << 20, n) for n in dst.buffer_nbytes])
        for src, labels in zip(srcs, src_labels, strict=True):
            table = src.segments(dst, src_pages, dst_pages)
            rows = table.rows
            src_space = FlatSpace([Buffer(1 << 20, n) for n in src.buffer_nbytes])
            src_space.locate(rows[:, 0], rows[:, 2])  # raises if one straddles two buffers
            dst_space.locate(rows[:, 1], rows[:, 2])
            for s, d, n in rows.tolist():
                got[d : d + n] = labels[s : s + n]
                writes[d : d + n] += 1
            for a, b in itertools.pairwise(rows.tolist()):  # merged as far as a buffer allows
                same_buffer = (
                    dst_space.locate(np.array([b[1]]), np.array([1]))[1]
                    == dst_space.locate(np.array([a[1]]), np.array([1]))[1]
                )
                assert not (b[0] == a[0] + a[2] and b[1] == a[1] + a[2] and same_buffer.all())
        assert writes.max(initial=0) <= 1, "two prefill ranks wrote the same decode byte"
        # The labels name the source page: map them to the destination page they go to.
        want = np.full(dst.nbytes, UNSET, dtype=np.int64)
        page_of = dict(zip(dst_pages, src_pages, strict=True))
        for _i, part in enumerate(dst.buffers):
            base = dst.buffer_starts()[part.buffer] + part.offset
            for dp, sp in page_of.items():
                lo = base + dp * part.stride
                want[lo : lo + part.page_bytes] = expected[
                    base + sp * part.stride : base + sp * part.stride + part.page_bytes
                ]
        assert np.array_equal(got, want)


def test_mla_one_rank_writes_each_decode_rank_whole_pages() -> None:
    def side(tp: int, rank: int) -> KVLayout:
        return KVLayout(
            (PagedBuffer(576, 8), PagedBuffer(576, 8)), (576 * 8, 576 * 8), tp, rank, replicated=True
        )

    for p, d in ((4, 1), (2, 4), (1, 2)):
        for dr in range(d):
            writers = [r for r in range(p) if side(p, r).writes_to(side(d, dr))]
            assert writers == [dr % p]
            table = side(p, writers[0]).segments(side(d, dr), [0, 1, 2], [5, 6, 7])
            assert [tuple(r) for r in table.rows.tolist()] == [
                (0, 5 * 576, 3 * 576),
                (4608, 4608 + 5 * 576, 3 * 576),
            ]
            other = (writers[0] + 1) % p
            if other != writers[0]:
                assert len(side(p, other).segments(side(d, dr), [0], [0])) == 0


def test_extras_travel_from_one_rank_into_the_rooms_slot() -> None:
    def side(tp: int, rank: int) -> KVLayout:
        aux = (ExtraSlots(2, 64, 10), ExtraSlots(2, 32, 10, offset=640))
        return KVLayout.uniform(
            (4096, 4096, 1024), 4, 16, 4 // tp, 16, tp_size=tp, tp_rank=rank, extras=aux, kv_buffers=2
        )

    dst = side(1, 0)
    assert side(2, 0).extra_segments(dst, 3, 7).rows.tolist() == [
        [8192 + 3 * 64, 8192 + 7 * 64, 64],
        [8192 + 640 + 3 * 32, 8192 + 640 + 7 * 32, 32],
    ]
    assert len(side(2, 1).extra_segments(dst, 3, 7)) == 0
    with pytest.raises(LayoutError, match="slot 3 -> 10"):
        side(2, 0).extra_segments(dst, 3, 10)


def test_bad_layouts_and_mismatched_pairs_are_named() -> None:
    with pytest.raises(LayoutError, match="spans"):
        KVLayout((PagedBuffer(100, 10),), (999,))
    with pytest.raises(LayoutError, match="names buffer 1"):
        KVLayout((PagedBuffer(100, 1, buffer=1),), (100,))
    with pytest.raises(LayoutError, match="does not split"):
        PagedBuffer(100, 1, tokens=3, heads=1)
    with pytest.raises(LayoutError, match="order"):
        PagedBuffer(64, 1, tokens=4, heads=4, order="HDN")
    with pytest.raises(LayoutError, match="tp_rank 2"):
        KVLayout((PagedBuffer(64, 1),), (64,), 2, 2)
    a = KVLayout.uniform((4096,), 4, 16, 4, 16, tp_size=2)
    with pytest.raises(LayoutError, match="heads x tp"):
        a.segments(KVLayout.uniform((4096,), 4, 16, 4, 16, tp_size=1), [0], [0])
    with pytest.raises(LayoutError, match="destination pages outside"):
        a.segments(KVLayout.uniform((16384,), 8, 16, 8, 16), [0], [8])
    with pytest.raises(LayoutError, match="needs tokens and heads"):
        KVLayout((PagedBuffer(64, 1),), (64,), 2).segments(KVLayout((PagedBuffer(64, 1),), (64,)), [0], [0])
    for junk in (
        b"",
        b"{}",
        b'{"format": 9}',
        b'{"format":1,"buffer_nbytes":[1],"tp":[1,0],"replicated":0,"buffers":[["x"]],"extras":[]}',
    ):
        with pytest.raises(LayoutError):
            KVLayout.from_bytes(junk)
    assert KVLayout.from_bytes(a.to_bytes()) == a


def test_a_realistic_chunk_merges_runs_per_buffer() -> None:
    # 32 layers x K/V, 64 pages of 16 tokens x 8 heads x 128 x fp16: runs of
    # adjacent pages become one segment per buffer; scattered pages one per page.
    layout = KVLayout.uniform((64 * 32768,) * 64, 64, 16, 8, 256)
    runs = layout.segments(layout, range(64), range(64))
    assert len(runs) == 64 and set(runs.rows[:, 2].tolist()) == {64 * 32768}
    scattered = layout.segments(layout, range(64), list(range(0, 64, 2)) + list(range(1, 64, 2)))
    assert len(scattered) == 64 * 64 and scattered.nbytes == 64 * 64 * 32768
    # TP 2 -> 1 with NHD: one strided piece per token of each page
    half = KVLayout.uniform((64 * 16384,) * 64, 64, 16, 4, 256, order="NHD", tp_size=2, tp_rank=1)
    whole = KVLayout.uniform((64 * 32768,) * 64, 64, 16, 8, 256, order="NHD")
    table = half.segments(whole, range(64), range(64))
    assert len(table) == 64 * 64 * 16 and set(table.rows[:, 2].tolist()) == {4 * 256}
    start = time.perf_counter()
    half.segments(whole, range(64), range(64))
    print(f"\n  65,536 NHD segments lowered in {(time.perf_counter() - start) * 1e3:.2f} ms")
