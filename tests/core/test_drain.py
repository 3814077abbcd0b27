"""Draining an instance, stimulus by stimulus (protocol/drain.py): a prefill
rank's RankState and a decode's EndpointState, no threads, no clock but
``now``."""

from __future__ import annotations

import pytest
from endpoint_world import aborts, announce, bootstrap, endpoint, requests

from kvconn.errors import ArgumentError
from kvconn.protocol import drain
from kvconn.protocol.drain import Announce, DrainingError
from kvconn.protocol.drops import DropReason
from kvconn.protocol.endpoint_events import Drop
from kvconn.protocol.hold import HoldState, Proof, Release
from kvconn.protocol.ledger import KVPoll, NotifyDecode, RoomKey, RoomLedger
from kvconn.protocol.messages import (
    AbortAck,
    RankDraining,
    RoomOutcome,
    RoomStatus,
    TcpConnection,
    TransferRequest,
)
from kvconn.protocol.rank import Action, Pairing, RankState

SESSION = 77
A, B = "decode-a", "decode-b"


def _rank() -> RankState[str]:
    state: RankState[str] = RankState(RoomLedger(0, 60.0, SESSION), bootstrap_timeout=None)
    state.add_peer(A, "tcp://a", Pairing("layout-a", source_pages=64))
    state.add_peer(B, "tcp://b", Pairing("layout-b", source_pages=64))
    return state


def _request(state: RankState[str], decode: str, room: int, seq: int, now: float = 0.0) -> list[Action]:
    return state.handle(TransferRequest(room, decode, (room * 2, room * 2 + 1), SESSION, seq), now)


def _statuses(actions: list[Action]) -> list[tuple[str, int, RoomOutcome, str]]:
    return [
        (a.decode, a.status.room, a.status.outcome, a.status.reason)
        for a in actions
        if isinstance(a, NotifyDecode)
    ]


# -- prefill -------------------------------------------------------------------
def test_a_draining_rank_refuses_new_requests_at_once_and_tells_every_decode() -> None:
    state = _rank()
    _request(state, A, 1, seq=1)
    actions = state.begin_drain(0.0, grace_s=5.0)
    assert [a for a in actions if isinstance(a, Announce)] == [Announce(A, False), Announce(B, False)]
    assert state.begin_drain(0.1, grace_s=5.0) == []  # a second call changes nothing
    refused = _request(state, B, 2, seq=1, now=0.2)
    assert _statuses(refused) == [(B, 2, RoomOutcome.FAILED, drain.REFUSED)]
    assert state.ledger.status(RoomKey(B, 2)) is KVPoll.FAILED
    # a room id reused for a new request is refused too, never a live entry
    state.ledger.clear(RoomKey(A, 1))
    assert _statuses(_request(state, A, 1, seq=2, now=0.3)) == [(A, 1, RoomOutcome.FAILED, drain.REFUSED)]
    assert state.ledger.unsettled_keys() == []


def test_a_sender_of_a_refused_room_fails_with_the_drain_reason_and_writes_nothing() -> None:
    state = _rank()
    state.begin_drain(0.0, grace_s=5.0)
    waiting = state.open_sender(3, 1, 0.0)  # no request yet: none will be taken
    verdict, _ = state.verdict(waiting, 0.1)
    assert verdict is not None and not verdict.ok and verdict.reason == drain.REFUSED
    _request(state, A, 4, seq=1)
    s = state.open_sender(4, 1, 0.2)
    verdict, _ = state.verdict(s, 0.2)
    assert verdict is not None and verdict.reason == drain.REFUSED and verdict.settled


