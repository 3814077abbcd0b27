"""The owner-fence policy at decode, as stimuli into the endpoint's state
machine (``protocol/owner_fence.py``, ``EndpointState``'s ``OwnerFenceDone``
handler): off by default, only past the configured quarantine age, at most
once per interval, only where the backend can fence as owner, never a
release without the fence's success, every room in flight failed, and every
rank re-bootstrapped under a new name before it is asked again. No clock but
``now``; the run with a real backend is ``test_owner_fence_e2e.py``."""

from __future__ import annotations

import pytest
from endpoint_world import aborts, announce, endpoint, requests, sends

from kvconn.config import Config
from kvconn.errors import UnavailableError
from kvconn.protocol.drops import DropReason
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import Drop, Quarantine, Request, RoomFailed, Tick
from kvconn.protocol.hold import HoldState, Proof, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import AbortAck, Hello, RoomOutcome, RoomStatus
from kvconn.protocol.owner_fence import (
    FenceAsOwner,
    OwnerFenced,
    OwnerFenceDone,
    OwnerFenceError,
    OwnerFencePolicy,
)

ABORT_TIMEOUT = 30.0  #: endpoint_world's tracker deadline: a held room quarantines at abort + 30 s
NEW_MD = b"region-after-the-fence"


def _state(after_s: float | None = 5.0, interval: float = 60.0, capable: bool = True) -> EndpointState:
    policy = OwnerFencePolicy(after_s, interval, capable)
    return endpoint(instances=(("p0", "p1"),), owner_fence=policy)


def _quarantined(state: EndpointState, room: int, pages: tuple[int, ...], at: float) -> Request:
    """``room`` asked of every rank at ``at``, aborted at once, quarantined at ``at + 30``."""
    assert state.default is not None
    request, _ = state.open(room, pages, state.default, None, None, at)
    state.abort(request, at)
    actions = state.handle(Tick(), at + ABORT_TIMEOUT)
    assert Quarantine(room, pages) in actions
    return request


def _fences(actions: list[object]) -> list[FenceAsOwner]:
    return [a for a in actions if isinstance(a, FenceAsOwner)]


def _releases(actions: list[object]) -> list[Release]:
    return [a for a in actions if isinstance(a, Release)]


def test_off_by_default() -> None:
    assert Config().owner_fence_after_s is None and Config().owner_fence_min_interval_s == 60.0
    state = endpoint()
    assert not state.owner_fence.enabled
    assert state.default is not None
    request, _ = state.open(1, (0, 1), state.default, None, None, 0.0)
    state.abort(request, 0.0)
    for now in (30.0, 100.0, 10_000.0):
        assert not _fences(state.handle(Tick(), now))
    assert state.hold_state(request) is HoldState.QUARANTINED and state.held_pages() == 2


def test_a_fence_is_asked_only_once_a_room_is_quarantined_for_the_configured_age() -> None:
    state = _state(after_s=5.0)
    _quarantined(state, 1, (0, 1, 2), at=0.0)  # quarantined at 30
    assert state.next_wakeup() is not None and state.next_wakeup() <= 35.0  # type: ignore[operator]
    assert not _fences(state.handle(Tick(), 34.9))
    [fence] = _fences(state.handle(Tick(), 35.0))
    assert fence == FenceAsOwner((1,), 3)
    # one at a time: none while it runs
    assert not _fences(state.handle(Tick(), 36.0))


def test_only_rooms_past_the_age_are_named_and_open_or_held_ones_do_not_count() -> None:
    state = _state(after_s=5.0)
    _quarantined(state, 1, (0,), at=0.0)  # quarantined at 30
    _quarantined(state, 2, (1, 2), at=3.0)  # at 33
    assert state.default is not None
    state.open(3, (5,), state.default, None, None, 20.0)  # open: never a reason to fence
    [fence] = _fences(state.handle(Tick(), 35.0))
    assert fence.rooms == (1,) and fence.pages == 1


def test_a_fence_needs_the_backends_capability() -> None:
    state = _state(capable=False)
    _quarantined(state, 1, (0, 1), at=0.0)
    assert not state.owner_fence.enabled
    assert not _fences(state.handle(Tick(), 1000.0))
    assert state.held_pages() == 2


def test_no_fence_while_a_bootstrap_is_in_flight() -> None:
    state = _state()
    _quarantined(state, 1, (0,), at=0.0)
    hello = Hello("decode", "tcp://decode", "null", 4096, 1, 30_000, b"")
    other = state.begin_bootstrap(("q0",), hello, 39.0, timeout_s=30.0, resend_interval_s=1.0)
    assert not _fences(state.handle(Tick(), 40.0))
    state.forget_bootstrap(other)
    assert _fences(state.handle(Tick(), 40.1))


