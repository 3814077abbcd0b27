"""PageLayout lowers a rank's pages to byte segments: every shard lands at
its page's offset for that rank, and runs contiguous on both sides merge."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconn.runtime.layout import PageLayout


@st.composite
def layouts(draw: st.DrawFn) -> tuple[PageLayout, int, list[int], list[int]]:
    ranks = draw(st.integers(1, 4))
    layout = PageLayout(ranks * draw(st.sampled_from([1, 8, 4096])), ranks)
    n = draw(st.integers(0, 40))
    src = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True))
    dst = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True))
    if draw(st.booleans()):  # contiguous runs, as a fresh pool hands them out
        src, dst = sorted(src), sorted(dst)
    return layout, draw(st.integers(0, ranks - 1)), src, dst


@given(layouts())
def test_segments_cover_exactly_each_shard(case: tuple[PageLayout, int, list[int], list[int]]) -> None:
    layout, rank, src_pages, dst_pages = case
    shard = layout.shard
    segments = layout.segments(rank, src_pages, dst_pages)
    copied = {}
    for seg in segments:
        assert seg.nbytes > 0 and seg.nbytes % shard == 0
        for k in range(0, seg.nbytes, shard):
            copied[seg.src + k] = seg.dst + k
    assert copied == {
        s * shard: layout.dst_offset(rank, d) for s, d in zip(src_pages, dst_pages, strict=True)
    }
    # merged as far as possible: no two consecutive segments continue each other
    for a, b in itertools.pairwise(segments):
        assert not (b.src == a.src + a.nbytes and b.dst == a.dst + a.nbytes)


def test_mismatched_lengths_and_uneven_shards_are_refused() -> None:
    with pytest.raises(ValueError):
        PageLayout(4096, 2).segments(0, [1, 2], [3])
    with pytest.raises(ValueError):
        PageLayout(4095, 2)
