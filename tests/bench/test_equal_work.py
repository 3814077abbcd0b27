"""The abort bench does equal work whatever its size (issue 42): its pool is
what the run needs, the page given back last goes out first, and canaries
are laid and checked only on pages it handed out (a pool of 4 GiB canaried
whole made most of a request's CPU page faults at 512 rooms)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from kvconn.bench.mode_result import ModeResult
from kvconn.bench.workload import ModeRun, Workload, pool_pages, source_pages
from kvconn.testing.patterns import canary

PAGE = 16


class _Region:
    def __init__(self, pages: int) -> None:
        self.data = bytearray(pages * PAGE)
        self.reads: list[int] = []
        self.writes: list[int] = []

    def read(self, offset: int, nbytes: int) -> bytes:
        self.reads.append(offset // PAGE)
        return bytes(self.data[offset : offset + nbytes])

    def write(self, offset: int, data: bytes) -> None:
        self.writes.append(offset // PAGE)
        self.data[offset : offset + len(data)] = data


def _pool(pages: int) -> tuple[ModeRun, _Region]:
    """A ModeRun's page pool alone (no processes)."""
    run = ModeRun.__new__(ModeRun)
    region = _Region(pages)
    run._lock = threading.RLock()
    run.result = ModeResult("kvconn")
    run.decode = SimpleNamespace(region=region)  # type: ignore[assignment]
    run.wl = SimpleNamespace(page_bytes=PAGE, pool_pages=pages)  # type: ignore[assignment]
    run._free = list(range(pages - 1, -1, -1))
    run._owner = {}
    run._canary = canary(PAGE)
    return run, region


def test_the_page_given_back_last_goes_out_first() -> None:
    run, _ = _pool(8)
    first = run._alloc(2)
    second = run._alloc(2)
    assert first == (0, 1) and second == (2, 3)
    run._give_back(10, first)
    assert run._alloc(2) == (0, 1)  # not 4, 5: the pages a run touches stay few
    assert run._alloc(9) is None


def test_canaries_are_laid_and_checked_only_on_pages_handed_out() -> None:
    run, region = _pool(8)
    assert region.writes == [] and region.reads == []  # nothing laid at the start
    pages = run._alloc(3)
    assert pages is not None and region.reads == []  # never handed out: no canary to check
    run._give_back(7, pages)
    assert sorted(region.writes) == [0, 1, 2]
    region.data[PAGE + 3] ^= 0xFF  # a late write into page 1
    again = run._alloc(3)
    assert again == (0, 1, 2) and sorted(region.reads) == [0, 1, 2]
    [violation] = run.result.violations
    assert violation.kind == "write_after_release" and violation.page == 1 and violation.room == 7


def test_memory_is_what_the_run_needs() -> None:
    # twice the pages in flight (aborted rooms wait for proof), the streaming phase's at least
    assert pool_pages(16, 512) == 2 * 512 * 16 and pool_pages(16, 8, stream_requests=32) == 32 * 16
    wl = Workload(400, 16, 65536, 4, 2, 512, 0.3, 0.02, 0, pool_pages(16, 512), 32)
    assert source_pages(wl) == 2 * 512 * 16  # was 4 x; at 8 rooms the 512 pages a small run always had
    assert source_pages(Workload(400, 16, 65536, 4, 2, 8, 0.3, 0.02, 0, 256, 32)) == 512
