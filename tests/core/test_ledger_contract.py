"""What the ledger tells decode, exactly, and how it forgets (issue 25).

Every status names its room, rank, decode and rank session: decode drops a
status naming another decode or session (a restarted peer), so a wrong field
is a room decode waits on forever, or worse, another room's pages handed out.
The tombstone expiry is pinned to its TTL: forgotten too early, a late
transfer request would find no tombstone and write into freed pages.
"""

from __future__ import annotations

from kvconn.protocol.ledger import KVPoll, LedgerAction, NotifyDecode, RoomKey, RoomLedger, SendAck
from kvconn.protocol.messages import Abort, RoomOutcome, RoomStatus

D = "decode-a"
RANK, SESSION, TTL = 3, 99, 10.0


def k(room: int) -> RoomKey:
    """Decode D's room ``room`` (the ledger keys every room by its decode)."""
    return RoomKey(D, room)


def ledger() -> RoomLedger:
    return RoomLedger(rank=RANK, tombstone_ttl=TTL, session=SESSION)


def abort(led: RoomLedger, room: int, gen: int = 1, now: float = 0.0) -> list[LedgerAction]:
    led.abort(Abort(room, gen, D, f"tcp://{D}"), now)
    return led.try_ack(k(room))


def status(room: int, outcome: RoomOutcome, reason: str) -> NotifyDecode:
    return NotifyDecode(D, RoomStatus(room, RANK, outcome, reason, D, SESSION))


def test_success_names_room_rank_decode_and_session() -> None:
    led = ledger()
    led.request(k(5))
    led.dequeue(k(5))
    assert led.landed(k(5), last=True) == [status(5, RoomOutcome.SUCCESS, "")]


def test_each_failure_path_notifies_once_with_its_reason() -> None:
    led = ledger()
    led.request(k(5))
    led.dequeue(k(5))
    assert led.failed(k(5), settled=True, reason="handle error") == [
        status(5, RoomOutcome.FAILED, "handle error")
    ]
    assert led.fail(k(5), "engine gave up") == []  # already failed: decode was told
    led.request(k(6))
    assert led.poison(k(6), "a hook raised") == [status(6, RoomOutcome.FAILED, "a hook raised")]
    led.request(k(7))
    assert led.fail(k(7), "engine gave up") == [status(7, RoomOutcome.FAILED, "engine gave up")]
    led.request(k(8))
    led.dequeue(k(8))
    assert led.failed(k(8), settled=False, reason="stuck") == [status(8, RoomOutcome.FAILED, "stuck")]


def test_an_ack_says_whether_a_fence_proved_it() -> None:
    """The runtime attaches the fence's closed connections only to a fenced
    ack, and decode holds those back until drained: a fence-proven ack that
    claims no fence skips that wait."""
    led = ledger()
    led.request(k(1))
    led.dequeue(k(1))
    led.failed(k(1), settled=False, reason="stuck")
    abort(led, 1)
    [ack] = led.fenced()
    assert isinstance(ack, SendAck) and ack.ack.fenced is True
    assert (ack.ack.room, ack.ack.rank, ack.ack.decode, ack.ack.session) == (1, RANK, D, SESSION)
    led.request(k(2))
    [plain] = abort(led, 2)
    assert isinstance(plain, SendAck) and plain.ack.fenced is False


def test_abort_says_whether_the_room_was_known() -> None:
    led = ledger()
    led.request(k(1))
    assert led.abort(Abort(1, 1, D, "r"), 0.0) is True
    assert led.abort(Abort(2, 1, D, "r"), 0.0) is False  # tombstoned now
    assert led.abort(Abort(2, 2, D, "r"), 0.0) is False  # still only a tombstone


def test_two_chunks_failing_unsettled_are_both_held_until_the_fence() -> None:
    led = ledger()
    led.request(k(1))
    led.dequeue(k(1))
    led.dequeue(k(1))
    led.failed(k(1), settled=False, reason="stuck")
    led.failed(k(1), settled=False, reason="stuck")
    assert abort(led, 1) == []
    assert [type(a) for a in led.fenced()] == [SendAck]
    assert led.outstanding(k(1)) == 0


def test_queries_of_an_unknown_room_are_empty() -> None:
    led = ledger()
    assert (led.status(k(4)), led.outstanding(k(4)), led.in_flight(k(4)), led.decodes_of(4)) == (
        None,
        0,
        0,
        {},
    )
    assert led.incarnation(k(4)) is None
    led.request(k(4))
    assert list(led.decodes_of(4)) == [D] and led.incarnation(k(4)) is not None


def test_fail_keeps_the_count_of_chunks_in_flight() -> None:
    """The engine fails a room with a chunk being written: the ack still
    waits for that chunk (a fail() that made a fresh entry would not)."""
    led = ledger()
    led.request(k(1))
    led.dequeue(k(1))
    led.fail(k(1), "engine gave up")
    assert led.outstanding(k(1)) == 1
    assert abort(led, 1) == []
    assert [type(a) for a in led.landed(k(1), last=True)] == [SendAck]


