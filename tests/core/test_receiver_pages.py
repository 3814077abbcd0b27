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
from kvconn.errors import KvconnError, PageError, PageInUseError, RequestError, RoomStateError
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


@pytest.mark.parametrize(
    "refused",
    [
        dict(ranks=frozenset()),  # issue 31 item 1: these pages stayed "in use" for good
        dict(ranks=frozenset({3})),
        dict(extras_slot=0),  # a region of pages has no extras slots
    ],
    ids=["no-ranks", "unknown-rank", "extras-slot"],
)
def test_a_refused_receiver_leaves_its_room_and_pages_free(
    decode: tuple[DecodeEndpoint, PrefillRank], refused: dict[str, object]
) -> None:
    endpoint, _ = decode
    with pytest.raises(RequestError) as info:
        endpoint.receiver(40, (7, 8), **refused)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError) and info.value.room == 40  # what an engine caught before
    assert endpoint.tracker.state(40) is None
    rx = endpoint.receiver(41, (7, 8))  # the same pages, for another room: not refused as in use
    rx.abort()
    wait_for(lambda: endpoint.tracker.state(41) is None, 30.0, "the aborted room's release")


def test_finish_before_completion_is_still_a_value_error(decode: tuple[DecodeEndpoint, PrefillRank]) -> None:
    """Issue 31 item 3: finish() raised ValueError before the typed errors;
    an engine catching that must still catch it."""
    endpoint, _ = decode
    rx = endpoint.receiver(42, (9,))
    with pytest.raises(ValueError, match="room 42: not completed") as info:
        rx.finish()
    assert isinstance(info.value, RoomStateError) and isinstance(info.value, KvconnError)
    rx.abort()
    wait_for(lambda: endpoint.tracker.state(42) is None, 30.0, "the aborted room's release")


def test_pages_an_engine_reuses_before_their_release_are_refused_counted_and_logged(
    decode: tuple[DecodeEndpoint, PrefillRank], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 40: an engine that freed an aborted room's pages early (before
    on_release) looked exactly like a correct one in kvconn's metrics; only
    the refusal of its next request gave it away. Now that refusal is a
    ``PageInUseError``, counted as ``reason="pages_in_use"`` (the
    ``KvconnEnginePageReuse`` alert), and logged as an error."""
    endpoint, _ = decode
    before = endpoint.metrics.value("kvconn_requests_refused_total", reason="pages_in_use")
    held = endpoint.receiver(300, (4, 5, 6))
    with caplog.at_level("ERROR", "kvconn.runtime.decode"), pytest.raises(PageInUseError) as info:
        endpoint.receiver(301, (6, 7))  # page 6 is still room 300's
    assert "6" in str(info.value) and info.value.room == 301
    assert endpoint.metrics.value("kvconn_requests_refused_total", reason="pages_in_use") == before + 1
    assert "reused pages kvconn has not released" in caplog.text
    assert endpoint.tracker.state(301) is None
    # other refusals are counted apart: bad input is not an engine reusing pages
    with pytest.raises(PageError):
        endpoint.receiver(302, (NUM_PAGES,))
    assert endpoint.metrics.value("kvconn_requests_refused_total", reason="pages_in_use") == before + 1
    assert endpoint.metrics.value("kvconn_requests_refused_total", reason="invalid") >= 1
    held.abort()
    wait_for(lambda: endpoint.tracker.state(300) is None, 30.0, "the aborted room's release")
    endpoint.receiver(301, (6, 7)).abort()  # once released, the pages are the engine's to give again
    wait_for(lambda: endpoint.tracker.state(301) is None, 30.0, "the aborted room's release")
