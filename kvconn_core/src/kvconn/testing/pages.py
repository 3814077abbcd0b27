"""Decode's pages as an engine's allocator hands them out, with a canary in
every page that is not in use: a page whose canary changed was written when
or where no write was due.

Both clusters, :class:`kvconn.testing.cluster.Cluster` (kvconn's own tests)
and :class:`kvconn.conformance.harness.Cluster` (the conformance suite),
keep their pages here.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvconn.testing.patterns import CANARY, canary, shard_bytes

__all__ = ["CanaryPages"]


class _Region(Protocol):
    def read(self, offset: int, nbytes: int) -> bytes: ...
    def write(self, offset: int, data: bytes) -> None: ...


class CanaryPages:
    """``num_pages`` pages of ``page_bytes`` in ``region``, each written by
    ``num_ranks`` ranks (a shard each), all free and canaried at the start."""

    def __init__(self, region: _Region, num_pages: int, page_bytes: int, num_ranks: int = 1) -> None:
        self.region = region
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.num_ranks = num_ranks
        self.shard = page_bytes // num_ranks
        self._lock = threading.Lock()
        self._free = set(range(num_pages))
        #: Free pages that were handed out and came back since (not handed out again).
        self._returned: set[int] = set()
        #: Pages that came back at least once.
        self.returned_once: set[int] = set()
        region.write(0, canary(num_pages * page_bytes))

    # -- the allocator -------------------------------------------------------
    def take(
        self,
        n: int,
        exclude: Iterable[int] = (),
        fresh_first: bool = False,
        rng: random.Random | None = None,
    ) -> tuple[list[int], list[int]]:
        """``n`` free pages (lowest first, or with ``rng`` a random pick of the
        first half), and which of them had come back from an earlier use.

        ``fresh_first``: pages never handed out, then those that came back:
        returned pages cool down, so a late write into them is seen by the
        checks of their old room rather than overwritten by a new one."""
        with self._lock:
            free = sorted(self._free - set(exclude))
            if len(free) < n:
                raise AssertionError(f"{n} pages wanted, only {len(free)} free")
            if fresh_first:
                free.sort(key=lambda p: (p in self._returned, p))
            pages = free[:n] if rng is None else sorted(rng.sample(free[: max(n, len(free) // 2)], n))
            self._free.difference_update(pages)
            reused = [p for p in pages if p in self._returned]
            self._returned.difference_update(pages)
        return pages, reused

    def untake(self, pages: Iterable[int]) -> None:
        """Pages taken but never used: free again as they were (canary untouched)."""
        with self._lock:
            self._free.update(pages)

    def give_back(self, pages: Iterable[int]) -> None:
        """The engine is done with ``pages``: lay a fresh canary, then free them."""
        pages = sorted(pages)
        pb = self.page_bytes
        for first, count in _runs(pages):  # one write per run of adjacent pages
            self.region.write(first * pb, canary(count * pb))
        with self._lock:
            self._free.update(pages)
            self._returned.update(pages)
            self.returned_once.update(pages)

    def recanary(self, pages: Iterable[int]) -> None:
        """Lay a fresh canary over ``pages``, held or free, changing nothing
        else: a byte that changes it afterwards landed after now."""
        pb = self.page_bytes
        for first, count in _runs(sorted(pages)):
            self.region.write(first * pb, canary(count * pb))

    def free_pages(self) -> list[int]:
        with self._lock:
            return sorted(self._free)

    def returned_pages(self, pages: Iterable[int] | None = None) -> list[int]:
        """Of ``pages`` (or all), those that came back and were not handed out since."""
        with self._lock:
            return sorted(self._returned if pages is None else self._returned & set(pages))

    # -- checks ----------------------------------------------------------------
    def dirty_bytes(self, page: int) -> int:
        """Bytes of ``page`` that are not canary."""
        data = self.region.read(page * self.page_bytes, self.page_bytes)
        return len(data) - data.count(CANARY)

    def changed(self, pages: Iterable[int]) -> list[int]:
        """Those of ``pages`` whose canary changed. A region that compares
        pages with a canary itself (``changed_pages``: one held in another
        process) does it where the bytes are."""
        pages = list(pages)
        if not pages:
            return []
        where_they_are = getattr(self.region, "changed_pages", None)
        if where_they_are is not None:
            return list(where_they_are(pages, self.page_bytes, CANARY))
        return changed_pages(self.region, pages, self.page_bytes, CANARY)

    def wrong_pattern(self, room: int, pages: Sequence[int], ranks: Iterable[int] | None = None) -> list[int]:
        """Those of ``pages`` (the room's, in order) in which a shard of
        ``ranks`` (all) does not hold what that rank writes for ``room``
        (compared where the bytes are, as :meth:`changed`)."""
        which = list(range(self.num_ranks) if ranks is None else ranks)
        where_they_are = getattr(self.region, "wrong_pattern_pages", None)
        if where_they_are is not None:
            return list(where_they_are(room, list(pages), self.page_bytes, self.num_ranks, which))
        return wrong_pattern_pages(self.region, room, pages, self.page_bytes, self.num_ranks, which)


def changed_pages(region: _Region, pages: Sequence[int], page_bytes: int, value: int) -> list[int]:
    """Those of ``pages`` of ``region`` that do not hold ``value`` in every
    byte (their span read at once)."""
    if not pages:
        return []
    lo, hi = min(pages), max(pages)
    data = memoryview(region.read(lo * page_bytes, (hi - lo + 1) * page_bytes))
    want = bytes([value]) * page_bytes
    return [p for p in pages if data[(p - lo) * page_bytes : (p - lo + 1) * page_bytes] != want]


def wrong_pattern_pages(
    region: _Region, room: int, pages: Sequence[int], page_bytes: int, num_ranks: int, ranks: Sequence[int]
) -> list[int]:
    """Those of ``pages`` (``room``'s, in order) in which a shard of one of
    ``ranks`` (of ``num_ranks``) does not hold what that rank writes for
    ``room`` (their span read at once)."""
    bad: list[int] = []
    if not pages:
        return bad
    shard = page_bytes // num_ranks
    lo, hi = min(pages), max(pages)
    data = memoryview(region.read(lo * page_bytes, (hi - lo + 1) * page_bytes))
    for i, page in enumerate(pages):
        for rank in ranks:
            at = (page - lo) * page_bytes + rank * shard
            if data[at : at + shard] != shard_bytes(room, rank, i, shard):
                bad.append(page)
                break
    return bad


def _runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted ``pages`` as (first, count) runs of adjacent pages."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs
