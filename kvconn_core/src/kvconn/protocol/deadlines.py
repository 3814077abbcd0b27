"""The rooms a ledger keeps until a deadline (tombstones waiting out their
TTL), in deadline order, with slots a compact tombstone can name.

Pure data structure: no clock of its own, ``now`` is passed in.
"""

from __future__ import annotations

import bisect
import heapq
from array import array
from collections.abc import Callable
from typing import Generic, TypeVar, cast

T = TypeVar("T")

#: Queue slots per chunk: a drained chunk is freed whole.
_CHUNK_BITS = 10
_CHUNK = 1 << _CHUNK_BITS


class _Chunk(Generic[T]):
    __slots__ = ("deadlines", "rooms", "tags")

    def __init__(self) -> None:
        self.deadlines = array("d")
        self.rooms: list[int | None] = []
        self.tags: list[T | None] = []


class DeadlineQueue(Generic[T]):
    """The rooms waiting out their TTL, earliest deadline first.

    With one TTL and a clock that only moves forward, rooms come due in the
    order they were scheduled: that part is a FIFO of fixed-size chunks
    (about 24 B a slot, O(1) each way, a chunk freed as soon as it drained),
    whose slots have stable numbers a compact tombstone names. A deadline
    earlier than the FIFO's last (an entry that was busy past its deadline,
    a clock set back) goes to a small heap beside it. A slot's tag is the
    caller's (the ledger's: the decode of a compact tombstone, or the full
    entry it stands for)."""

    __slots__ = ("_chunks", "_end", "_first", "_head", "_last", "_late", "_seq")

    def __init__(self) -> None:
        self._chunks: list[_Chunk[T] | None] = []
        self._first = 0  #: the number of the chunk self._chunks[0] is
        self._head = 0  #: the next slot to pop
        self._end = 0  #: the next slot to push
        self._last = 0.0  #: the latest deadline in the FIFO
        self._late: list[tuple[float, int, int, T]] = []
        self._seq = 0

    def __len__(self) -> int:
        return self._end - self._head + len(self._late)

    def push(self, deadline: float, room: int, tag: T) -> int | None:
        """Append to the FIFO and return the slot's number, or None (nothing
        done) if ``deadline`` is earlier than the FIFO's last."""
        if self._head < self._end:
            if deadline < self._last:
                return None
        elif self._chunks:
            # Drained: start afresh at a chunk boundary (slot numbers only grow).
            self._head = self._end = (self._end + _CHUNK - 1) & ~(_CHUNK - 1)
            self._first = self._end >> _CHUNK_BITS
            self._chunks = []
        pos = self._end
        i = (pos >> _CHUNK_BITS) - self._first
        if i == len(self._chunks):
            self._chunks.append(_Chunk())
        chunk = self._chunks[i]
        assert chunk is not None
        chunk.deadlines.append(deadline)
        chunk.rooms.append(room)
        chunk.tags.append(tag)
        self._last = deadline
        self._end = pos + 1
        return pos

    def earliest(self) -> float | None:
        """The earliest deadline queued (None: none)."""
        first = None
        if self._head < self._end:
            chunk, off = self._slot(self._head)
            first = chunk.deadlines[off]
        if self._late and (first is None or self._late[0][0] < first):
            first = self._late[0][0]
        return first

    def push_late(self, deadline: float, room: int, tag: T) -> None:
        self._seq += 1
        heapq.heappush(self._late, (deadline, self._seq, room, tag))

    def take(self, now: float, limit: int) -> list[tuple[int, T, float]]:
        """Up to ``limit`` slots due by ``now``, earliest first, taken out:
        (room, tag, deadline) each. A chunk's due run is found by bisection
        and taken as slices, not slot by slot."""
        out: list[tuple[int, T, float]] = []
        late = self._late
        while len(out) < limit:
            head = self._head
            bound = now if not late or late[0][0] > now else late[0][0]  # ties: the FIFO first
            if head < self._end:
                chunk = self._chunks[(head >> _CHUNK_BITS) - self._first]
                assert chunk is not None
                off = head & (_CHUNK - 1)
                deadlines = chunk.deadlines
                end = bisect.bisect_right(deadlines, bound, off, min(len(deadlines), off + limit - len(out)))
                if end > off:
                    # Slots not yet taken are never None.
                    rooms = cast("list[int]", chunk.rooms[off:end])
                    tags = cast("list[T]", chunk.tags[off:end])
                    out.extend(zip(rooms, tags, deadlines[off:end], strict=True))
                    # Freed now, not with the chunk.
                    chunk.rooms[off:end] = [None] * (end - off)
                    chunk.tags[off:end] = [None] * (end - off)
                    self._head = head + end - off
                    if end == _CHUNK or self._head == self._end:
                        self._drained(self._head - 1)
                    continue
            if late and late[0][0] <= now:
                deadline, _, room, entry = heapq.heappop(late)
                out.append((room, entry, deadline))
                continue
            break
        if not late:
            self._late = []  # a heap list keeps its peak's size too
        return out

    def deadline_at(self, pos: int) -> float:
        chunk, off = self._slot(pos)
        return chunk.deadlines[off]

    def tag_at(self, pos: int) -> T:
        chunk, off = self._slot(pos)
        tag = chunk.tags[off]
        assert tag is not None
        return tag

    def retag(self, pos: int, tag: T) -> None:
        chunk, off = self._slot(pos)
        chunk.tags[off] = tag

    def copy(self, retag: Callable[[T], T]) -> DeadlineQueue[T]:
        new: DeadlineQueue[T] = DeadlineQueue()
        new._first, new._head, new._end, new._last = self._first, self._head, self._end, self._last
        new._seq = self._seq
        for chunk in self._chunks:
            if chunk is None:
                new._chunks.append(None)
                continue
            c: _Chunk[T] = _Chunk()
            c.deadlines = array("d", chunk.deadlines)
            c.rooms = list(chunk.rooms)
            c.tags = [None if t is None else retag(t) for t in chunk.tags]
            new._chunks.append(c)
        new._late = [(d, s, r, retag(e)) for d, s, r, e in self._late]
        return new

    def _slot(self, pos: int) -> tuple[_Chunk[T], int]:
        chunk = self._chunks[(pos >> _CHUNK_BITS) - self._first]
        assert chunk is not None
        return chunk, pos & (_CHUNK - 1)

    def _drained(self, pos: int) -> None:
        """Slot ``pos`` was its chunk's last, or the FIFO's: free what drained."""
        i = (pos >> _CHUNK_BITS) - self._first
        if self._head == self._end:
            self._chunks = []
            self._head = self._end = (self._end + _CHUNK - 1) & ~(_CHUNK - 1)
            self._first = self._end >> _CHUNK_BITS
            return
        self._chunks[i] = None
        if i + 1 >= 64 and i + 1 >= len(self._chunks) // 2:
            del self._chunks[: i + 1]
            self._first += i + 1
