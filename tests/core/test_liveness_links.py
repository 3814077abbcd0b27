"""Liveness with the control link's own heartbeat (``protocol/liveness.py``,
issue 40 findings 3 and 4), on the state machine alone, no clock but ``now``:

* load is not silence: a watched rank that leaves Hellos unanswered while
  its link is up (its process runs: only its Python is slow) is not down
  until ``peer_hung_timeout_s``; with its link lost (stopped, gone, cut
  off) it is down at ``peer_timeout_s`` as before;
* whoever answers at a rank's address is asked first: a request to a rank
  whose link was lost since it last spoke is not sent blind; the answer
  sends it (to a restarted process, if that is who answered), and a rank
  judged down fails it with nothing sent (its pages back at once).
"""

from __future__ import annotations

import pytest
from endpoint_world import aborts, announce, endpoint, requests, sends, writer

from kvconn.protocol.drain import DrainingError
from kvconn.protocol.endpoint_events import (
    LinksChanged,
    RankDown,
    RankRestarted,
    Release,
    Tick,
)
from kvconn.protocol.hold import HoldState, Proof
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import AbortAck, Hello, RankDraining, RoomOutcome, RoomStatus

FAST = dict(heartbeat_interval_s=1.0, peer_timeout_s=5.0, peer_hung_timeout_s=30.0)


def _hellos(actions: list[object]) -> list[str]:
    return [s.address for s in sends(actions, Hello)]


def _downs(actions: list[object]) -> list[RankDown]:
    return [a for a in actions if isinstance(a, RankDown)]


def _releases(actions: list[object]) -> list[Release]:
    return [a for a in actions if isinstance(a, Release)]


def _link(address: str, up: bool) -> LinksChanged:
    return LinksChanged(((address, up),))


# -- load is not silence -----------------------------------------------------------
def test_a_watched_rank_slow_to_answer_with_its_link_up_is_not_down_until_the_hung_timeout() -> None:
    state = endpoint(**FAST)
    state.handle(_link("p0", True), 0.0)
    request, _ = state.open(1, (0, 1), state.default, None, None, 0.5)  # type: ignore[arg-type]
    downs = []
    for t in range(1, 31):  # Hello'd each heartbeat, unanswered for 29 s: its Python starved
        actions = state.handle(Tick(), float(t))
        downs += _downs(actions)
        assert _hellos(actions) == ["p0"], t
    assert downs == [] and request.poll() is KVPoll.TRANSFERRING and state.down == {}
    # past peer_hung_timeout_s with no answer: its kvconn threads are taken for hung
    actions = state.handle(Tick(), 32.0)
    assert _downs(actions) == [RankDown(0, "hung", _downs(actions)[0].reason)]
    assert "its link up" in _downs(actions)[0].reason
    assert request.poll() is KVPoll.FAILED and state.hold_state(request) is HoldState.HELD


def test_an_answer_after_a_long_stall_keeps_the_rank_up_and_its_room_goes_on() -> None:
    state = endpoint(**FAST)
    state.handle(_link("p0", True), 0.0)
    request, _ = state.open(1, (0, 1), state.default, None, None, 0.5)  # type: ignore[arg-type]
    for t in range(1, 20):
        assert _downs(state.handle(Tick(), float(t))) == []
    assert announce(state, 0, "p0", 1, 19.5) == []  # the stall is over
    state.handle(RoomStatus(1, 0, RoomOutcome.SUCCESS, "", "decode", 1), 19.6)
    assert request.poll() is KVPoll.SUCCESS and state.finish(request) == (0, 1)


def test_a_rank_whose_link_is_lost_is_down_at_the_peer_timeout_as_without_links() -> None:
    state = endpoint(**FAST)
    state.handle(_link("p0", True), 0.0)
    request, _ = state.open(1, (0, 1), state.default, None, None, 0.5)  # type: ignore[arg-type]
    state.handle(_link("p0", False), 2.5)  # stopped: its heartbeat unanswered
    actions = [a for t in range(1, 8) for a in state.handle(Tick(), float(t))]
    assert _downs(actions) == [RankDown(0, "silent", "no answer to a Hello for 6.0 s")]
    assert request.poll() is KVPoll.FAILED and aborts(actions)


