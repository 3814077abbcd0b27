"""The prefill ledger, one stimulus at a time."""

from __future__ import annotations

from kvconn.protocol.ledger import KVPoll, NotifyDecode, RoomKey, RoomLedger, SendAck
from kvconn.protocol.messages import Abort, RoomOutcome

D = "decode-a"


def K(room: int, decode: str = D) -> RoomKey:
    return RoomKey(decode, room)


def abort(ledger: RoomLedger, room: int, gen: int, decode: str = D, now: float = 0.0) -> list[object]:
    ledger.abort(Abort(room, gen, decode, f"tcp://{decode}"), now)
    return list(ledger.try_ack(K(room, decode)))


def acks(actions: list[object]) -> list[tuple[str, int, int]]:
    return [(a.reply_to, a.ack.room, a.ack.generation) for a in actions if isinstance(a, SendAck)]


def test_status_moves_forward_and_success_is_reported() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(K(1))
    assert ledger.status(K(1)) is KVPoll.WAITING_FOR_INPUT
    assert ledger.dequeue(K(1)) is True
    assert ledger.status(K(1)) is KVPoll.TRANSFERRING
    actions = ledger.landed(K(1), last=True)
    assert ledger.status(K(1)) is KVPoll.SUCCESS
    assert [a.status.outcome for a in actions if isinstance(a, NotifyDecode)] == [RoomOutcome.SUCCESS]


def test_chunk_is_counted_at_dequeue_even_when_skipped() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(K(1))
    ledger.fail(K(1), "engine gave up")
    assert ledger.dequeue(K(1)) is False
    assert ledger.outstanding(K(1)) == 1  # counted although it will be skipped
    ledger.skipped(K(1))
    assert ledger.outstanding(K(1)) == 0


def test_abort_of_a_writing_room_acks_only_after_the_chunk_settles() -> None:
    ledger = RoomLedger(rank=3)
    ledger.request(K(1))
    assert ledger.dequeue(K(1))
    assert abort(ledger, 1, gen=5) == []  # the chunk may still land
    assert ledger.status(K(1)) is KVPoll.FAILED  # marked before the target went in
    assert acks(ledger.landed(K(1), last=False)) == [(f"tcp://{D}", 1, 5)]


def test_err_with_unsettled_siblings_poisons_until_the_fence() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(K(1))
    ledger.dequeue(K(1))
    failed = ledger.failed(K(1), settled=False, reason="handle ERR")
    assert [a.status.outcome for a in failed if isinstance(a, NotifyDecode)] == [RoomOutcome.FAILED]
    assert abort(ledger, 1, gen=2) == []
    assert ledger.poisoned() == {K(1)}
    assert acks(ledger.fenced()) == [(f"tcp://{D}", 1, 2)]
    assert ledger.poisoned() == frozenset()


def test_cleared_room_with_counted_work_is_not_acked() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(K(1))
    ledger.dequeue(K(1))
    ledger.clear(K(1))  # the engine concluded while a write is in flight
    assert abort(ledger, 1, gen=1) == []
    assert acks(ledger.landed(K(1), last=True)) == [(f"tcp://{D}", 1, 1)]


def test_unknown_room_gets_a_tombstone_and_later_writes_nothing() -> None:
    ledger = RoomLedger(rank=0, tombstone_ttl=60)
    assert acks(abort(ledger, 9, gen=1)) == [(f"tcp://{D}", 9, 1)]  # safe: the tombstone
    ledger.request(K(9))  # the transfer request arrives late
    assert ledger.status(K(9)) is KVPoll.FAILED
    assert ledger.dequeue(K(9)) is False


def test_tombstone_expires_only_when_idle() -> None:
    ledger = RoomLedger(rank=0, tombstone_ttl=10)
    abort(ledger, 9, gen=1, now=0.0)
    ledger.expire(now=5.0)
    assert ledger.status(K(9)) is KVPoll.FAILED
    ledger.expire(now=11.0)
    assert ledger.status(K(9)) is None


def test_each_generation_is_acked_at_most_once_per_decode() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(K(1))
    assert acks(abort(ledger, 1, gen=1)) == [(f"tcp://{D}", 1, 1)]
    assert abort(ledger, 1, gen=1) == []  # a duplicated ABORT
    assert acks(abort(ledger, 1, gen=2)) == [(f"tcp://{D}", 1, 2)]  # a re-sent one
    # fan-out: another decode endpoint gets its own ack
    assert acks(abort(ledger, 1, gen=1, decode="decode-b")) == [("tcp://decode-b", 1, 1)]


def test_poison_without_a_chunk_holds_the_room() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(K(1))
    ledger.poison(K(1), "a hook raised")
    assert abort(ledger, 1, gen=1) == []
    assert acks(ledger.fenced()) == [(f"tcp://{D}", 1, 1)]


def test_a_chunk_queued_behind_the_last_one_is_skipped() -> None:
    """Decode was told Success and may hand the pages out again: a duplicate
    chunk dequeued afterwards is counted, then skipped, never written."""
    ledger = RoomLedger(rank=0)
    ledger.request(K(1))
    assert ledger.dequeue(K(1)) is True
    ledger.landed(K(1), last=True)
    assert ledger.dequeue(K(1)) is False
    assert ledger.outstanding(K(1)) == 1  # invariant D holds for it too
    assert ledger.skipped(K(1)) == []
    assert ledger.status(K(1)) is KVPoll.SUCCESS and ledger.outstanding(K(1)) == 0


def test_a_concluded_room_id_reused_by_decode_starts_a_new_room() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(K(1))
    ledger.dequeue(K(1))
    ledger.landed(K(1), last=True)
    assert ledger.status(K(1)) is KVPoll.SUCCESS
    ledger.request(K(1))
    assert ledger.status(K(1)) is KVPoll.WAITING_FOR_INPUT
    assert ledger.dequeue(K(1)) is True


def test_one_room_id_for_two_decodes_is_two_rooms() -> None:
    """Prefill TP smaller than decode TP: one rank writes room 1 into two
    decodes. Each decode's room has its own count, abort, ack and status."""
    ledger = RoomLedger(rank=0)
    ledger.request(K(1))
    ledger.request(K(1, "decode-b"))
    assert ledger.dequeue(K(1)) and ledger.dequeue(K(1, "decode-b"))
    assert acks(ledger.landed(K(1, "decode-b"), last=False)) == []
    # decode-a aborts while its own chunk is in flight: decode-b's drained
    # count must not ack it
    assert abort(ledger, 1, gen=4) == []
    assert ledger.status(K(1, "decode-b")) is KVPoll.TRANSFERRING
    assert acks(ledger.landed(K(1), last=False)) == [(f"tcp://{D}", 1, 4)]
    # decode-b's room still completes, and only decode-b hears it
    assert ledger.dequeue(K(1, "decode-b")) is True
    done = ledger.landed(K(1, "decode-b"), last=True)
    assert [(a.decode, a.status.decode, a.status.outcome) for a in done if isinstance(a, NotifyDecode)] == [
        ("decode-b", "decode-b", RoomOutcome.SUCCESS)
    ]
    assert ledger.status(K(1)) is KVPoll.FAILED
    assert set(ledger.decodes_of(1)) == {D, "decode-b"}