def test_fences_are_rate_limited_whatever_their_outcome() -> None:
    state = _state(after_s=5.0, interval=60.0)
    _quarantined(state, 1, (0,), at=0.0)
    assert _fences(state.handle(Tick(), 35.0))
    state.handle(OwnerFenceError("OwnerFenceFailed: agent outlived its last reference"), 35.2)
    assert not _fences(state.handle(Tick(), 94.9))  # 60 s after the last try, not after its end
    assert _fences(state.handle(Tick(), 95.0))
    state.handle(OwnerFenceDone(NEW_MD), 95.3)
    assert state.owner_fence.ok == 1 and state.owner_fence.failed == 1
    for rank, address in enumerate(("p0", "p1")):
        announce(state, rank, address, 1, 99.0)  # re-bootstrapped under the new name
    _quarantined(state, 2, (1,), at=100.0)  # quarantined at 130, old enough at 135
    assert not _fences(state.handle(Tick(), 154.9))
    assert _fences(state.handle(Tick(), 155.0))


def test_a_failed_fence_holds_every_page_and_is_counted() -> None:
    state = _state()
    request = _quarantined(state, 1, (0, 1, 2, 3), at=0.0)
    assert _fences(state.handle(Tick(), 35.0))
    actions = state.handle(OwnerFenceError("OwnerFenceFailed: refused"), 35.5)
    assert actions == [OwnerFenced(False, name="decode", reason="OwnerFenceFailed: refused")]
    assert state.hold_state(request) is HoldState.QUARANTINED and state.held_pages() == 4
    assert state.owner_fence.failed == 1 and not state.owner_fence.running
    assert state.name == "decode"  # the ranks keep the old metadata: nothing changed
    # the pages still come back with a proof of the ordinary kind, a late ack
    generation = max(a.generation for a in aborts(state.handle(Tick(), 37.0)))  # re-sent at 30, 31, 33, 37
    rels = []
    for rank in (0, 1):
        rels += _releases(state.handle(AbortAck(1, rank, generation, False, "decode", 1), 37.5))
    assert [r.proof for r in rels] == [Proof.LATE_ACKS]


def test_the_fence_releases_held_rooms_and_fails_every_room_in_flight() -> None:
    state = _state()
    assert state.default is not None
    quarantined = _quarantined(state, 1, (0, 1), at=0.0)
    in_flight, _ = state.open(2, (2, 3, 4), state.default, None, None, 31.0)
    held, _ = state.open(3, (5,), state.default, None, None, 31.0)
    state.abort(held, 32.0)
    done, _ = state.open(4, (6,), state.default, None, None, 31.0)
    for rank in (0, 1):
        state.handle(RoomStatus(4, rank, RoomOutcome.SUCCESS, "", "decode", 1), 32.0)
    assert done.poll() is KVPoll.SUCCESS
    assert _fences(state.handle(Tick(), 35.0))
    actions = state.handle(OwnerFenceDone(NEW_MD), 35.4)
    rels = {r.room: r for r in _releases(actions)}
    assert sorted(rels) == [1, 2, 3] and {r.proof for r in rels.values()} == {Proof.OWNER_FENCE}
    assert RoomFailed(2, "owner_fence") in actions and RoomFailed(3, "owner_fence") not in actions
    assert in_flight.poll() is KVPoll.FAILED and "owner" in (in_flight.failure or "")
    # the engine's abort of the failed room after it is harmless; its pages came back already
    assert state.abort(in_flight, 36.0) == []
    assert quarantined.poll() is KVPoll.FAILED
    [report] = [a for a in actions if isinstance(a, OwnerFenced)]
    assert report == OwnerFenced(True, rooms=3, pages=6, failed=1, name="decode.f1")
    # a completed room stays the engine's to finish: the fence keeps the memory
    assert state.finish(done) == (6,)
    assert state.held_pages() == 0 and state.owner_fence.ok == 1