def test_held_rooms_get_the_grace_then_fail_and_drained_waits_for_every_write_in_flight() -> None:
    state = _rank()
    _request(state, A, 1, seq=1)
    _request(state, A, 2, seq=2)
    s1, s2 = state.open_sender(1, 1, 0.0), state.open_sender(2, 1, 0.0)
    state.begin_drain(0.0, grace_s=1.0)
    # room 1 completes within the grace
    polled, _ = state.poll(s1, 0.1)
    plan = state.plan_send(s1, range(2), True, polled)
    state.commit_send(s1, plan)
    assert state.ledger.dequeue(RoomKey(A, 1), plan.legs[0].incarnation)
    assert state.drain_tick(0.2) == (False, [])
    landed = state.ledger.landed(RoomKey(A, 1), last=True)
    assert _statuses(landed) == [(A, 1, RoomOutcome.SUCCESS, "")]
    # room 2 has a chunk in flight when the grace runs out: failed, not drained
    polled, _ = state.poll(s2, 0.3)
    plan = state.plan_send(s2, range(1), False, polled)
    state.commit_send(s2, plan)
    assert state.ledger.dequeue(RoomKey(A, 2), plan.legs[0].incarnation)
    drained, actions = state.drain_tick(1.0)
    assert not drained and _statuses(actions) == [(A, 2, RoomOutcome.FAILED, drain.GRACE_OVER)]
    assert state.drain_tick(1.1) == (False, [])  # the write may still land
    state.ledger.failed(RoomKey(A, 2), settled=False, reason="stuck")  # unsettled: poisoned
    assert state.drain_tick(1.2) == (False, [])
    state.ledger.fenced()  # the fence proves it: nothing can land
    drained, actions = state.drain_tick(1.3)
    assert drained and actions == [Announce(A, True), Announce(B, True)]
    assert state.drain_tick(1.4) == (True, [])


def test_a_rank_with_nothing_held_drains_at_once() -> None:
    state = _rank()
    actions = state.begin_drain(0.0, grace_s=30.0)
    assert actions == [Announce(A, False), Announce(B, False), Announce(A, True), Announce(B, True)]


def test_a_negative_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="grace"):
        _rank().begin_drain(0.0, grace_s=-1.0)


# -- decode --------------------------------------------------------------------
def _draining(done: bool, session: int = 1, closed: tuple[TcpConnection, ...] = ()) -> RankDraining:
    return RankDraining(0, session, "decode", done, closed)


def test_a_drain_notice_makes_decode_refuse_that_instance_and_the_refusal_is_typed() -> None:
    state = endpoint([("p0",)])
    bootstrap(state, ["q0"], session=5)  # sessions are random per process: q0's is another
    p, q = state.instances[("p0",)], state.instances[("q0",)]
    assert state.handle(_draining(False), 0.0) == []
    with pytest.raises(DrainingError, match="draining"):
        state.open(1, (0,), p, None, None, 0.1)
    assert state.tracker.state(1) is None  # a refused open changes nothing
    _, sent = state.open(1, (0,), q, None, None, 0.2)  # the other instance takes it
    assert requests(sent)
    # a restarted process at that address is not draining
    announce(state, 0, "p0", 2, 0.3)
    assert state.session_of(0, ("p0",)) == 2
    state.open(2, (1,), p, None, None, 0.4)


def test_a_notice_of_another_decode_or_session_is_dropped() -> None:
    state = endpoint()
    assert state.handle(RankDraining(0, 1, "other", True), 0.0) == [Drop(DropReason.OTHER_DECODE)]
    assert state.handle(_draining(True, session=9), 0.0) == [Drop(DropReason.OTHER_SESSION)]
    assert state.leaving == {}


def test_done_proves_every_room_of_that_process_without_waiting_for_acks() -> None:
    state = endpoint([("p0", "p1")])
    inst = state.default
    assert inst is not None
    refused, _ = state.open(1, (0, 1), inst, None, None, 0.0)
    held, _ = state.open(2, (2,), inst, frozenset({0}), None, 0.0)
    complete, _ = state.open(3, (3,), inst, None, None, 0.0)
    open_, _ = state.open(4, (4,), inst, frozenset({0}), None, 0.0)
    both, _ = state.open(5, (5,), inst, None, None, 0.0)
    state.handle(RoomStatus(1, 0, RoomOutcome.FAILED, drain.REFUSED, "decode", 1), 0.1)
    assert refused.failure in drain.DRAIN_REASONS
    state.abort(held, 0.1)
    for rank in (0, 1):
        state.handle(RoomStatus(3, rank, RoomOutcome.SUCCESS, "", "decode", 1), 0.1)
    actions = state.handle(_draining(True), 0.2)
    released = {a.room: a.proof for a in actions if isinstance(a, Release)}
    # rank 0 was each of these rooms' only writer: back by the drain's proof
    assert released == {2: Proof.WRITER_DRAINED, 4: Proof.WRITER_DRAINED}
    assert open_.poll() is KVPoll.FAILED and open_.failure == drain.RANK_DRAINED
    # rank 1 still owes rooms 1 and 5 (aborted now, its ack is their proof)
    assert state.hold_state(refused) is HoldState.HELD and state.hold_state(both) is HoldState.HELD
    assert {a.room for a in aborts(actions)} >= {1, 5}
    # a complete room stays the engine's to finish
    assert state.finish(complete) == (3,)
    generation = next(a.generation for a in aborts(actions) if a.room == 5)
    ack = AbortAck(5, 1, generation, False, "decode", 1)
    # the release names the strongest claim it rests on: rank 0's drain
    assert [r.proof for r in state.handle(ack, 0.3) if isinstance(r, Release)] == [Proof.WRITER_DRAINED]


