"""Failure detection for open rooms at decode, as stimuli into the endpoint's
state machine (``protocol/endpoint.py``): a transfer deadline, heartbeats and
silence, the same-host exit proof, and the re-bootstrap of a rank restarted
at its address. Every failure is FAILED to the engine and the abort path:
pages come back only with proof, never on a deadline. No clock but ``now``;
the end-to-end runs with real processes are in ``test_liveness_e2e.py``."""

from __future__ import annotations

import pytest
from endpoint_world import HERE, aborts, announce, endpoint, requests, writer

from kvconn.errors import KvconnError, PageError, RequestError, RoomInUseError, UnavailableError
from kvconn.protocol.drops import DropReason
from kvconn.protocol.endpoint_events import (
    CheckDrain,
    Drop,
    RankDown,
    RankRestarted,
    RoomFailed,
    Tick,
    Undrained,
)
from kvconn.protocol.hold import HoldState, HoldTracker, Proof, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import AbortAck, Hello, RoomOutcome, RoomStatus, TcpConnection

FAST = dict(heartbeat_interval_s=1.0, peer_timeout_s=5.0)


def _ack(
    state: object, room: int, generation: int, rank: int = 0, session: int = 1, **kw: object
) -> AbortAck:
    fields = dict(fenced=False, decode="decode", session=session) | kw
    return AbortAck(room, rank, generation, **fields)  # type: ignore[arg-type]


def _releases(actions: list[object]) -> list[Release]:
    return [a for a in actions if isinstance(a, Release)]


# -- transfer deadline ---------------------------------------------------------
def test_a_room_past_its_transfer_deadline_fails_and_is_held_until_proof() -> None:
    state = endpoint(transfer_timeout_s=0.3)
    request, _ = state.open(1, (0, 1, 2), state.default, None, None, now=0.0)  # type: ignore[arg-type]
    assert state.handle(Tick(), 0.29) == [] and request.poll() is KVPoll.TRANSFERRING
    actions = state.handle(Tick(), 0.3)
    assert RoomFailed(1, "deadline") in actions
    assert request.poll() is KVPoll.FAILED and "not complete within 0.3 s" in (request.failure or "")
    # the abort path: held (no rank acked), never freed by the deadline
    [abort] = aborts(actions)
    assert state.hold_state(request) is HoldState.HELD and not _releases(actions)
    assert state.abort(request, 0.4) == []  # the engine's own abort after it is harmless
    with pytest.raises(ValueError, match="aborted"):
        state.finish(request)
    # the rank's ack of the current hold is the proof
    assert _releases(state.handle(_ack(state, 1, abort.generation), 0.5))[0].proof is Proof.ACKS


def test_a_room_that_completes_in_time_is_left_alone() -> None:
    state = endpoint(transfer_timeout_s=0.5)
    done, _ = state.open(1, (0, 1), state.default, None, None, 0.0)  # type: ignore[arg-type]
    state.handle(RoomStatus(1, 0, RoomOutcome.SUCCESS, "", "decode", 1), 0.1)
    assert state.finish(done) == (0, 1)
    later, _ = state.open(2, (2,), state.default, None, None, 0.2)  # type: ignore[arg-type]
    actions = state.handle(Tick(), 0.6)  # room 1's deadline passed unnoticed
    assert [a for a in actions if isinstance(a, RoomFailed)] == []
    assert RoomFailed(2, "deadline") in state.handle(Tick(), 0.7)
    assert later.poll() is KVPoll.FAILED


# -- silence and exits (which ranks heartbeats ask: test_heartbeats.py) -------
def test_open_rooms_of_a_silent_rank_fail_and_its_pages_wait_for_its_proof() -> None:
    state = endpoint(**FAST)
    request, _ = state.open(1, (0, 1, 2, 3), state.default, None, None, 0.0)  # type: ignore[arg-type]
    # first Hello at 1.0 (silent since the bootstrap at 0.0), unanswered for peer_timeout_s
    actions = state.handle(Tick(), 1.0) + state.handle(Tick(), 6.0) + state.handle(Tick(), 7.0)
    silent = RankDown(0, "silent", "no answer to a Hello for 6.0 s")
    assert silent in actions and RoomFailed(1, "rank") in actions
    assert request.poll() is KVPoll.FAILED and "no answer" in (request.failure or "")
    [abort] = aborts(actions)
    quarantine = state.handle(Tick(), 37.0)  # the abort deadline: quarantine, never a release
    assert state.hold_state(request) is HoldState.QUARANTINED and not _releases(quarantine)
    # healed: it answers again, and its late ack (of any generation it was sent) is the proof
    announce(state, 0, "p0", 1, 40.0)
    assert state.down == {}
    [release] = _releases(state.handle(_ack(state, 1, abort.generation), 40.0))
    assert release.proof is Proof.LATE_ACKS and release.quarantined_for == 3.0
    # up again: a new room is not failed at once
    fresh, _ = state.open(2, (0, 1), state.default, None, None, 41.0)  # type: ignore[arg-type]
    assert state.sent(fresh, [], 41.0) == [] and fresh.poll() is KVPoll.TRANSFERRING


