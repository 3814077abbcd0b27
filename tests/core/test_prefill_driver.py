"""The self-driving prefill rank the tests and the bench run (``prefill_proc``):
a room whose request was aborted before the driver reached it is skipped.
Kept, it failed its first send and stayed in the driver's in-flight queue,
where every later room waited for it to settle (a 10,000-request bench run
with two decodes stalled so)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconn.protocol.ledger import KVPoll
from kvconn.testing.prefill_proc import Driver


@pytest.fixture
def driver() -> Iterator[Driver]:
    d = Driver({"backend": "loopback", "num_ranks": 1, "rank": 0, "page_bytes": 4096, "source_pages": 16})
    yield d
    d.rank.close()


def test_a_room_with_no_live_request_is_skipped_not_sent(driver: Driver) -> None:
    assert driver.rank.sender(5).poll() is KVPoll.BOOTSTRAPPING  # never requested, or aborted before
    driver._send_room(5, 2)  # raised RoomStateError before, with the room left in flight
    assert not driver._inflight
    assert driver._next_src == 0  # no source pages taken for it either
