"""What a prefill rank writes: a chunk of a room's pages, lowered to byte segments."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, overload

import attrs
import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt


@attrs.frozen(slots=True)
class Segment:
    """One contiguous copy: ``nbytes`` from the writer's source region at ``src``
    into the page owner's region at ``dst`` (both byte offsets)."""

    src: int
    dst: int
    nbytes: int


class SegmentTable(Sequence[Segment]):
    """Segments held as one read-only ``(n, 3)`` int64 array, :attr:`rows`:
    source offset, destination offset, bytes.

    The core hands ``on_post`` one of these. Lowering 1024 scattered pages into
    it takes ~0.08 ms, against ~0.7 ms as :class:`Segment` objects, and a
    transport that takes arrays (NIXL descriptor lists, Mooncake batches) reads
    :attr:`rows` without a Python object per page. It is still a
    ``Sequence[Segment]``, so a plugin that iterates segments works unchanged.

    A table of a few segments is kept as a flat list of ints until someone asks
    for :attr:`rows`: building the array costs ~0.7 us, more than lowering one
    page, and a transport that iterates never needs it.
    """

    __slots__ = ("_flat", "_rows")

    _flat: list[int] | None
    _rows: npt.NDArray[np.int64] | None

    def __init__(self, rows: Any) -> None:
        table = np.asarray(rows, dtype=np.int64)
        if table.size == 0:
            table = table.reshape(0, 3)
        if table.ndim != 2 or table.shape[1] != 3:
            raise ValueError(f"segment rows must be (n, 3): src, dst, nbytes; got shape {table.shape}")
        table = table.view()
        table.flags.writeable = False  # shared with whoever built it: no edits behind its back
        self._flat, self._rows = None, table

    @classmethod
    def from_flat(cls, flat: list[int]) -> SegmentTable:
        """A table over ``[src0, dst0, nbytes0, src1, ...]``, which it keeps
        (no copy): the caller must not change the list afterwards."""
        if len(flat) % 3:
            raise ValueError(f"a flat segment list holds triples, got {len(flat)} ints")
        table = cls.__new__(cls)
        table._flat, table._rows = flat, None
        return table

    @classmethod
    def of(cls, segments: Iterable[Segment]) -> SegmentTable:
        """``segments`` as a table: itself if it is one (no copy), else built."""
        if isinstance(segments, SegmentTable):
            return segments
        return cls([(s.src, s.dst, s.nbytes) for s in segments])

    @property
    def rows(self) -> npt.NDArray[np.int64]:
        """The ``(n, 3)`` int64 array (read-only): src, dst, nbytes per row."""
        if self._rows is None:
            # two threads may both build it: the same content, either is kept
            rows = np.array(self._flat, dtype=np.int64).reshape(-1, 3)
            rows.flags.writeable = False
            self._rows = rows
        return self._rows

    def rows_within(self, src_nbytes: int, dst_nbytes: int) -> npt.NDArray[np.int64]:
        """:attr:`rows` without empty segments, each checked to lie inside a
        source of ``src_nbytes`` and a destination of ``dst_nbytes``: what a
        transport posts. Raises ValueError naming the first segment outside."""
        if self._flat is not None:
            return self._small_rows_within(self._flat, src_nbytes, dst_nbytes)
        rows: npt.NDArray[np.int64] = self.rows
        if not len(rows):
            return rows
        if not rows[:, 2].all():
            rows = rows[rows[:, 2] != 0]
            if not len(rows):
                return rows
        src, dst, lens = rows[:, 0], rows[:, 1], rows[:, 2]
        # Reductions first, no new arrays (a chunk of 20,000 segments: each
        # new one 160 KB of fresh pages): the largest offset plus the largest
        # length bounds every end. Only past that bound are ends computed,
        # and the row at fault looked for.
        longest = lens.max()
        if rows.min() < 0 or src.max() + longest > src_nbytes or dst.max() + longest > dst_nbytes:
            outside = (rows < 0).any(axis=1) | (src + lens > src_nbytes) | (dst + lens > dst_nbytes)
            if outside.any():
                s, d, n = rows[int(np.flatnonzero(outside)[0])].tolist()
                _raise_outside(s, d, n, src_nbytes, dst_nbytes)
        return rows

    def columns_within(
        self, src_nbytes: int, dst_nbytes: int, src_base: int = 0, dst_base: int = 0
    ) -> tuple[list[int], list[int], list[int]]:
        """:meth:`rows_within` as three lists, for bindings that take lists
        (Mooncake's batches): source addresses (``src_base`` + offset),
        destination addresses (``dst_base`` + offset), lengths."""
        flat = self._flat
        if flat is None:
            rows = self.rows_within(src_nbytes, dst_nbytes)
            return (rows[:, 0] + src_base).tolist(), (rows[:, 1] + dst_base).tolist(), rows[:, 2].tolist()
        # A few rows, so plain Python: after a transfer has cycled the
        # caches, numpy's calls on one row took ~20 us, more than the lists.
        _check_small(flat, src_nbytes, dst_nbytes)
        srcs, dsts, lens = [], [], []
        for i in range(0, len(flat), 3):
            if flat[i + 2]:
                srcs.append(flat[i] + src_base)
                dsts.append(flat[i + 1] + dst_base)
                lens.append(flat[i + 2])
        return srcs, dsts, lens

    def _small_rows_within(self, flat: list[int], src_nbytes: int, dst_nbytes: int) -> npt.NDArray[np.int64]:
        # The same checks in plain Python: on a few rows, numpy's per-call
        # cost (~10 us for one row) is what a 1 MiB chunk would notice.
        empty = _check_small(flat, src_nbytes, dst_nbytes)
        rows = self.rows
        return rows[rows[:, 2] != 0] if empty else rows

    @property
    def nbytes(self) -> int:
        """Bytes of all segments together."""
        if self._flat is not None:
            return sum(self._flat[2::3])
        return int(self.rows[:, 2].sum())

    def __len__(self) -> int:
        return len(self._flat) // 3 if self._flat is not None else len(self.rows)

    @overload
    def __getitem__(self, index: int) -> Segment: ...
    @overload
    def __getitem__(self, index: slice) -> SegmentTable: ...
    def __getitem__(self, index: int | slice) -> Segment | SegmentTable:
        if isinstance(index, slice):
            return SegmentTable(self.rows[index])
        if self._flat is not None:
            i = range(len(self))[index] * 3  # IndexError, negative indices as a list's
            return Segment(*self._flat[i : i + 3])
        src, dst, nbytes = self.rows[index].tolist()
        return Segment(src, dst, nbytes)

    def __iter__(self) -> Iterator[Segment]:
        if self._flat is not None:
            it = iter(self._flat)
            for src, dst, nbytes in zip(it, it, it, strict=True):
                yield Segment(src, dst, nbytes)
            return
        for src, dst, nbytes in self.rows.tolist():
            yield Segment(src, dst, nbytes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SegmentTable):
            return bool(np.array_equal(self.rows, other.rows))
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares by value, like a list

    def __repr__(self) -> str:
        return f"SegmentTable({[(s.src, s.dst, s.nbytes) for s in self]!r})"


def _check_small(flat: list[int], src_nbytes: int, dst_nbytes: int) -> bool:
    """Raise like :meth:`SegmentTable.rows_within` for the first flat
    triple outside; True if any triple is empty."""
    empty = False
    for i in range(0, len(flat), 3):
        s, d, n = flat[i], flat[i + 1], flat[i + 2]
        if n == 0:
            empty = True
        elif s < 0 or d < 0 or n < 0 or s + n > src_nbytes or d + n > dst_nbytes:
            _raise_outside(s, d, n, src_nbytes, dst_nbytes)
    return empty


def _raise_outside(s: int, d: int, n: int, src_nbytes: int, dst_nbytes: int) -> NoReturn:
    raise ValueError(
        f"segment of {n} bytes from {s} to {d} lies outside a source of {src_nbytes} "
        f"or a destination of {dst_nbytes} bytes"
    )


@attrs.frozen(slots=True)
class Chunk:
    """A unit of transfer work for one room, as dequeued by a prefill worker.

    ``src_pages`` index the prefill rank's source pool, ``dst_pages`` the
    decode pool; the core lowers them to a :class:`SegmentTable` before
    posting.
    """

    room: int
    index: int
    last: bool
    rank: int
    peer: str
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