def test_a_down_rank_that_answers_again_is_asked_for_its_held_rooms_at_once() -> None:
    # A long partition: the room is quarantined and its ABORTs re-sent ever
    # further apart (1, 2, 4 ... 30 s), and those sent during the cut may have
    # died with a dropped connection. The heal is seen at the first answered
    # Hello: the rank is asked then, not at the next re-send.
    state = endpoint(**FAST)
    request, _ = state.open(1, (0, 1), state.default, None, None, 0.0)  # type: ignore[arg-type]
    other, _ = state.open(2, (2,), state.default, None, None, 0.0)  # type: ignore[arg-type]
    state.abort(request, 0.0)
    for t in range(1, 120):  # heartbeats and re-sends through two minutes of silence
        state.handle(Tick(), float(t))
    assert 0 in state.down and state.hold_state(request) is HoldState.QUARANTINED
    assert other.poll() is KVPoll.FAILED  # failed when the rank went down, and aborted
    # the next re-send is seconds away (next_wakeup also has the heartbeat's
    # and the exit check's times: the tracker's deadline is the re-send's)
    due = state.tracker.next_deadline()
    assert due is not None and due > 120.5
    actions = announce(state, 0, "p0", 1, 120.5)  # healed: it answers a heartbeat
    assert state.down == {}
    sent = aborts(actions)
    assert sorted(a.room for a in sent) == [1, 2]  # every held room it owes, at once
    released = []
    for abort in sent:
        released += _releases(state.handle(_ack(state, abort.room, abort.generation), 120.6))
    assert sorted((r.room, r.proof) for r in released) == [(1, Proof.LATE_ACKS), (2, Proof.LATE_ACKS)]
    # a rank that was never down is not asked again on a heartbeat's answer
    request3, _ = state.open(3, (3,), state.default, None, None, 121.0)  # type: ignore[arg-type]
    state.abort(request3, 121.0)
    assert aborts(announce(state, 0, "p0", 1, 121.1)) == []


def test_a_rank_proven_gone_is_down_and_its_exit_releases_once_its_connections_drained() -> None:
    state = endpoint(**FAST)
    request, _ = state.open(1, (0, 1), state.default, None, None, 0.0)  # type: ignore[arg-type]
    gone = frozenset({writer("p0", 1)})
    assert state.probes(1.0).live == gone  # what the runtime looks up at this heartbeat
    actions = state.handle(Tick(gone=gone, peers_drained=False), 1.0)
    assert RankDown(0, "exited", f"its process (pid {writer('p0', 1).pid}) exited") in actions
    assert request.poll() is KVPoll.FAILED and "exited" in (request.failure or "")
    assert not _releases(actions)  # a dead writer's kernel may still deliver its bytes
    assert state.probes(1.1).owed == gone
    [release] = _releases(state.handle(Tick(gone=gone, peers_drained=True), 1.1))
    assert release.proof is Proof.WRITER_EXIT and release.pages == (0, 1)
    # a room that would be asked of a rank known down is refused: nothing is
    # sent, nothing tracked, its pages never leave the engine
    with pytest.raises(UnavailableError, match=r"rank 0 \(p0\) is down: its process .* exited") as refused:
        state.open(2, (2,), state.default, None, None, 1.2)  # type: ignore[arg-type]
    assert refused.value.cause == "rank_down" and refused.value.room == 2
    assert state.tracker.state(2) is None and state.held_pages() == 0
    assert 2 not in state.requests and not state._in_use


def test_an_exit_proves_only_the_rooms_that_process_was_asked_to_write() -> None:
    tracker = HoldTracker("d", "tcp://d", abort_timeout=30.0)
    tracker.open(1, (0,), frozenset({0}))  # asked of the rank's earlier process
    tracker.open(2, (1,), frozenset({0}))  # asked of the process restarted at its address
    tracker.abort(1, now=0.0)
    tracker.abort(2, now=0.0)
    released = [a for a in tracker.writer_exited(0, now=1.0, rooms=frozenset({1})) if isinstance(a, Release)]
    assert [r.room for r in released] == [1] and released[0].proof is Proof.WRITER_EXIT
    assert tracker.state(2) is HoldState.HELD


