"""A TRANSFER_REQUEST is taken once: a recorded one, sent again (its MAC is
still valid), or one for another process of the rank, makes nothing write.
Without this, decode's own request replayed after the room concluded made
the rank write into pages decode had handed out since."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconn.config import Config
from kvconn.protocol import wire
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import Hello, TransferRequest
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.null import NullBackend
from kvconn.testing.waiting import wait_for

KEY = b"k" * 32
WAIT_S = 10.0


@pytest.fixture
def world() -> Iterator[tuple[PrefillRank, DecodeEndpoint, list[int]]]:
    """A rank whose engine sends a room as soon as decode asks for it."""
    backend = NullBackend()
    requests: list[int] = []
    rank: PrefillRank | None = None

    def on_request(room: int, npages: int) -> None:
        requests.append(room)
        assert rank is not None
        rank.sender(room).send(list(range(npages)), last=True)

    rank = PrefillRank(backend, 0, 16 * 4096, Config(auth_key=KEY), on_request=on_request)
    decode = DecodeEndpoint(backend, 16, 4096, [rank.address], Config(auth_key=KEY))
    try:
        yield rank, decode, requests
    finally:
        decode.close()
        rank.close()


def _stale(rank: PrefillRank) -> float:
    return rank.metrics.value("kvconn_dropped_messages_total", reason="stale_request")


def test_a_replayed_request_after_the_room_concluded_writes_nothing(
    world: tuple[PrefillRank, DecodeEndpoint, list[int]],
) -> None:
    rank, decode, requests = world
    rx = decode.receiver(1, (5,))
    wait_for(lambda: rx.poll() is KVPoll.SUCCESS, WAIT_S, "room 1 to succeed", poll=0.001)
    rx.finish()  # decode has its page back and may hand it out
    landed = rank.metrics.value("kvconn_chunks_total", outcome="landed")
    session = decode._state.writers[0].session
    recorded = wire.encode(TransferRequest(1, decode.name, (5,), session, 1), KEY)  # what decode sent
    rank._listener.deliver(recorded)
    wait_for(lambda: _stale(rank) == 1, WAIT_S, "the replay to be dropped", poll=0.001)
    assert requests == [1]  # the engine was not asked again
    assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == landed
    # decode's next request is taken as ever
    rx = decode.receiver(1, (6,))
    wait_for(
        lambda: rx.poll() is KVPoll.SUCCESS, WAIT_S, "room 1, asked again by decode, to succeed", poll=0.001
    )
    assert requests == [1, 1] and _stale(rank) == 1


def test_a_request_for_another_process_of_the_rank_is_dropped(
    world: tuple[PrefillRank, DecodeEndpoint, list[int]],
) -> None:
    rank, decode, requests = world
    other = decode._state.writers[0].session ^ 1  # a rank process that ran at this address before
    rank._listener.deliver(wire.encode(TransferRequest(2, decode.name, (7,), other, 99), KEY))
    wait_for(lambda: _stale(rank) == 1, WAIT_S, "the request to be dropped", poll=0.001)
    assert requests == [] and rank.sender(2).poll() is KVPoll.BOOTSTRAPPING


def test_a_hello_cannot_change_a_known_decode_or_reset_its_requests(
    world: tuple[PrefillRank, DecodeEndpoint, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    rank, decode, _ = world
    rx = decode.receiver(1, (5,))
    wait_for(lambda: rx.poll() is KVPoll.SUCCESS, WAIT_S, "room 1 to succeed", poll=0.001)
    peer = rank._peers[decode.name]
    before = (peer.reply_to, peer.layout, peer.last_seq)
    changed = Hello(decode.name, "tcp://127.0.0.1:1", "null", 8192, 1, 30_000, b"")
    rank._listener.deliver(wire.encode(changed, KEY))
    assert "is already bootstrapped with another address or layout" in caplog.text
    assert rank._peers[decode.name] is peer
    assert (peer.reply_to, peer.layout, peer.last_seq) == before
