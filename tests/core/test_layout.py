"""PageLayout lowers a rank's pages to byte segments: every shard lands at
its page's offset for that rank, and runs contiguous on both sides merge."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvconn.chunk import Segment, SegmentTable
from kvconn.runtime.layout import VECTOR_MIN_PAGES, PageLayout


@st.composite
def layouts(draw: st.DrawFn) -> tuple[PageLayout, int, list[int], list[int]]:
    ranks = draw(st.integers(1, 4))
    layout = PageLayout(ranks * draw(st.sampled_from([1, 8, 4096])), ranks)
    # both sides of VECTOR_MIN_PAGES: the per-page loop and the numpy lowering
    n = draw(st.integers(0, 2 * VECTOR_MIN_PAGES))
    src = draw(st.lists(st.integers(0, 4 * VECTOR_MIN_PAGES), min_size=n, max_size=n, unique=True))
    dst = draw(st.lists(st.integers(0, 4 * VECTOR_MIN_PAGES), min_size=n, max_size=n, unique=True))
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


@given(layouts())
def test_loop_and_numpy_lowering_agree(case: tuple[PageLayout, int, list[int], list[int]]) -> None:
    layout, rank, src_pages, dst_pages = case
    loop = layout._segments_loop(rank, src_pages, dst_pages)
    vector = layout._segments_vector(rank, src_pages, dst_pages)
    assert loop.rows.shape == vector.rows.shape
    assert loop == vector


def test_segment_table_is_a_read_only_sequence_of_segments() -> None:
    table = PageLayout(4096, 1).segments(0, [3, 4, 9], [7, 8, 1])
    assert list(table) == [Segment(3 * 4096, 7 * 4096, 8192), Segment(9 * 4096, 4096, 4096)]
    assert table[-1] == Segment(9 * 4096, 4096, 4096)
    assert table.nbytes == 3 * 4096
    assert table[1:] == [table[1]]
    assert SegmentTable.of(table) is table
    assert SegmentTable.of(list(table)) == table
    with pytest.raises(ValueError):
        table.rows[0, 0] = 0
    with pytest.raises(ValueError):
        SegmentTable([[1, 2]])
    assert len(SegmentTable(())) == 0
    flat = SegmentTable.from_flat([1, 2, 3, 4, 5, 6])
    assert len(flat) == 2 and flat[-1] == Segment(4, 5, 6) and flat.nbytes == 9
    assert flat == SegmentTable([[1, 2, 3], [4, 5, 6]]) and flat.rows.tolist() == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(IndexError):
        flat[2]
    with pytest.raises(ValueError):
        SegmentTable.from_flat([1, 2])


def test_rows_within_drops_empty_segments_and_refuses_any_outside() -> None:
    table = SegmentTable([[0, 90, 10], [5, 0, 0], [90, 0, 10]])
    assert table.rows_within(100, 100).tolist() == [[0, 90, 10], [90, 0, 10]]  # exact fits pass
    for src_nbytes, dst_nbytes in ((99, 100), (100, 99)):
        with pytest.raises(ValueError, match="outside"):
            table.rows_within(src_nbytes, dst_nbytes)
    for bad in ([[-1, 0, 4]], [[0, -1, 4]], [[0, 0, -4]]):
        with pytest.raises(ValueError, match="outside"):
            SegmentTable(bad).rows_within(100, 100)
    assert len(SegmentTable(()).rows_within(0, 0)) == 0


@given(
    st.lists(st.tuples(st.integers(-1, 8), st.integers(-1, 8), st.integers(-1, 4)), max_size=6),
    st.integers(6, 12),
    st.integers(6, 12),
)
@example([(8, 0, 4), (0, 8, 4)], 12, 12)  # exact fits on both sides
@example([(9, 0, 4)], 12, 12)
@example([(8, 0, 1), (0, 0, 4)], 10, 10)  # the largest offset plus the largest length is past the end
def test_rows_within_small_and_array_tables_agree(
    rows: list[tuple[int, int, int]], src_nbytes: int, dst_nbytes: int
) -> None:
    """A small table checks its flat list in plain Python, a large one its
    array with numpy: the same rows back, or the same error."""
    flat = SegmentTable.from_flat([x for row in rows for x in row])
    array = SegmentTable(rows)
    outcomes = []
    for table in (flat, array):
        try:
            outcomes.append(table.rows_within(src_nbytes, dst_nbytes).tolist())
        except ValueError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]


@given(
    st.lists(st.tuples(st.integers(-1, 8), st.integers(-1, 8), st.integers(-1, 4)), max_size=6),
    st.integers(6, 12),
    st.integers(6, 12),
)
@example([(8, 0, 4), (0, 8, 4)], 12, 12)
@example([(9, 0, 4)], 12, 12)
def test_columns_within_are_rows_within_as_lists(
    rows: list[tuple[int, int, int]], src_nbytes: int, dst_nbytes: int
) -> None:
    """columns_within: the rows rows_within returns, as address lists with the
    bases added, for small and array tables alike; or the same error."""
    expected: object
    try:
        checked = SegmentTable(rows).rows_within(src_nbytes, dst_nbytes).tolist()
        expected = (
            [s + 1000 for s, _, _ in checked],
            [d + 2000 for _, d, _ in checked],
            [n for *_, n in checked],
        )
    except ValueError as exc:
        expected = str(exc)
    for table in (SegmentTable.from_flat([x for row in rows for x in row]), SegmentTable(rows)):
        try:
            got: object = table.columns_within(src_nbytes, dst_nbytes, 1000, 2000)
        except ValueError as exc:
            got = str(exc)
        assert got == expected


def test_mismatched_lengths_and_uneven_shards_are_refused() -> None:
    with pytest.raises(ValueError):
        PageLayout(4096, 2).segments(0, [1, 2], [3])
    with pytest.raises(ValueError):
        PageLayout(4095, 2)