def test_without_link_reports_a_silent_rank_is_down_at_the_peer_timeout() -> None:
    state = endpoint(**FAST)  # the runtime reports no link: the Hello rule alone
    request, _ = state.open(1, (0, 1), state.default, None, None, 0.5)  # type: ignore[arg-type]
    actions = [a for t in range(1, 8) for a in state.handle(Tick(), float(t))]
    assert _downs(actions) == [RankDown(0, "silent", "no answer to a Hello for 6.0 s")]
    assert request.poll() is KVPoll.FAILED


def test_a_link_lost_and_back_hellos_the_rank_at_once_even_idle() -> None:
    state = endpoint(**FAST)
    assert state.handle(_link("p0", True), 0.0) == []  # first handshake: nothing to ask
    assert state.handle(_link("p0", False), 10.0) == []
    assert _hellos(state.handle(_link("p0", True), 10.2)) == ["p0"]  # who is there now?
    # a new process answers: its restart is known before any room is asked of it
    assert RankRestarted(0, 0, "p0") in announce(state, 0, "p0", 2, 10.3)
    _, sent = state.open(1, (0,), state.default, None, None, 11.0)  # type: ignore[arg-type]
    assert [r.session for r in requests(sent)] == [2]


# -- whoever is there now is asked first -------------------------------------------
def test_a_request_to_a_rank_whose_link_was_lost_waits_for_its_answer_then_goes_to_it() -> None:
    state = endpoint(**FAST)
    state.handle(_link("p0", True), 0.0)
    state.handle(_link("p0", False), 5.0)
    request, sent = state.open(1, (0, 1), state.default, None, None, 5.1)  # type: ignore[arg-type]
    assert requests(sent) == [] and _hellos(sent) == ["p0"]  # nothing sent blind
    assert request.poll() is KVPoll.TRANSFERRING
    state.handle(_link("p0", True), 5.2)  # partition healed: the same process
    actions = announce(state, 0, "p0", 1, 5.3)
    [transfer] = requests(actions)
    assert (transfer.room, transfer.session, transfer.dst_pages) == (1, 1, (0, 1))
    assert not request.unsent


def test_the_first_request_after_a_restart_at_the_same_address_goes_to_the_new_process() -> None:
    state = endpoint(**FAST)
    state.handle(_link("p0", True), 0.0)
    # the rank restarts: its connection closes, the new process's opens
    old, _ = state.open(7, (3,), state.default, None, None, 1.0)  # type: ignore[arg-type]
    state.handle(LinksChanged((("p0", False), ("p0", True))), 2.0)
    request, sent = state.open(1, (0, 1), state.default, None, None, 2.05)  # type: ignore[arg-type]
    assert requests(sent) == []
    # the old process is proven gone before the new one's answer: only what it was sent fails
    gone = frozenset({writer("p0", 1)})
    actions = state.handle(Tick(gone=gone), 2.1)
    assert _downs(actions) == [] and old.poll() is KVPoll.FAILED
    assert request.poll() is KVPoll.TRANSFERRING
    actions = announce(state, 0, "p0", 2, 2.2)
    assert RankRestarted(0, 0, "p0") in actions
    [transfer] = requests(actions)
    assert transfer.room == 1 and transfer.session == 2  # asked of the process that answered
    assert request.writers[0] == writer("p0", 2)
    state.handle(RoomStatus(1, 0, RoomOutcome.SUCCESS, "", "decode", 2), 2.3)
    assert request.poll() is KVPoll.SUCCESS and state.finish(request) == (0, 1)