# -- restart -------------------------------------------------------------------
def test_a_rank_restarted_at_its_address_is_rebootstrapped_and_owes_nothing_of_the_old_rooms() -> None:
    state = endpoint(**FAST)
    old, _ = state.open(7, (3, 4), state.default, None, None, 0.0)  # type: ignore[arg-type]
    actions = announce(state, 0, "p0", 2, 1.0)  # a new process (session 2) took our Hello
    assert RankRestarted(0, 0, "p0") in actions and state.session_of(0) == 2
    assert old.poll() is KVPoll.FAILED and "restarted" in (old.failure or "")
    [abort] = aborts(actions)
    # the new process's ack for the old room is no proof: it never wrote it
    assert state.handle(_ack(state, 7, abort.generation, session=2), 1.1) == [Drop(DropReason.OTHER_SESSION)]
    assert state.hold_state(old) is HoldState.HELD
    # the new process takes new rooms, named by its session
    new, sent = state.open(8, (5,), state.default, None, None, 1.15)  # type: ignore[arg-type]
    assert [r.session for r in requests(sent)] == [2]
    state.handle(RoomStatus(8, 0, RoomOutcome.SUCCESS, "", "decode", 2), 1.18)
    assert state.finish(new) == (5,)
    # nor is the new process's exit; the earlier one's is
    assert _releases(state.handle(Tick(gone=frozenset({writer("p0", 2)})), 1.2)) == []
    # the earlier process's late answers are no restart
    assert announce(state, 0, "p0", 1, 1.3) == [Drop(DropReason.RETIRED_SESSION)]
    [release] = _releases(state.handle(Tick(gone=frozenset({writer("p0", 1)})), 1.6))
    assert release.room == 7 and release.proof is Proof.WRITER_EXIT


def test_a_status_of_the_earlier_process_for_a_room_of_the_new_one_is_dropped() -> None:
    state = endpoint(**FAST)
    announce(state, 0, "p0", 2, 1.0)
    request, _ = state.open(1, (0,), state.default, None, None, 1.0)  # type: ignore[arg-type]
    stale = RoomStatus(1, 0, RoomOutcome.SUCCESS, "", "decode", 1)
    assert state.handle(stale, 1.1) == [Drop(DropReason.OTHER_SESSION)]
    assert request.poll() is KVPoll.TRANSFERRING


# -- routing -------------------------------------------------------------------
def test_two_instances_get_endpoint_wide_ids_and_their_messages_are_told_apart() -> None:
    state = endpoint([("a0",), ("b0", "b1")], **FAST)
    assert state.ranks == {0, 1, 2} and list(state.instances) == [("a0",), ("b0", "b1")]
    b = state.instances["b0", "b1"]
    on_a, to_a = state.open(1, (0,), state.default, None, None, 0.0)  # type: ignore[arg-type]
    on_b, to_b = state.open(2, (1,), b, None, None, 0.0)
    assert [s.address for s in to_a] == ["a0"] and [(s.address, s.rank) for s in to_b] == [
        ("b0", 1),
        ("b1", 2),
    ]
    # B's rank 0 (endpoint id 1) reports room 2: it names itself rank 0, as its instance numbers it
    state.handle(RoomStatus(2, 0, RoomOutcome.SUCCESS, "", "decode", 1), 0.1)
    state.handle(RoomStatus(2, 1, RoomOutcome.SUCCESS, "", "decode", 1), 0.1)
    assert on_b.poll() is KVPoll.SUCCESS and on_a.poll() is KVPoll.TRANSFERRING
    # A rank of B down fails B's rooms only
    abort_a = aborts(state.abort(on_a, 0.2))
    third, _ = state.open(3, (2,), b, frozenset({1}), None, 0.3)
    actions = state.handle(Tick(gone=frozenset({writer("b1", 1)})), 1.0)
    assert [a for a in actions if isinstance(a, RankDown)] == [
        RankDown(2, "exited", f"its process (pid {writer('b1', 1).pid}) exited")
    ]
    assert third.poll() is KVPoll.FAILED and on_b.poll() is KVPoll.SUCCESS
    # A's ack names rank 0: A's rank 0, by room 1's request
    [release] = _releases(state.handle(_ack(state, 1, abort_a[0].generation), 1.1))
    assert release.room == 1
    with pytest.raises(RequestError, match="ranks of another prefill instance"):
        state.begin_bootstrap(
            ("c0", "b1"),
            Hello("decode", "x", "null", 0, 2, 0, b""),
            1.2,
            timeout_s=1.0,
            resend_interval_s=1.0,
        )


