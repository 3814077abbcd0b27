"""A process that takes over a peer's address is not that peer (found in
review, 2026-11-30). A rank restarted at its address never wrote for this
decode: its ack must not release pages the old process may still reach. A
decode restarted at its address reuses room ids: the earlier decode's
SUCCESS must not hand out pages a request of the new one is about to get."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TypeVar

import pytest

from kvconn.config import Config
from kvconn.protocol import wire
from kvconn.protocol.hold import Release
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import HelloAck, Message, TransferRequest
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.cluster import at_the_same_address, free_port
from kvconn.testing.null import NullBackend
from kvconn.testing.waiting import wait_for

WAIT_S = 10.0
T = TypeVar("T")


@pytest.fixture
def closing() -> Iterator[list[PrefillRank | DecodeEndpoint]]:
    opened: list[PrefillRank | DecodeEndpoint] = []
    try:
        yield opened
    finally:
        for endpoint in reversed(opened):
            endpoint.close()


def _dropped(decode: DecodeEndpoint, reason: str) -> float:
    return decode.metrics.value("kvconn_dropped_messages_total", reason=reason)


def test_an_ack_from_a_process_restarted_at_the_ranks_address_releases_nothing(
    closing: list[PrefillRank | DecodeEndpoint],
) -> None:
    config = Config(port=free_port(), write_timeout_s=0.5, abort_timeout_s=30.0)
    rank = PrefillRank(NullBackend(), 0, 16 * 4096, config)  # its engine never sends: room 7 stays open
    released: list[Release] = []
    decode = DecodeEndpoint(NullBackend(), 16, 4096, [rank.address], Config(), on_release=released.append)
    closing += [decode]
    rx = decode.receiver(7, (3, 4))
    wait_for(lambda: rank.sender(7).poll() is KVPoll.WAITING_FOR_INPUT, WAIT_S, "room 7 at the rank")
    rank.close()  # this process lives on (no exit proof), its address is free
    restarted = at_the_same_address(lambda: PrefillRank(NullBackend(), 0, 16 * 4096, config))
    closing += [restarted]
    assert restarted.address == rank.address
    rx.abort()  # the restarted process never saw room 7: it tombstones it and acks
    wait_for(
        lambda: bool(released) or _dropped(decode, "other_session") >= 1,
        WAIT_S,
        "the restarted process's ack",
    )
    assert released == []
    assert rx.state() is not None  # still held by decode (quarantined at its deadline, never freed)


def test_an_earlier_decodes_status_for_a_reused_room_id_is_not_taken(
    closing: list[PrefillRank | DecodeEndpoint],
) -> None:
    rank = PrefillRank(NullBackend(), 0, 16 * 4096, Config())
    closing += [rank]
    # The rank takes the new decode's request only once the test says so: its
    # SUCCESS for the earlier decode's room reaches the new decode first.
    new_name: list[str] = []
    take_request = threading.Event()
    handle = rank._listener._handler

    def held(msg: Message) -> None:
        if isinstance(msg, TransferRequest) and msg.decode in new_name:
            take_request.wait(WAIT_S)
        handle(msg)

    rank._listener._handler = held
    decode_config = Config(port=free_port())
    first = DecodeEndpoint(NullBackend(), 16, 4096, [rank.address], decode_config)
    first.receiver(9, (1, 2))
    wait_for(lambda: rank.sender(9).poll() is KVPoll.WAITING_FOR_INPUT, WAIT_S, "room 9 at the rank")
    first_sender = rank.sender(9)
    first.close()  # dies with room 9 open
    second = at_the_same_address(
        lambda: DecodeEndpoint(NullBackend(), 16, 4096, [rank.address], decode_config)
    )
    closing += [second]
    new_name.append(second.name)
    try:
        rx = second.receiver(9, (7, 8))  # the same room id, other pages
        first_sender.send([0, 1], last=True)  # the earlier room lands: SUCCESS goes to this address
        wait_for(
            lambda: rx.poll() is KVPoll.SUCCESS or _dropped(second, "other_decode") >= 1,
            WAIT_S,
            "the earlier decode's status",
        )
        assert rx.poll() is not KVPoll.SUCCESS
    finally:
        take_request.set()


def test_a_hello_ack_after_bootstrap_adds_no_rank(closing: list[PrefillRank | DecodeEndpoint]) -> None:
    """A rank id that answers after bootstrap (a restarted process, a stray
    reply) would make every later room wait for an ack nobody sends."""
    rank = PrefillRank(NullBackend(), 0, 16 * 4096, Config())
    closing += [rank]
    decode = DecodeEndpoint(NullBackend(), 16, 4096, [rank.address], Config())
    closing += [decode]
    decode._listener.deliver(wire.encode(HelloAck(5, rank.address, "", 1, 1, "", 123)))
    assert _dropped(decode, "hello_ack_changed") == 1
    assert decode.ranks == {0}
    decode.receiver(8, (5,))
    assert decode.tracker.ranks_of(8) == {0}


def test_a_lost_hello_ack_is_answered_again(
    closing: list[PrefillRank | DecodeEndpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22 item 11: a HelloAck lost on the way (written into a connection
    to an earlier decode at this address, not yet seen closed) left bootstrap
    waiting bootstrap_timeout_s for an answer nobody would send again."""
    rank = PrefillRank(NullBackend(), 0, 16 * 4096, Config())
    closing += [rank]
    answer = DecodeEndpoint._on_message
    lost: list[Message] = []

    def lossy(self: DecodeEndpoint, msg: Message) -> None:
        if isinstance(msg, HelloAck) and not lost:
            lost.append(msg)  # the first answer never arrives
            return
        answer(self, msg)

    monkeypatch.setattr(DecodeEndpoint, "_on_message", lossy)
    decode = DecodeEndpoint(
        NullBackend(), 16, 4096, [rank.address], Config(bootstrap_timeout_s=5.0, resend_interval_s=0.05)
    )
    closing += [decode]
    assert lost and decode.ranks == {0}


def test_a_new_decode_at_an_earlier_decodes_address_gets_a_new_connection(
    closing: list[PrefillRank | DecodeEndpoint],
) -> None:
    """The rank's connection to the earlier decode may not have been seen to
    close: what it writes there is lost. A new decode's answers go out on a
    connection of their own."""
    rank = PrefillRank(NullBackend(), 0, 16 * 4096, Config())
    closing += [rank]
    config = Config(port=free_port())
    first = DecodeEndpoint(NullBackend(), 16, 4096, [rank.address], config)
    old = rank._outbox._socks[first.address][1]
    first.close()
    second = at_the_same_address(lambda: DecodeEndpoint(NullBackend(), 16, 4096, [rank.address], config))
    closing += [second]
    assert second.address == first.address
    assert rank._outbox._socks[second.address][1] is not old
    assert old.closed