def test_done_with_fence_closed_connections_proves_nothing_by_itself() -> None:
    state = endpoint()
    assert state.default is not None
    request, _ = state.open(1, (0,), state.default, None, None, 0.0)
    state.abort(request, 0.1)
    conn = TcpConnection("10.0.0.1", 1, "10.0.0.2", 2)
    assert state.handle(_draining(True, closed=(conn,)), 0.2) == []
    assert state.hold_state(request) is HoldState.HELD


def test_a_draining_decode_refuses_new_rooms_then_aborts_what_the_engine_left() -> None:
    state = endpoint()
    inst = state.default
    assert inst is not None
    _done, _ = state.open(1, (0,), inst, None, None, 0.0)
    left, _ = state.open(2, (1,), inst, None, None, 0.0)
    assert state.begin_drain(0.0, grace_s=0.2, settle_s=1.0) == []
    with pytest.raises(DrainingError, match="decode endpoint is draining"):
        state.open(3, (2,), inst, None, None, 0.1)
    state.handle(RoomStatus(1, 0, RoomOutcome.SUCCESS, "", "decode", 1), 0.1)
    assert drain.decode_left(state) == (2, 2)
    assert state.drain_tick(0.19) == (None, [])  # the engine's grace: nothing aborted yet
    report, actions = state.drain_tick(0.2)
    assert report is None
    # the completed room the engine did not take comes back at once; the
    # other is held until its rank's proof
    assert [(a.room, a.proof) for a in actions if isinstance(a, Release)] == [(1, Proof.COMPLETED)]
    assert left.failure == drain.DECODE_DRAINING and state.hold_state(left) is HoldState.HELD
    assert drain.decode_left(state) == (1, 1)
    assert state.drain_tick(0.3) == (None, [])  # nothing aborted twice
    [abort] = aborts(actions)
    state.handle(AbortAck(2, 0, abort.generation, False, "decode", 1), 0.3)
    assert drain.decode_left(state) == (0, 0)
    assert state.drain_tick(0.4) == (drain.DrainReport(True, 0.4, 0, 0), [])


def test_a_decode_drain_reports_what_is_left_once_its_settle_time_after_the_grace_is_up() -> None:
    state = endpoint()
    assert state.default is not None
    request, _ = state.open(1, (0, 1), state.default, None, None, 0.0)
    state.begin_drain(1.0, grace_s=0.5, settle_s=2.0)
    assert state.drain_tick(1.4)[0] is None
    report, actions = state.drain_tick(1.6)  # the grace is over at 1.5: aborted at this tick
    assert report is None and aborts(actions) and request.aborted
    assert state.drain_tick(3.59)[0] is None  # 2 s from the tick that aborted
    # no proof came: the pages stay held, and the report says so
    assert state.drain_tick(3.6)[0] == drain.DrainReport(False, 2.6, 1, 2)
    assert state.hold_state(request) is HoldState.HELD


def test_a_decode_drain_with_nothing_tracked_reports_at_once_and_a_second_call_waits_anew() -> None:
    state = endpoint()
    assert state.default is not None
    state.begin_drain(0.0, grace_s=5.0, settle_s=5.0)
    assert state.drain_tick(0.0) == (drain.DrainReport(True, 0.0, 0, 0), [])
    state.begin_drain(7.0, grace_s=5.0, settle_s=5.0)  # still refusing; a new wait
    assert state.drain_tick(7.5) == (drain.DrainReport(True, 0.5, 0, 0), [])
    with pytest.raises(DrainingError):
        state.open(1, (0,), state.default, None, None, 8.0)