def test_every_rank_must_re_bootstrap_under_the_new_name_before_it_is_asked_again() -> None:
    state = _state()
    assert state.default is not None
    _quarantined(state, 1, (0,), at=0.0)
    for rank, address in enumerate(("p0", "p1")):
        announce(state, rank, address, 1, 34.0)  # both answer heartbeats: up
    assert not state.down
    assert _fences(state.handle(Tick(), 35.0))
    actions = state.handle(OwnerFenceDone(NEW_MD), 35.4)
    hellos = sends(actions, Hello)
    assert sorted(s.address for s in hellos) == ["p0", "p1"]
    assert {(s.message.decode, s.message.metadata) for s in hellos} == {("decode.f1", NEW_MD)}  # type: ignore[union-attr]
    assert state.name == "decode.f1" and state.tracker.decode == "decode.f1"
    # until a rank answers, a room that would be asked of it is refused:
    # nothing sent, nothing held (it could only fail)
    with pytest.raises(UnavailableError, match="re-bootstrapping after the owner fence"):
        state.open(2, (1,), state.default, None, None, 35.5)
    assert state.tracker.state(2) is None and state.held_pages() == 0
    # the heartbeats carry the new Hello too, to every rank
    beat = sends(state.handle(Tick(), 40.0), Hello)
    assert {(s.message.decode, s.message.metadata) for s in beat} == {("decode.f1", NEW_MD)}  # type: ignore[union-attr]
    # a late ack under the old name proves nothing now (its room was released anyway)
    late = state.handle(AbortAck(1, 0, 1, False, "decode", 1), 40.1)
    assert late == [Drop(DropReason.OTHER_DECODE)]
    # the ranks answer (same processes, same sessions): asked again, under the new name
    for rank, address in enumerate(("p0", "p1")):
        announce(state, rank, address, 1, 40.2)
    assert not state.down
    fresh, out = state.open(3, (2,), state.default, None, None, 41.0)
    assert state.sent(fresh, [], 41.0) == [] and fresh.poll() is KVPoll.TRANSFERRING
    assert {m.decode for m in requests(out)} == {"decode.f1"}
    for rank in (0, 1):
        state.handle(RoomStatus(3, rank, RoomOutcome.SUCCESS, "", "decode.f1", 1), 41.5)
    assert fresh.poll() is KVPoll.SUCCESS
    # a second fence takes another name again
    _quarantined(state, 4, (5,), at=100.0)
    assert _fences(state.handle(Tick(), 135.0))
    state.handle(OwnerFenceDone(b"third"), 135.2)
    assert state.name == "decode.f2"


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_config_refuses_a_non_positive_age_or_interval(value: float) -> None:
    with pytest.raises(ValueError, match="owner_fence_after_s"):
        Config(owner_fence_after_s=value)
    with pytest.raises(ValueError, match="owner_fence_min_interval_s"):
        Config(owner_fence_min_interval_s=value)


def test_a_fence_that_left_no_endpoint_refuses_requests_and_retries_whether_or_not_a_room_is_held() -> None:
    # issue 40: nixl's fence destroyed the old agent and UCX could not make a
    # new one ("No such device"); the fence was counted failed, nothing tried
    # again (no room stayed quarantined), and every later room failed.
    state = _state()
    assert state.default is not None
    _quarantined(state, 1, (0, 1), at=0.0)
    assert _fences(state.handle(Tick(), 35.0))
    actions = state.handle(OwnerFenceDone(None, "UCX: No such device"), 35.4)
    # it held: the old endpoint is gone, so the pages come back
    assert [(r.room, r.proof) for r in _releases(actions)] == [(1, Proof.OWNER_FENCE)]
    [fenced] = [a for a in actions if isinstance(a, OwnerFenced)]
    assert fenced.ok and not fenced.endpoint and "No such device" in fenced.reason
    assert not sends(actions, Hello)  # no metadata to give a rank
    # meanwhile every request fails fast, with the reason, asking nothing
    with pytest.raises(UnavailableError, match="No such device") as refused:
        state.open(2, (2,), state.default, None, None, 35.5)
    assert refused.value.cause == "endpoint_down" and state.tracker.state(2) is None
    with pytest.raises(UnavailableError, match="no transport endpoint"):
        state.begin_bootstrap(("q0",), state.default.hello, 35.5, timeout_s=5.0, resend_interval_s=1.0)
    # no room is held, yet the endpoint is asked for again: 1, 2, 4, 8 s, then every 10 s
    at = 35.4
    for wait in (1.0, 2.0, 4.0, 8.0, 10.0, 10.0):
        assert state.next_wakeup() == pytest.approx(at + wait)
        before = state.handle(Tick(), at + wait - 0.01)
        assert not _fences(before) and not sends(before, Hello)  # no heartbeat while down
        at += wait
        assert _fences(state.handle(Tick(), at)) == [FenceAsOwner((), 0)]
        state.handle(OwnerFenceDone(None, "UCX: No such device"), at)
    # a retry that raises backs off the same way (never a busy loop)
    assert _fences(state.handle(Tick(), at + 10.0))
    state.handle(OwnerFenceError("RuntimeError: UCX"), at + 10.0)
    assert not _fences(state.handle(Tick(), at + 10.5)) and state.next_wakeup() == pytest.approx(at + 20.0)
    at += 20.0
    # the interface is back: the retry makes the endpoint, and every rank is Hello'd with it
    assert _fences(state.handle(Tick(), at))
    actions = state.handle(OwnerFenceDone(NEW_MD), at)
    assert state.endpoint_down is None
    assert {(s.address, s.message.metadata) for s in sends(actions, Hello)} == {("p0", NEW_MD), ("p1", NEW_MD)}  # type: ignore[union-attr]
    for rank, address in enumerate(("p0", "p1")):
        announce(state, rank, address, 1, at + 0.1)
    request, out = state.open(2, (2,), state.default, None, None, at + 0.2)
    assert len(requests(out)) == 2 and request.poll() is KVPoll.TRANSFERRING
    assert state.next_wakeup() is None or state.next_wakeup() > at + 0.2  # type: ignore[operator]