def test_a_waiting_request_fails_with_nothing_sent_when_the_rank_is_down_and_its_pages_come_back() -> None:
    state = endpoint(**FAST)
    state.handle(_link("p0", True), 0.0)
    state.handle(_link("p0", False), 1.0)  # killed, and nothing answers there
    request, _ = state.open(1, (0, 1), state.default, None, None, 1.0)  # type: ignore[arg-type]
    actions = [a for t in range(2, 8) for a in state.handle(Tick(), float(t))]
    assert [d.cause for d in _downs(actions)] == ["silent"]
    assert request.poll() is KVPoll.FAILED and "nothing was sent" in (request.failure or "")
    [release] = _releases(actions)  # never sent: no writer can reach the pages
    assert release.proof is Proof.NOTHING_SENT and release.pages == (0, 1)
    assert aborts(actions) == [] and state.held_pages() == 0


def test_an_aborted_waiting_request_is_released_at_once_and_never_sent() -> None:
    state = endpoint([("p0", "p1")], **FAST)
    state.handle(LinksChanged((("p0", True), ("p1", True), ("p1", False))), 0.0)
    request, sent = state.open(1, (0, 1), state.default, None, None, 0.5)  # type: ignore[arg-type]
    assert [r.session for r in requests(sent)] == [1] and _hellos(sent) == ["p1"]
    [abort] = aborts(state.abort(request, 0.6))  # only p0 was asked: only p0 owes a proof
    assert state.hold_state(request) is HoldState.HELD
    assert requests(announce(state, 1, "p1", 1, 0.7)) == []  # p1 answers: nothing goes out now
    [release] = _releases(state.handle(AbortAck(1, 0, abort.generation, False, "decode", 1), 0.8))
    assert release.proof is Proof.ACKS


def test_unavailable_names_ranks_down_or_with_their_link_lost() -> None:
    state = endpoint([("p0", "p1")], **FAST)
    assert state.unavailable(("p0", "p1")) == [] and state.unavailable(("x",)) == []
    state.handle(_link("p1", False), 0.0)
    assert state.unavailable(("p0", "p1")) == ["rank 1's control link (p1) is lost"]
    state.handle(_link("p1", True), 0.1)
    assert state.unavailable(("p0", "p1")) == []


def test_a_rank_that_drained_and_restarted_at_its_address_is_asked_not_refused() -> None:
    """A drained rank's announcement refuses its later requests while that
    process is the rank's; once its link was lost, whoever answers there is
    asked first (before, an idle drained rank was never Hello'd again, and
    every request to its address was refused for good)."""
    state = endpoint(**FAST)
    state.handle(_link("p0", True), 0.0)
    state.handle(RankDraining(0, 1, "decode", True), 1.0)
    with pytest.raises(DrainingError):
        state.open(1, (0,), state.default, None, None, 1.1)  # type: ignore[arg-type]
    state.handle(LinksChanged((("p0", False), ("p0", True))), 2.0)  # stopped, and started again
    request, sent = state.open(1, (0,), state.default, None, None, 2.1)  # type: ignore[arg-type]
    assert requests(sent) == [] and _hellos(sent) == ["p0"]
    [transfer] = requests(announce(state, 0, "p0", 2, 2.2))
    assert transfer.session == 2 and request.poll() is KVPoll.TRANSFERRING


def test_a_lost_link_brings_the_heartbeat_and_its_exit_check_forward() -> None:
    """A killed rank's link is lost at once (its kernel closes the
    connection): its exit is looked up at the next tick, not up to a
    heartbeat interval later, so its rooms fail and their pages come back
    sooner (issue 40: capacity back within a second of the proof)."""
    state = endpoint(**FAST)
    state.handle(_link("p0", True), 0.0)
    request, _ = state.open(1, (0, 1), state.default, None, None, 0.1)  # type: ignore[arg-type]
    state.handle(Tick(), 1.0)  # the heartbeat of t=1: the next is due at 2.0
    gone = frozenset({writer("p0", 1)})
    assert state.probes(1.2).live == frozenset()  # not a heartbeat yet: no process looked up
    state.handle(_link("p0", False), 1.2)  # killed
    assert state.probes(1.25).live == gone  # looked up at the next tick
    actions = state.handle(Tick(gone=gone), 1.25)
    assert [d.cause for d in _downs(actions)] == ["exited"] and request.poll() is KVPoll.FAILED
