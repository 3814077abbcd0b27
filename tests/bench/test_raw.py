"""``--compare-raw``'s raw path: one writer process per rank, and a spot
check that expects the last room that wrote each page."""

from __future__ import annotations

import random

from kvconn.bench.raw import _spot_check, run_raw
from kvconn.plugins import get_backend
from kvconn.testing.patterns import shard_bytes

PAGE_BYTES, RANKS, POOL = 4096, 2, 48


def _rooms(n: int, pages: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(7)
    return [(100 + r, rng.sample(range(POOL), pages)) for r in range(n)]  # pages reused across rooms


def test_raw_ranks_write_every_room_in_processes_of_their_own() -> None:
    rooms = _rooms(24, 8)
    result = run_raw("loopback", get_backend("loopback"), rooms, PAGE_BYTES, RANKS, 2, POOL, {})
    assert result.available, result.detail
    assert result.detail.endswith(f"{RANKS} processes, spot-checked"), result.detail
    assert result.nbytes == 24 * 8 * PAGE_BYTES and result.seconds > 0


def test_spot_check_expects_the_last_writer_and_catches_a_wrong_shard() -> None:
    rooms = _rooms(12, 8)
    shard = PAGE_BYTES // RANKS
    region = get_backend("loopback").open_region(POOL * PAGE_BYTES, {})
    try:
        for room, dst in rooms:  # what the raw ranks leave behind
            for i, page in enumerate(dst):
                for rank in range(RANKS):
                    region.write(page * PAGE_BYTES + rank * shard, shard_bytes(room, rank, i, shard))
        assert _spot_check(region, rooms, PAGE_BYTES, RANKS) == 0
        first_room, first_pages = rooms[0]
        i, page = next((i, p) for i, p in enumerate(first_pages) if any(p in dst for _, dst in rooms[1:]))
        # The first room's own bytes, on a page a later room wrote last: what
        # a check against the first room would expect, and wrong here.
        region.write(page * PAGE_BYTES + shard, shard_bytes(first_room, 1, i, shard))
        assert _spot_check(region, rooms, PAGE_BYTES, RANKS) == 1
        region.write(page * PAGE_BYTES, bytes(shard))
        assert _spot_check(region, rooms, PAGE_BYTES, RANKS) == 2
    finally:
        region.close()