# -- held-back fenced acks -----------------------------------------------------
def test_a_fenced_ack_is_held_back_until_its_connections_drained() -> None:
    state = endpoint()
    request, _ = state.open(1, (0,), state.default, None, None, 0.0)  # type: ignore[arg-type]
    [abort] = aborts(state.abort(request, 0.0))
    closed = (TcpConnection("10.0.0.1", 5000, "10.0.0.2", 6000),)
    ack = _ack(state, 1, abort.generation, fenced=True, closed=closed)
    [check] = state.handle(ack, 0.1)
    assert isinstance(check, CheckDrain) and check.ack.closed == closed
    assert state.handle(Undrained(check.ack, drained=False), 0.1) == []
    assert state.probes(0.2).acks == (check.ack,) and state.hold_state(request) is HoldState.HELD
    assert state.handle(Tick(), 0.2) == []  # nothing drained yet
    [release] = _releases(state.handle(Tick(drained=(check.ack,)), 0.3))
    assert release.proof is Proof.WRITER_FENCE and state.draining == {}


def test_an_already_drained_fenced_ack_counts_at_once_and_a_full_backlog_drops_new_ones() -> None:
    state = endpoint()
    state.MAX_DRAINING = 1
    closed = (TcpConnection("h", 1, "h", 2),)
    checks = []
    for room in (1, 2, 3):
        request, _ = state.open(room, (room,), state.default, None, None, 0.0)  # type: ignore[arg-type]
        [abort] = aborts(state.abort(request, 0.0))
        [check] = state.handle(_ack(state, room, abort.generation, fenced=True, closed=closed), 0.1)
        checks.append(check.ack)  # type: ignore[union-attr]
    assert _releases(state.handle(Undrained(checks[0], drained=True), 0.1))[0].room == 1
    assert state.handle(Undrained(checks[1], drained=False), 0.1) == []
    assert state.handle(Undrained(checks[1], drained=False), 0.1) == []  # the same ack: no new one
    assert state.handle(Undrained(checks[2], drained=False), 0.1) == [Drop(DropReason.DRAIN_BACKLOG_FULL)]
    assert [r.room for r in _releases(state.handle(Tick(drained=tuple(checks[1:])), 0.2))] == [2]
    assert state.tracker.state(3) is HoldState.HELD  # the dropped ack proved nothing


# -- refusals change nothing (issue 31 item 1) -----------------------------------
@pytest.mark.parametrize(
    ("ranks", "slot", "pages", "error"),
    [
        (frozenset(), None, (0, 1), RequestError),
        (frozenset({5}), None, (0, 1), RequestError),
        (None, 3, (0, 1), RequestError),
        (None, None, (0, 1, 99), PageError),
        (None, None, (0, 1, 1), PageError),
    ],
)
def test_a_refused_open_changes_nothing(
    ranks: frozenset[int] | None, slot: int | None, pages: tuple[int, ...], error: type[KvconnError]
) -> None:
    state = endpoint(num_slots=2)
    with pytest.raises(error) as info:
        state.open(1, pages, state.default, ranks, slot, 0.0)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError) and info.value.room == 1
    assert state.requests == {} and state.tracker.state(1) is None
    # the same room id and pages are free for the next request
    _, sent = state.open(1, (0, 1), state.default, None, None, 0.0)  # type: ignore[arg-type]
    assert [r.seq for r in requests(sent)] == [1]  # the refused call numbered nothing


def test_a_room_in_use_or_pages_in_use_are_refused_without_touching_the_holder() -> None:
    state = endpoint()
    holder, _ = state.open(1, (0, 1), state.default, None, None, 0.0)  # type: ignore[arg-type]
    with pytest.raises(RoomInUseError):
        state.open(1, (5,), state.default, None, None, 0.0)  # type: ignore[arg-type]
    with pytest.raises(PageError, match="belong to another room"):
        state.open(2, (1, 2), state.default, None, None, 0.0)  # type: ignore[arg-type]
    assert state.open(3, (2,), state.default, None, None, 0.0)[0].pages == (2,)  # type: ignore[arg-type]
    assert state.requests[1] is holder and state.tracker.state(2) is None


def test_hold_tracker_misuse_raises_kvconn_errors_that_are_value_errors() -> None:
    tracker = HoldTracker("d", "tcp://d", abort_timeout=1.0)
    tracker.open(1, (0,), frozenset({0}))
    for call in (
        lambda: tracker.open(1, (1,), frozenset({0})),
        lambda: tracker.open(2, (1,), frozenset()),
        lambda: tracker.finish(1),
        lambda: tracker.finish(9),
    ):
        with pytest.raises(KvconnError) as info:
            call()
        assert isinstance(info.value, ValueError) and info.value.room in (1, 2, 9)
    assert HERE  # the world's namespace is decode's own: exits are provable there