def test_a_decode_drain_waits_on_its_callers_clock_and_holds_on_the_endpoints() -> None:
    state = endpoint()
    assert state.default is not None
    request, _ = state.open(1, (0,), state.default, None, None, 500.0)
    state.begin_drain(500.0, grace_s=0.5, settle_s=1.0, at=3.0)
    assert state.drain_tick(500.0, at=3.4) == (None, [])  # the endpoint's clock stands still
    report, actions = state.drain_tick(500.0, at=3.5)
    assert report is None and aborts(actions) and request.aborted and state.tracker.held_since(1) == 500.0
    assert state.drain_tick(500.0, at=4.5)[0] == drain.DrainReport(False, 1.5, 1, 1)


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_negative_grace_is_refused_on_both_sides_typed(side: str) -> None:
    with pytest.raises(ArgumentError, match="grace") as info:
        if side == "decode":
            endpoint().begin_drain(0.0, grace_s=-0.1, settle_s=1.0)
        else:
            _rank().begin_drain(0.0, grace_s=-0.1)
    assert isinstance(info.value, ValueError)  # what the rank raised before


def test_a_ranks_drain_reports_after_grace_write_deadline_and_settle_time_by_default() -> None:
    assert drain.rank_report_after(2.0, 5.0) == 2.0 + 5.0 + drain.SETTLE_S
    assert drain.rank_report_after(2.0, 5.0, timeout_s=0.5) == 0.5
    state = _rank()
    _request(state, A, 1, seq=1)
    state.open_sender(1, 1, 0.0)
    drain.begin_rank_drain(state, 0.0, 1.0, report_after_s=3.0)
    assert state.drain is not None
    assert state.drain.report(2.9, rooms_left=1) is None
    assert state.drain.report(3.0, rooms_left=1) == drain.DrainReport(False, 3.0, 1)


def test_a_ranks_drain_report_is_the_cores_wait_and_a_second_drain_starts_its_own() -> None:
    # PrefillRank.drain() waits on RankState.drain_report: the report comes
    # from the core at the wait begin_drain was given, not from a runtime limit.
    state = _rank()
    _request(state, A, 1, seq=1)
    s = state.open_sender(1, 1, 0.0)
    state.begin_drain(0.0, grace_s=1.0, report_after_s=3.0)
    polled, _ = state.poll(s, 0.1)
    plan = state.plan_send(s, range(1), False, polled)
    state.commit_send(s, plan)
    assert state.ledger.dequeue(RoomKey(A, 1), plan.legs[0].incarnation)  # a write in flight
    report, actions = state.drain_report(1.0)
    assert report is None and _statuses(actions) == [(A, 1, RoomOutcome.FAILED, drain.GRACE_OVER)]
    assert state.drain_report(2.9) == (None, [])
    report, _ = state.drain_report(3.0)
    assert report == drain.DrainReport(False, 3.0, 1)
    # the engine's close drains again: same grace, a wait of its own from now
    assert state.begin_drain(5.0, grace_s=30.0, report_after_s=0.5) == []
    assert state.drain_report(5.25)[0] is None
    assert state.drain_report(5.5)[0] == drain.DrainReport(False, 0.5, 1)
    state.ledger.failed(RoomKey(A, 1), settled=True, reason="gone")
    assert state.drain_report(5.75)[0] == drain.DrainReport(True, 0.75, 0)


# -- cases the mutation run found unchecked ------------------------------------
def test_a_request_sent_again_while_draining_keeps_a_live_room_and_repeats_a_refusal() -> None:
    state = _rank()
    _request(state, A, 1, seq=1)
    state.begin_drain(0.0, grace_s=5.0)
    # the room the rank already had, asked for again: it may still finish
    assert _request(state, A, 1, seq=2, now=0.1) == []
    assert state.ledger.status(RoomKey(A, 1)) is not KVPoll.FAILED
    # a refused request sent again is told again, to the decode that sent it
    first = _statuses(_request(state, B, 2, seq=1, now=0.2))
    assert first == [(B, 2, RoomOutcome.FAILED, drain.REFUSED)]
    assert _statuses(_request(state, B, 2, seq=2, now=0.3)) == first


