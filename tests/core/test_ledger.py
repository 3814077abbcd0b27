"""The prefill ledger, one stimulus at a time."""

from __future__ import annotations

from kvconn.protocol.ledger import KVPoll, NotifyDecode, RoomLedger, SendAck
from kvconn.protocol.messages import Abort, RoomOutcome

D = "decode-a"


def abort(ledger: RoomLedger, room: int, gen: int, decode: str = D, now: float = 0.0) -> list[object]:
    ledger.abort(Abort(room, gen, decode, f"tcp://{decode}"), now)
    return list(ledger.try_ack(room))


def acks(actions: list[object]) -> list[tuple[str, int, int]]:
    return [(a.reply_to, a.ack.room, a.ack.generation) for a in actions if isinstance(a, SendAck)]


def test_status_moves_forward_and_success_is_reported() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(1, D)
    assert ledger.status(1) is KVPoll.WAITING_FOR_INPUT
    assert ledger.dequeue(1) is True
    assert ledger.status(1) is KVPoll.TRANSFERRING
    actions = ledger.landed(1, last=True)
    assert ledger.status(1) is KVPoll.SUCCESS
    assert [a.status.outcome for a in actions if isinstance(a, NotifyDecode)] == [RoomOutcome.SUCCESS]


def test_chunk_is_counted_at_dequeue_even_when_skipped() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(1, D)
    ledger.fail(1, "engine gave up")
    assert ledger.dequeue(1) is False
    assert ledger.outstanding(1) == 1  # counted although it will be skipped
    ledger.skipped(1)
    assert ledger.outstanding(1) == 0


def test_abort_of_a_writing_room_acks_only_after_the_chunk_settles() -> None:
    ledger = RoomLedger(rank=3)
    ledger.request(1, D)
    assert ledger.dequeue(1)
    assert abort(ledger, 1, gen=5) == []  # the chunk may still land
    assert ledger.status(1) is KVPoll.FAILED  # marked before the target went in
    assert acks(ledger.landed(1, last=False)) == [(f"tcp://{D}", 1, 5)]


def test_err_with_unsettled_siblings_poisons_until_the_fence() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(1, D)
    ledger.dequeue(1)
    failed = ledger.failed(1, settled=False, reason="handle ERR")
    assert [a.status.outcome for a in failed if isinstance(a, NotifyDecode)] == [RoomOutcome.FAILED]
    assert abort(ledger, 1, gen=2) == []
    assert ledger.poisoned() == {1}
    assert acks(ledger.fenced()) == [(f"tcp://{D}", 1, 2)]
    assert ledger.poisoned() == frozenset()


def test_cleared_room_with_counted_work_is_not_acked() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(1, D)
    ledger.dequeue(1)
    ledger.clear(1)  # the engine concluded while a write is in flight
    assert abort(ledger, 1, gen=1) == []
    assert acks(ledger.landed(1, last=True)) == [(f"tcp://{D}", 1, 1)]


def test_unknown_room_gets_a_tombstone_and_later_writes_nothing() -> None:
    ledger = RoomLedger(rank=0, tombstone_ttl=60)
    assert acks(abort(ledger, 9, gen=1)) == [(f"tcp://{D}", 9, 1)]  # safe: the tombstone
    ledger.request(9, D)  # the transfer request arrives late
    assert ledger.status(9) is KVPoll.FAILED
    assert ledger.dequeue(9) is False


def test_tombstone_expires_only_when_idle() -> None:
    ledger = RoomLedger(rank=0, tombstone_ttl=10)
    abort(ledger, 9, gen=1, now=0.0)
    ledger.expire(now=5.0)
    assert ledger.status(9) is KVPoll.FAILED
    ledger.expire(now=11.0)
    assert ledger.status(9) is None


def test_each_generation_is_acked_at_most_once_per_decode() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(1, D)
    assert acks(abort(ledger, 1, gen=1)) == [(f"tcp://{D}", 1, 1)]
    assert abort(ledger, 1, gen=1) == []  # a duplicated ABORT
    assert acks(abort(ledger, 1, gen=2)) == [(f"tcp://{D}", 1, 2)]  # a re-sent one
    # fan-out: another decode endpoint gets its own ack
    assert acks(abort(ledger, 1, gen=1, decode="decode-b")) == [("tcp://decode-b", 1, 1)]


def test_poison_without_a_chunk_holds_the_room() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(1, D)
    ledger.poison(1, "a hook raised")
    assert abort(ledger, 1, gen=1) == []
    assert acks(ledger.fenced()) == [(f"tcp://{D}", 1, 1)]


def test_a_chunk_queued_behind_the_last_one_is_skipped() -> None:
    """Decode was told Success and may hand the pages out again: a duplicate
    chunk dequeued afterwards is counted, then skipped, never written."""
    ledger = RoomLedger(rank=0)
    ledger.request(1, D)
    assert ledger.dequeue(1) is True
    ledger.landed(1, last=True)
    assert ledger.dequeue(1) is False
    assert ledger.outstanding(1) == 1  # invariant D holds for it too
    assert ledger.skipped(1) == []
    assert ledger.status(1) is KVPoll.SUCCESS and ledger.outstanding(1) == 0


def test_a_concluded_room_id_reused_by_decode_starts_a_new_room() -> None:
    ledger = RoomLedger(rank=0)
    ledger.request(1, D)
    ledger.dequeue(1)
    ledger.landed(1, last=True)
    assert ledger.status(1) is KVPoll.SUCCESS
    ledger.request(1, D)
    assert ledger.status(1) is KVPoll.WAITING_FOR_INPUT
    assert ledger.dequeue(1) is True
