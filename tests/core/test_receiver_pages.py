"""``DecodeEndpoint.receiver`` refuses a page outside its region (issue 25).

A page index is a write target: one past the end (``num_pages``) or negative
would have the writer write outside decode's region on a transport that does
not check bounds itself (loopback does; a real one may not). The refusal must
leave nothing held and the room id free. The refusal is a typed
:class:`~kvconn.errors.PageError` naming the valid range.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconn.config import Config
from kvconn.errors import PageError
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.cluster import free_port
from kvconn.testing.null import NullBackend
from kvconn.testing.waiting import wait_for

NUM_PAGES = 16


@pytest.fixture(scope="module")
def decode() -> Iterator[tuple[DecodeEndpoint, PrefillRank]]:
    rank = PrefillRank(NullBackend(), 0, NUM_PAGES * 4096, Config(port=free_port()))
    endpoint = DecodeEndpoint(NullBackend(), NUM_PAGES, 4096, [rank.address], Config())
    try:
        yield endpoint, rank
    finally:
        endpoint.close()
        rank.close()


@pytest.mark.parametrize("bad", [NUM_PAGES, -1, NUM_PAGES + 7, -NUM_PAGES])
def test_a_page_outside_the_region_is_refused_and_nothing_is_held(
    decode: tuple[DecodeEndpoint, PrefillRank], bad: int
) -> None:
    endpoint, _ = decode
    room = 100 + bad
    with pytest.raises(PageError) as info:
        endpoint.receiver(room, (0, bad, NUM_PAGES - 1))
    assert str(NUM_PAGES - 1) in str(info.value)  # the message names the valid range
    assert endpoint.tracker.state(room) is None  # nothing opened, nothing held
    # the room id is still free: the refusal did not half-open it
    endpoint.receiver(room, (0, NUM_PAGES - 1)).abort()
    # the pages come back with the rank's ack; the next case takes them again
    wait_for(lambda: endpoint.tracker.state(room) is None, 30.0, "the aborted room's release")


def test_the_first_and_last_pages_are_accepted(decode: tuple[DecodeEndpoint, PrefillRank]) -> None:
    endpoint, _ = decode
    rx = endpoint.receiver(1, (0, NUM_PAGES - 1))
    assert endpoint.tracker.state(1) is not None
    rx.abort()
    wait_for(lambda: endpoint.tracker.state(1) is None, 30.0, "the aborted room's release")