def test_the_grace_fails_every_live_room_of_every_decode_not_only_the_last() -> None:
    state = _rank()
    for decode, room, seq in ((A, 1, 1), (A, 2, 2), (B, 3, 1)):
        _request(state, decode, room, seq=seq)
    state.begin_drain(0.0, grace_s=1.0)
    assert state.drain_tick(0.5) == (False, [])
    _, actions = state.drain_tick(1.0)
    failed = [(A, 1), (A, 2), (B, 3)]
    assert sorted(_statuses(actions)) == [(d, r, RoomOutcome.FAILED, drain.GRACE_OVER) for d, r in failed]
    assert all(state.ledger.status(RoomKey(d, r)) is KVPoll.FAILED for d, r in failed)


def test_a_draining_decodes_refusal_names_the_room() -> None:
    state = endpoint([("p0",)])
    inst = state.instances[("p0",)]
    state.handle(_draining(False), 0.0)
    with pytest.raises(DrainingError) as refused:
        state.open(7, (0,), inst, None, None, 0.1)
    assert refused.value.room == 7
    state.begin_drain(0.2, grace_s=1.0, settle_s=1.0)
    with pytest.raises(DrainingError) as refused:
        state.open(8, (1,), inst, None, None, 0.3)
    assert refused.value.room == 8


def test_a_decode_drain_aborts_every_room_left_past_finished_and_aborted_ones() -> None:
    state = endpoint()
    inst = state.default
    assert inst is not None
    finished, _ = state.open(1, (0,), inst, None, None, 0.0)
    aborted, _ = state.open(2, (1,), inst, None, None, 0.0)
    left, _ = state.open(3, (2,), inst, None, None, 0.0)
    other, _ = state.open(4, (3,), inst, None, None, 0.0)
    state.handle(RoomStatus(1, 0, RoomOutcome.SUCCESS, "", "decode", 1), 0.0)
    assert state.finish(finished) == (0,)
    state.abort(aborted, 0.0)
    state.begin_drain(0.0, grace_s=0.1, settle_s=1.0)
    _, actions = state.drain_tick(0.1)
    assert sorted(a.room for a in aborts(actions)) == [3, 4]
    assert left.failure == other.failure == drain.DECODE_DRAINING


def test_a_ranks_done_proves_its_own_rooms_held_or_quarantined_and_none_of_another_ranks() -> None:
    state = endpoint([("p0", "p1")])
    inst = state.default
    assert inst is not None
    others_open, _ = state.open(1, (1,), inst, frozenset({1}), None, 0.0)
    others_aborted, _ = state.open(2, (2,), inst, frozenset({1}), None, 0.0)
    stuck, _ = state.open(3, (3,), inst, frozenset({0}), None, 0.0)
    mine, _ = state.open(4, (4,), inst, frozenset({0}), None, 0.0)
    state.abort(others_aborted, 0.0)
    state.abort(stuck, 0.0)
    state.carry(state.tracker.tick(31.0))  # past the abort timeout: no ack came
    assert state.hold_state(stuck) is state.hold_state(others_aborted) is HoldState.QUARANTINED
    actions = state.handle(_draining(True), 31.0)
    released = {a.room: a.proof for a in actions if isinstance(a, Release)}
    assert released == {3: Proof.WRITER_DRAINED, 4: Proof.WRITER_DRAINED}
    assert mine.failure == drain.RANK_DRAINED
    # rank 1 said nothing: its rooms are as they were
    assert not others_open.aborted and others_open.poll() is not KVPoll.FAILED
    assert state.hold_state(others_aborted) is HoldState.QUARANTINED


def test_a_restarted_ranks_done_proves_nothing_its_earlier_process_was_asked() -> None:
    state = endpoint()
    assert state.default is not None
    earlier, _ = state.open(1, (1,), state.default, None, None, 0.0)
    state.abort(earlier, 0.0)
    announce(state, 0, "p0", 2, 0.1)  # a new process at rank 0's address
    later, _ = state.open(2, (2,), state.default, None, None, 0.2)
    actions = state.handle(_draining(True, session=2), 0.3)
    assert [a.room for a in actions if isinstance(a, Release)] == [2]
    assert later.failure == drain.RANK_DRAINED
    assert state.hold_state(earlier) is HoldState.HELD  # its own process's proof is owed
