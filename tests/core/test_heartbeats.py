"""Which ranks a decode's heartbeat asks, and when it judges one down
(``protocol/liveness.py``): traffic from a rank's current process is
hearing from it; only ranks some tracked room was asked of are Hello'd when
silent, and judged from their first unanswered Hello; a rank down is
Hello'd until it answers. Heartbeats grow with the rooms in flight, not with
the fleet (docs/performance.md, "Fleet scale"). No clock but ``now``."""

from __future__ import annotations

from endpoint_world import aborts, announce, endpoint, sends, writer

from kvconn.protocol.endpoint_events import RankDown, RoomFailed, Tick
from kvconn.protocol.hold import HoldState
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import AbortAck, Hello, RoomOutcome, RoomStatus

FAST = dict(heartbeat_interval_s=1.0, peer_timeout_s=5.0)


def _hellos(actions: list[object]) -> list[str]:
    return [s.address for s in sends(actions, Hello)]


def test_a_rank_with_traffic_is_never_helloed_and_a_silent_one_it_works_with_is() -> None:
    state = endpoint([("p0", "p1")], num_pages=32, **FAST)
    busy = state.instances["p0", "p1"]
    hellos: list[str] = []
    for t in range(1, 12):
        # a room a second on both ranks: rank 0 reports its part, rank 1 never does
        room, _ = state.open(t, (t,), busy, None, None, t - 0.5)
        state.handle(RoomStatus(t, 0, RoomOutcome.SUCCESS, "", "decode", 1), t - 0.4)
        actions = state.handle(Tick(), float(t))
        hellos += _hellos(actions)
        if any(isinstance(a, RankDown) for a in actions):
            break
    assert "p0" not in hellos  # its statuses were its heartbeat
    assert hellos == ["p1"] * 7 and t == 7  # asked from 1.0 on, down past 5 s unanswered
    assert state.down == {1: "no answer to a Hello for 6.0 s"} and room.poll() is KVPoll.FAILED


def test_an_idle_rank_is_not_helloed_looked_up_or_judged() -> None:
    state = endpoint([("p0", "p1")], **FAST)
    gone = frozenset({writer("p1", 1)})  # even its exit: no room depends on it
    for t in range(1, 100):
        assert state.probes(float(t)).live == frozenset()
        assert state.handle(Tick(gone=gone), float(t)) == []
    assert state.down == {}
    # a room on it after 99 s of silence: asked first, not down at once
    request, _ = state.open(1, (0,), state.default, frozenset({0}), None, 99.5)  # type: ignore[arg-type]
    assert state.probes(100.0).live == {writer("p0", 1)}  # p1 still idle
    assert _hellos(state.handle(Tick(), 100.0)) == ["p0"]
    announce(state, 0, "p0", 1, 100.2)  # it answers
    assert state.handle(Tick(), 101.0) == [] and request.poll() is KVPoll.TRANSFERRING


def test_a_watched_rank_is_down_once_its_first_unanswered_hello_is_peer_timeout_old() -> None:
    state = endpoint(**FAST)
    assert state.handle(Tick(), 50.0) == []  # idle for 50 s
    request, _ = state.open(1, (0, 1), state.default, None, None, 50.5)  # type: ignore[arg-type]
    for t in range(51, 57):  # Hello'd each heartbeat, not down before 5 s after the first
        actions = state.handle(Tick(), float(t))
        assert _hellos(actions) == ["p0"] and not any(isinstance(a, RankDown) for a in actions), t
    actions = state.handle(Tick(), 57.0)
    assert RankDown(0, "silent", "no answer to a Hello for 6.0 s") in actions
    assert RoomFailed(1, "rank") in actions and request.poll() is KVPoll.FAILED
    assert aborts(actions) and state.hold_state(request) is HoldState.HELD  # pages wait for proof


def test_a_down_rank_is_helloed_until_it_answers_and_then_comes_back() -> None:
    state = endpoint(**FAST)
    request, _ = state.open(1, (0,), state.default, None, None, 0.0)  # type: ignore[arg-type]
    actions = [a for t in range(1, 8) for a in state.handle(Tick(), float(t))]
    assert state.down and RoomFailed(1, "rank") in actions
    [abort] = aborts(state.handle(Tick(), 40.0))  # quarantined; re-sent ABORT
    # no room open any more, still Hello'd every heartbeat while down
    for t in range(41, 45):
        assert _hellos(state.handle(Tick(), float(t))) == ["p0"]
    # healed: it answers, and is asked at once for the room it still owes
    assert [a.room for a in aborts(announce(state, 0, "p0", 1, 45.5))] == [1] and state.down == {}
    state.handle(AbortAck(1, 0, abort.generation, False, "decode", 1), 45.6)
    assert state.hold_state(request) is None  # its late ack was the proof; nothing watched now
    assert state.handle(Tick(), 46.0) == [] and state.handle(Tick(), 60.0) == []


def test_a_late_message_of_a_retired_process_is_not_hearing_from_the_rank() -> None:
    state = endpoint(**FAST)
    old, _ = state.open(7, (3,), state.default, None, None, 0.0)  # type: ignore[arg-type]
    [abort] = aborts(announce(state, 0, "p0", 2, 0.5))  # restarted: room 7 fails, held
    new, _ = state.open(8, (5,), state.default, None, None, 0.6)  # type: ignore[arg-type]
    downs: list[object] = []
    for t in range(2, 12):  # the new process answered our Hello at 0.5: silent from 1.5 on
        # the earlier process talks on (its ack for its own room counts as proof-keeping,
        # not as the rank's heartbeat); the new one never answers
        state.handle(AbortAck(7, 0, abort.generation, False, "decode", 1), t - 0.5)
        state.handle(RoomStatus(7, 0, RoomOutcome.SUCCESS, "", "decode", 1), t - 0.5)
        actions = state.handle(Tick(), float(t))
        assert _hellos(actions) == ["p0"], t
        downs += [a for a in actions if isinstance(a, RankDown)]
        if downs:
            break
    assert downs == [RankDown(0, "silent", "no answer to a Hello for 6.0 s")] and t == 8
    assert new.poll() is KVPoll.FAILED and old.poll() is KVPoll.FAILED


def test_a_status_of_the_current_process_renews_it_and_answers_its_hello() -> None:
    state = endpoint(num_pages=32, **FAST)
    state.open(1, (0,), state.default, None, None, 0.0)  # type: ignore[arg-type]
    assert _hellos(state.handle(Tick(), 1.0)) == ["p0"]  # asked at 1.0
    for t in range(2, 20):  # never a HelloAck, but a status every second: never down
        state.open(t, (t,), state.default, None, None, t - 0.6)  # type: ignore[arg-type]
        state.handle(RoomStatus(t, 0, RoomOutcome.SUCCESS, "", "decode", 1), t - 0.5)
        actions = state.handle(Tick(), float(t))
        assert _hellos(actions) == [] and state.down == {}, t