def test_fail_of_an_unknown_room_fails_a_later_request() -> None:
    led = ledger()
    # the key names its decode, so it is told even before its request came
    assert led.fail(k(4), "engine gave up") == [status(4, RoomOutcome.FAILED, "engine gave up")]
    assert led.status(k(4)) is KVPoll.FAILED
    led.request(k(4))
    assert led.dequeue(k(4)) is False


def test_fail_of_an_incarnation_touches_only_that_incarnation() -> None:
    led = ledger()
    led.request(k(1))
    led.dequeue(k(1))
    led.landed(k(1), last=True)
    old = led.incarnation(k(1))
    led.request(k(1))  # the id reused by decode: a new room
    new = led.incarnation(k(1))
    assert old is not None and new is not None and new != old
    assert led.fail(k(1), "late", incarnation=old) == []
    assert led.status(k(1)) is KVPoll.WAITING_FOR_INPUT
    assert led.fail(k(1), "now", incarnation=new) == [status(1, RoomOutcome.FAILED, "now")]
    assert led.fail(k(9), "gone", incarnation=new) == [] and led.status(k(9)) is None


def test_poison_of_an_unknown_room_holds_it_until_the_fence() -> None:
    led = ledger()
    assert led.poison(k(4), "a hook raised") == [status(4, RoomOutcome.FAILED, "a hook raised")]
    assert led.status(k(4)) is KVPoll.FAILED and led.poisoned() == {k(4)}
    assert abort(led, 4) == []
    assert [type(a) for a in led.fenced()] == [SendAck]


# -- expiry ---------------------------------------------------------------------


def test_a_tombstone_is_forgotten_exactly_at_its_ttl() -> None:
    led = ledger()
    assert [type(a) for a in abort(led, 9, now=5.0)] == [SendAck]
    assert led.expire(now=5.0 + TTL - 0.5) == []
    assert led.expire(now=5.0 + TTL) == [k(9)]
    assert led.status(k(9)) is None


def test_an_acked_cleared_room_is_kept_for_the_ttl_after_it_went_idle() -> None:
    led = ledger()
    led.request(k(1))
    assert [type(a) for a in abort(led, 1)] == [SendAck]
    assert led.expire(now=50.0) == []  # acked but not cleared: the engine still has it
    led.clear(k(1))
    assert led.expire(now=100.0) == []  # idle from now on: TTL starts here
    assert led.expire(now=100.0 + TTL - 0.5) == []
    assert led.status(k(1)) is KVPoll.FAILED  # a duplicated ABORT still finds it acked
    assert led.expire(now=100.0 + TTL) == [k(1)]


def test_a_cleared_room_with_a_chunk_in_flight_is_never_forgotten() -> None:
    """Forgetting a counted room would let a re-sent ABORT find nothing and
    be acked at once, with the chunk still being written."""
    led = ledger()
    led.request(k(1))
    led.dequeue(k(1))
    led.clear(k(1))
    assert abort(led, 1) == []
    assert led.expire(now=0.0) == [] and led.expire(now=10 * TTL) == []
    assert led.outstanding(k(1)) == 1
    assert [type(a) for a in led.landed(k(1), last=False)] == [SendAck]


def test_a_room_busy_again_when_due_is_forgotten_once_idle() -> None:
    led = ledger()
    led.request(k(1))
    abort(led, 1)
    led.clear(k(1))
    led.expire(now=0.0)
    assert led.dequeue(k(1)) is False  # a duplicate chunk: counted, skipped
    assert led.expire(now=TTL) == []  # due, but busy
    led.skipped(k(1))
    assert led.expire(now=TTL + 1) == [k(1)]


def test_expiry_goes_on_past_a_busy_room_and_a_forgotten_one() -> None:
    led = ledger()
    led.request(k(1))
    led.dequeue(k(1))  # room 1 busy
    led.request(k(2))
    led.clear(k(2))  # room 2 drained: forgotten at once, but touched
    abort(led, 3)  # room 3: a tombstone, acked
    assert led.expire(now=0.0) == []
    assert led.expire(now=TTL) == [k(3)]


def test_a_room_is_in_the_expiry_heap_at_most_once() -> None:
    """expire() walks only touched rooms and pushes each room once: a room
    touched again while scheduled (a duplicated ABORT) is not pushed again."""
    led = ledger()
    led.request(k(1))
    abort(led, 1)
    led.clear(k(1))
    led.expire(now=0.0)
    abort(led, 1)  # a duplicated ABORT touches it again
    led.expire(now=1.0)
    assert len(led._expiry) == 1


def test_a_chunk_of_an_unknown_room_is_skipped_and_the_room_forgotten() -> None:
    led = ledger()
    assert led.dequeue(k(4)) is False  # counted, never written
    assert led.outstanding(k(4)) == 1
    assert led.skipped(k(4)) == []
    assert led.status(k(4)) is None  # nothing left of it


def test_a_late_clear_of_an_earlier_incarnation_leaves_the_new_room_alone() -> None:
    led = ledger()
    led.clear(k(4))  # unknown: nothing to do
    assert led.status(k(4)) is None
    led.request(k(1))
    led.dequeue(k(1))
    led.landed(k(1), last=True)
    old = led.incarnation(k(1))
    led.request(k(1))
    led.clear(k(1), incarnation=old)
    assert led.dequeue(k(1)) is True  # the new request is still written


