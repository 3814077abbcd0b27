"""What an engine can rely on from Sender and Receiver: a room is never
SUCCESS with pages unwritten, a handle acts only on its own request and keeps
its verdict, and every misuse is refused with a typed error that changes
nothing."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest

from kvconn.config import Config
from kvconn.errors import IncompleteRoomError, KvconnError, PageError, RoomInUseError, RoomStateError
from kvconn.protocol.hold import HoldState, Proof, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.runtime.prefill import PrefillRank, Sender
from kvconn.testing.null import NullBackend
from kvconn.testing.waiting import wait_for

PAGES = 16


class Pair:
    """One in-process rank and one decode endpoint over a backend that writes nothing."""

    def __init__(self, rank_config: Config | None = None, decode_config: Config | None = None) -> None:
        backend = NullBackend()
        self.releases: list[Release] = []
        self.rank = PrefillRank(backend, 0, PAGES * 4096, rank_config or Config())
        self.decode = DecodeEndpoint(
            backend,
            PAGES,
            4096,
            [self.rank.address],
            decode_config or Config(),
            on_release=self.releases.append,
        )

    def open(self, room: int, pages: tuple[int, ...]) -> tuple[Receiver, Sender]:
        rx = self.decode.receiver(room, pages)
        tx = self.rank.sender(room)
        wait_for(lambda: tx.poll() >= KVPoll.WAITING_FOR_INPUT, 10, f"room {room} at the rank")
        return rx, tx

    def rank_status(self, room: int) -> KVPoll | None:
        """The rank's status of this decode's ``room``."""
        from kvconn.protocol.ledger import RoomKey

        return self.rank.ledger.status(RoomKey(self.decode.name, room))

    def close(self) -> None:
        self.decode.close()
        self.rank.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_a_short_last_chunk_is_refused_and_the_room_is_never_success(pair: Pair) -> None:
    rx, tx = pair.open(1, (0, 1, 2, 3))
    with pytest.raises(IncompleteRoomError, match=r"room 1: a last chunk of 2 pages leaves 2 .* unwritten"):
        tx.send([0, 1], last=True)
    assert pair.rank.metrics.value("kvconn_chunks_total", outcome="landed") == 0.0  # nothing queued
    assert rx.poll() is KVPoll.TRANSFERRING
    # the refusal changed nothing: the room completes as it should
    tx.send([0, 1])
    tx.send([2, 3], last=True)
    wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 10, "success")
    assert rx.finish() == (0, 1, 2, 3)


def test_a_stale_receiver_never_acts_on_a_newer_request_for_the_same_room(pair: Pair) -> None:
    first, tx = pair.open(1, (0, 1))
    tx.send([0, 1], last=True)
    wait_for(lambda: first.poll() is KVPoll.SUCCESS, 10, "the first request's success")
    assert first.finish() == (0, 1)
    tx.clear()
    second, tx2 = pair.open(1, (2, 3))

    first.abort()  # a client cancel racing the first request's completion, arriving late
    assert second.state() is HoldState.OPEN
    assert pair.decode.tracker.state(1) is HoldState.OPEN
    assert pair.rank_status(1) is KVPoll.WAITING_FOR_INPUT  # no ABORT reached the rank
    assert first.poll() is KVPoll.SUCCESS  # its own verdict, not the new request's
    assert first.state() is None
    with pytest.raises(RoomStateError, match=r"room 1: finish\(\) was already called"):
        first.finish()
    assert second.poll() is KVPoll.TRANSFERRING

    tx2.send([2, 3], last=True)
    wait_for(lambda: second.poll() is KVPoll.SUCCESS, 10, "the second request's success")
    assert second.finish() == (2, 3)
    assert not pair.releases


def test_clearing_a_live_room_fails_it_and_tells_decode(pair: Pair) -> None:
    rx, tx = pair.open(1, (0, 1, 2, 3))
    tx.send([0, 1])
    tx.clear()  # the engine drops the request with chunks left to send
    wait_for(lambda: rx.poll() is KVPoll.FAILED, 10, "decode told the room failed")
    assert "cleared" in (rx.failure() or "")
    assert tx.poll() is KVPoll.FAILED
    with pytest.raises(RoomStateError, match=r"room 1: .*cleared"):
        tx.send([2, 3], last=True)
    rx.abort()
    wait_for(lambda: bool(pair.releases), 10, "the release")
    assert pair.releases[0].proof is Proof.ACKS  # pages back only with the rank's proof


def test_verdicts_stay_final_on_both_handles(pair: Pair) -> None:
    rx, tx = pair.open(1, (0, 1))
    tx.send([0, 1], last=True)
    wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 10, "success")
    rx.finish()
    assert rx.poll() is KVPoll.SUCCESS
    tx.clear()
    assert tx.poll() is KVPoll.SUCCESS
    assert pair.rank_status(1) is None  # forgotten at the rank, yet the handle keeps its verdict

    failed, ftx = pair.open(2, (2, 3))
    ftx.fail("the engine gave up")
    wait_for(lambda: failed.poll() is KVPoll.FAILED, 10, "failure at decode")
    failed.abort()
    wait_for(lambda: any(r.room == 2 for r in pair.releases), 10, "the release")
    assert failed.poll() is KVPoll.FAILED and failed.failure() == "the engine gave up"
    ftx.clear()
    assert ftx.poll() is KVPoll.FAILED


def test_misuse_gets_a_typed_error_naming_the_room_and_the_problem(pair: Pair) -> None:
    rx, tx = pair.open(1, (0, 1))
    with pytest.raises(RoomStateError, match="room 1: not completed"):
        rx.finish()
    with pytest.raises(PageError, match=r"room 1: source pages \[16\] outside 0..15"):
        tx.send([16, 0])
    with pytest.raises(PageError, match=r"room 1: source pages \[-1\]"):
        tx.send([-1, 0])
    tx.send([0, 1], last=True)
    wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 10, "success")
    rx.finish()
    with pytest.raises(RoomStateError, match=r"room 1: finish\(\) was already called"):
        rx.finish()

    for bad in ([PAGES], [-1], [3, PAGES + 5]):
        with pytest.raises(PageError, match=f"room 2: pages .* outside 0..{PAGES - 1}"):
            pair.decode.receiver(2, bad)
    with pytest.raises(PageError, match=r"room 2: pages \[3\] given more than once"):
        pair.decode.receiver(2, [3, 3])
    live = pair.decode.receiver(3, (4, 5))
    with pytest.raises(RoomInUseError, match="room 3: still tracked"):
        pair.decode.receiver(3, (6,))
    with pytest.raises(PageError, match=r"room 4: pages \[5\] belong to another room"):
        pair.decode.receiver(4, (5, 6))
    assert pair.decode.tracker.state(4) is None  # refused whole: nothing tracked, nothing sent
    assert issubclass(PageError, KvconnError) and issubclass(PageError, ValueError)
    live.abort()
    wait_for(lambda: any(r.room == 3 for r in pair.releases), 10, "room 3's release")
    assert pair.decode.receiver(4, (5, 6)).poll() is KVPoll.TRANSFERRING  # its pages are free again


def test_pages_of_a_held_room_are_refused_until_proven_free() -> None:
    # the rank never acks: the aborted room stays held, then quarantined
    short = Config(abort_timeout_s=0.5, write_timeout_s=0.2)
    pair = Pair(rank_config=attrs.evolve(short, acks_enabled=False), decode_config=short)
    try:
        rx, _ = pair.open(1, (0, 1))
        rx.abort()
        assert rx.state() in (HoldState.HELD, HoldState.QUARANTINED)
        with pytest.raises(PageError, match=r"room 2: pages \[1\] belong to another room"):
            pair.decode.receiver(2, (1, 2))
        assert pair.decode.held_pages() == 2  # the refusal lost nothing that was held
        # the check can be turned off (the engine's allocator is trusted)
        trusting = Pair(decode_config=Config(check_pages=False))
        try:
            trusting.decode.receiver(1, (0, 1))
            trusting.decode.receiver(2, (1, 2))
        finally:
            trusting.close()
    finally:
        pair.close()


def test_the_ledger_fails_a_live_room_on_clear_and_acks_only_once_drained() -> None:
    from kvconn.protocol.ledger import NotifyDecode, RoomKey, RoomLedger, SendAck
    from kvconn.protocol.messages import Abort, RoomOutcome

    ledger = RoomLedger(0)
    key = RoomKey("d", 1)
    ledger.request(key)
    assert ledger.dequeue(key)  # a chunk is being written
    actions = ledger.clear(key)
    assert [a.status.outcome for a in actions if isinstance(a, NotifyDecode)] == [RoomOutcome.FAILED]
    ledger.abort(Abort(1, 5, "d", "tcp://d"), now=0.0)
    assert not [a for a in ledger.try_ack(key) if isinstance(a, SendAck)]  # the write may still land
    assert [a.ack.generation for a in ledger.landed(key, last=False) if isinstance(a, SendAck)] == [5]


def test_an_aborted_room_id_is_reusable_once_its_abort_was_acked(pair: Pair) -> None:
    """Not after tombstone_ttl_s (600 s): once every rank acked the abort and
    decode has the pages back, the next request for the id is a new room."""
    rx, tx = pair.open(1, (0, 1, 2, 3))
    tx.send([0, 1])
    rx.abort()
    wait_for(lambda: any(r.room == 1 for r in pair.releases), 10, "the abort's release")
    assert pair.releases[0].proof is Proof.ACKS
    again, tx2 = pair.open(1, (4, 5))
    assert again.poll() is KVPoll.TRANSFERRING
    with pytest.raises(RoomStateError, match="room 1: its request is over"):
        tx.send([2, 3], last=True)  # the first request's handle writes nothing into the new one
    tx2.send([0, 1], last=True)
    wait_for(lambda: again.poll() is not KVPoll.TRANSFERRING, 10, "the new request's outcome")
    assert again.poll() is KVPoll.SUCCESS, again.failure()
    assert again.finish() == (4, 5)