def test_a_try_of_an_unknown_room_acks_nothing() -> None:
    assert ledger().try_ack(k(4)) == []


# -- a room id reused by its decode, and a request the engine gave up on --------


def _failed_and_acked(led: RoomLedger, room: int, seq: int) -> None:
    led.request(k(room), seq)
    led.dequeue(k(room))
    led.failed(k(room), settled=True, reason="handle error")
    assert [type(a) for a in abort(led, room)] == [SendAck]


def test_an_acked_failed_room_is_taken_anew_only_by_a_newer_request() -> None:
    """Decode released the pages on the ack, then reused the id: a newer
    request is a new room and is written; the same request replayed (or an
    older one) finds the room Failed and writes nothing."""
    led = ledger()
    _failed_and_acked(led, 1, seq=5)
    led.request(k(1), 5)  # replayed
    assert led.status(k(1)) is KVPoll.FAILED and led.dequeue(k(1)) is False
    led.skipped(k(1))
    led.request(k(1), 6)
    assert led.status(k(1)) is KVPoll.WAITING_FOR_INPUT and led.dequeue(k(1)) is True


def test_a_tombstone_is_never_taken_anew_while_it_lasts() -> None:
    """The ABORT came before the request (a tombstone, acked at once); the
    late request arrives, then another: both find the room Failed. A
    tombstone stands for a request not yet seen, which may be any of them."""
    led = ledger()
    assert [type(a) for a in abort(led, 1)] == [SendAck]
    led.request(k(1), 5)
    led.request(k(1), 6)
    assert led.status(k(1)) is KVPoll.FAILED and led.dequeue(k(1)) is False


def test_an_entry_is_the_rooms_current_one() -> None:
    led = ledger()
    assert led.entry(k(1)) is None
    led.request(k(1), 1)
    entry = led.entry(k(1))
    assert entry is not None and entry.status is KVPoll.WAITING_FOR_INPUT
    assert entry.incarnation == led.incarnation(k(1))


def test_give_up_leaves_a_failed_tombstone_for_the_late_request() -> None:
    """The engine stopped waiting for decode's request: the request, arriving
    later, writes nothing, and the tombstone is forgotten exactly at its TTL.
    Another decode's room of the same id is untouched."""
    led = ledger()
    assert led.give_up(k(4), now=5.0) is True
    assert led.status(k(4)) is KVPoll.FAILED and led.status(RoomKey("decode-b", 4)) is None
    assert led.expire(now=5.0 + TTL - 0.5) == []
    led.request(k(4), 3)
    assert led.dequeue(k(4)) is False
    led.skipped(k(4))
    assert led.expire(now=5.0 + TTL) == [k(4)]
    assert led.status(k(4)) is None


def test_give_up_of_a_room_whose_request_came_changes_nothing() -> None:
    led = ledger()
    led.request(k(4), 1)
    assert led.give_up(k(4), now=0.0) is False
    assert led.status(k(4)) is KVPoll.WAITING_FOR_INPUT and led.dequeue(k(4)) is True
    assert led.expire(now=10 * TTL) == []


def test_a_given_up_room_untouched_since_is_forgotten_at_its_ttl() -> None:
    led = ledger()
    led.give_up(k(4), now=5.0)
    assert led.expire(now=5.0 + TTL) == [k(4)]


def test_a_given_up_room_is_never_taken_anew_while_it_lasts() -> None:
    """Given up, then aborted by decode (acked at once: nothing was written),
    then the late request and a newer one: both find the room Failed."""
    led = ledger()
    led.give_up(k(4), now=0.0)
    assert [type(a) for a in abort(led, 4)] == [SendAck]
    led.request(k(4), 5)
    led.request(k(4), 6)
    assert led.status(k(4)) is KVPoll.FAILED and led.dequeue(k(4)) is False


def test_clear_fails_a_live_room_and_tells_decode_why() -> None:
    led = ledger()
    led.request(k(1), 1)
    assert led.clear(k(1)) == [
        status(1, RoomOutcome.FAILED, "cleared by the prefill engine before its last chunk")
    ]
    led.request(k(2), 2)
    led.dequeue(k(2))
    led.landed(k(2), last=True)
    assert led.clear(k(2)) == []  # concluded: nothing to tell, and it stays a success
    assert led.status(k(2)) in (KVPoll.SUCCESS, None)


def test_decodes_of_a_room_id_are_their_entries_until_each_is_forgotten() -> None:
    led = ledger()
    other = RoomKey("decode-b", 4)
    led.request(k(4), 1)
    led.request(other, 1)
    assert led.decodes_of(4) == {D: led.entry(k(4)), "decode-b": led.entry(other)}
    led.clear(k(4))  # D's room drained: forgotten, decode-b's stays
    assert led.decodes_of(4) == {"decode-b": led.entry(other)}
    led.clear(other)
    assert led.decodes_of(4) == {}
