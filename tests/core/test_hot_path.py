"""Issue 42: what runs on every message, chunk and timer does the least it
can, and no less.

* an ABORT with nothing implementing ``on_abort_notification`` is acked in
  its listener's own lock section (no second step after a hook that does
  nothing); with an implementation, the hook still runs first;
* ``Sender.send`` takes the rank's lock once; a chunk the ledger skips is
  never lowered; ``Receiver.poll`` carries nothing out;
* timer work follows what is due, not the rooms: a rank's listener sleeps
  until its ledger's next expiry (none: until a message), decode's ticks
  find the watched ranks and the writers held rooms owe without a walk of
  the rooms, and both match a walk as rooms come and go.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from endpoint_world import aborts, announce, endpoint

from kvconn.config import Config
from kvconn.hookspecs import hookimpl
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import Tick
from kvconn.protocol.ledger import KVPoll, RoomKey, RoomLedger
from kvconn.protocol.messages import Abort, AbortAck, RoomOutcome, RoomStatus
from kvconn.protocol.owner_fence import FenceAsOwner, OwnerFenceDone, OwnerFencePolicy
from kvconn.runtime import rank_actions, transfer
from kvconn.runtime.decode import DecodeEndpoint, Release
from kvconn.runtime.prefill import PrefillRank
from kvconn.runtime.sender import lower as sender_lower
from kvconn.testing.null import NullBackend
from kvconn.testing.waiting import wait_for

WAIT_S = 30.0


class _Rooms:
    """A dict that refuses to be walked."""

    def __init__(self, inner: dict[Any, Any]) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __contains__(self, key: object) -> bool:
        return key in self._inner

    def __getitem__(self, key: Any) -> Any:
        return self._inner[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._inner[key] = value

    def _refuse(self, *args: object) -> None:
        raise AssertionError("walked every room")

    items = values = keys = __iter__ = _refuse


# -- the rank ------------------------------------------------------------------------
def _pair(
    observers: tuple[object, ...] = (),
) -> tuple[PrefillRank, DecodeEndpoint, list[Release]]:
    backend = NullBackend()
    rank = PrefillRank(backend, 0, 64 * 4096, Config(), observers=observers)
    released: list[Release] = []
    decode = DecodeEndpoint(backend, 64, 4096, [rank.address], Config(), on_release=released.append)
    return rank, decode, released


def test_an_abort_with_no_abort_hook_is_acked_in_its_own_lock_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hook call and the second step after it were half the rank's work
    on an abort; with nothing to call they are skipped, and the ack is the
    same."""

    def second_step(self: object, action: object) -> None:
        raise AssertionError("a second step after an abort hook that nothing implements")

    monkeypatch.setattr(rank_actions.RankActions, "_abort_hook", second_step)
    rank, decode, released = _pair()
    try:
        rx = decode.receiver(1, (1, 2))
        wait_for(lambda: rank.sender(1).poll() >= KVPoll.WAITING_FOR_INPUT, WAIT_S, "the request")
        rx.abort()
        wait_for(lambda: bool(released), WAIT_S, "the release")
        assert released[0].proof.value == "acks"
        assert rank.metrics.value("kvconn_acks_sent_total") == 1
    finally:
        decode.close()
        rank.close()


class _SeesAborts:
    def __init__(self) -> None:
        self.seen: list[int] = []

    @hookimpl
    def on_abort_notification(self, abort: Abort, known: bool) -> None:
        self.seen.append(abort.room)


def test_an_abort_hook_that_is_implemented_still_runs_before_the_ack() -> None:
    observer = _SeesAborts()
    rank, decode, released = _pair((observer,))
    try:
        rx = decode.receiver(1, (1, 2))
        wait_for(lambda: rank.sender(1).poll() >= KVPoll.WAITING_FOR_INPUT, WAIT_S, "the request")
        rx.abort()
        wait_for(lambda: bool(released), WAIT_S, "the release")
        assert observer.seen == [1]
    finally:
        decode.close()
        rank.close()


class _CountingLock:
    def __init__(self, inner: threading.Lock) -> None:
        self.inner = inner
        self.by_thread: dict[int, int] = {}

    def __enter__(self) -> bool:
        me = threading.get_ident()
        self.by_thread[me] = self.by_thread.get(me, 0) + 1
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)

    def acquire(self, *args: Any) -> bool:
        return self.inner.acquire(*args)

    def release(self) -> None:
        self.inner.release()


def test_a_send_takes_the_ranks_lock_once_and_a_skipped_chunk_is_never_lowered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lowered: list[int] = []
    real = sender_lower

    def counted(rank: int, chunk: Any, *rest: Any) -> Any:
        lowered.append(chunk.index)
        return real(rank, chunk, *rest)

    monkeypatch.setattr(transfer, "lower", counted)
    rank, decode, released = _pair()
    try:
        rx = decode.receiver(1, (1, 2, 3))
        wait_for(lambda: rank.sender(1).poll() >= KVPoll.WAITING_FOR_INPUT, WAIT_S, "the request")
        sender = rank.sender(1)
        lock = rank._lock = _CountingLock(rank._lock)  # type: ignore[assignment]
        sender.send([1])
        assert lock.by_thread.get(threading.get_ident()) == 1
        wait_for(lambda: lowered == [0], WAIT_S, "the first chunk lowered and written")
        rx.abort()
        wait_for(lambda: bool(released), WAIT_S, "the release")
        sender.send([2])  # the room failed: queued, counted, skipped
        wait_for(lambda: rank.metrics.chunks.counts["skipped"] == 1, WAIT_S, "the second chunk skipped")
        assert lowered == [0]
    finally:
        decode.close()
        rank.close()


def test_a_poll_carries_nothing_out(monkeypatch: pytest.MonkeyPatch) -> None:
    rank, decode, _ = _pair()
    try:
        rx = decode.receiver(1, (1,))

        def step(*args: object) -> None:
            raise AssertionError("poll() went through step()")

        monkeypatch.setattr(decode, "step", step)
        assert rx.poll() is KVPoll.TRANSFERRING
    finally:
        monkeypatch.undo()
        decode.close()
        rank.close()


def test_a_ranks_listener_with_nothing_due_sleeps_until_a_message() -> None:
    """It used to tick every 50 ms whatever was due: now a tick runs only
    when the ledger has something to expire (a room touched, a deadline)."""
    rank, decode, released = _pair()
    ticks: list[float] = []
    real = rank.state.tick

    def tick(now: float) -> list[Any]:
        ticks.append(now)
        return real(now)

    try:
        wait_for(lambda: rank.state.next_wakeup() is None, WAIT_S, "the bootstrap's rooms forgotten")
        rank.state.tick = tick  # type: ignore[method-assign]
        time.sleep(0.3)  # the listener's old period was 50 ms: six ticks
        assert ticks == []
        rx = decode.receiver(1, (1,))  # touches a room: the next expiry is one pace on
        wait_for(lambda: rank.sender(1).poll() >= KVPoll.WAITING_FOR_INPUT, WAIT_S, "the request")
        rx.abort()
        wait_for(lambda: bool(released), WAIT_S, "the release")
        wait_for(lambda: bool(ticks), WAIT_S, "a tick for the acked room to be scheduled")
    finally:
        decode.close()
        rank.close()


# -- the ledger's expiry ----------------------------------------------------------------
def test_the_next_expiry_is_what_is_due_never_sooner_than_a_pace() -> None:
    ledger = RoomLedger(0, tombstone_ttl=10.0)
    pace = RoomLedger.EXPIRE_PACE_S
    assert ledger.next_expiry() is None  # nothing to forget, ever
    ledger.abort(Abort(1, 1, "d", "tcp://d"), now=1.0)  # a compact tombstone, due at 11
    assert ledger.next_expiry() == 11.0
    ledger.try_ack(RoomKey("d", 1))
    ledger.expire(2.0)
    assert ledger.next_expiry() == 11.0
    key = RoomKey("d", 2)
    ledger.request(key, 1, (0,))
    ledger.clear(key)  # touched: scheduled by the next call
    assert ledger.next_expiry() == 2.0 + pace
    ledger.expire(3.0)
    assert ledger.next_expiry() == 11.0
    assert ledger.expire(11.0) == [RoomKey("d", 1)]
    assert ledger.next_expiry() is None


def test_a_backlog_of_expiries_is_taken_one_pace_at_a_time() -> None:
    ledger = RoomLedger(0, tombstone_ttl=1.0, expire_budget=2)
    for room in range(10):
        ledger.abort(Abort(room, 1, "d", "tcp://d"), now=0.0)
        ledger.try_ack(RoomKey("d", room))
    ledger.expire(0.5)  # the tombstones' credit is spent
    forgotten = ledger.expire(5.0)
    assert 0 < len(forgotten) < 10
    assert ledger.next_expiry() == 5.0 + RoomLedger.EXPIRE_PACE_S  # due now, paced


# -- decode -------------------------------------------------------------------------------
def _walk(state: EndpointState) -> tuple[set[int], frozenset[object]]:
    watched = {rank for r in state.requests.values() for rank in r.writers}
    held = [room for room in state.requests if state.tracker.held_since(room) is not None]
    owed = frozenset(w for room in held for w in state.requests[room].writers.values())
    return watched, owed


THREE = (("p0", "p1", "p2"),)


def test_watched_ranks_and_owed_writers_match_a_walk_of_the_rooms() -> None:
    state = endpoint(THREE)
    opened = []
    for room in range(6):
        request, _ = state.open(room, (room,), state.default, frozenset({room % 3}), None, 0.0)  # type: ignore[arg-type]
        opened.append(request)
        assert (state.watched(), state.owed()) == _walk(state)
    sent = []
    for request in opened[:4]:
        sent += aborts(state.abort(request, 1.0))
        assert (state.watched(), state.owed()) == _walk(state)
    for abort in sent[:2]:
        state.handle(AbortAck(abort.room, abort.room % 3, abort.generation, False, "decode", 1), 2.0)
        assert (state.watched(), state.owed()) == _walk(state)
    state.handle(RoomStatus(4, 1, RoomOutcome.SUCCESS, "", "decode", 1), 3.0)
    state.finish(opened[4])
    assert (state.watched(), state.owed()) == _walk(state)
    assert state.watched() == {0, 2} and len(state.owed()) == 2  # rooms 2 and 3 owe ranks 2 and 0


def test_a_heartbeat_and_an_exit_check_do_not_walk_the_rooms() -> None:
    state = endpoint((("p0", "p1"),), num_pages=64, heartbeat_interval_s=1.0)
    requests = []
    for room in range(50):
        request, _ = state.open(room, (room,), state.default, None, None, 0.0)  # type: ignore[arg-type]
        requests.append(request)
    for request in requests[:10]:
        state.abort(request, 0.0)
    state.requests = _Rooms(state.requests)  # type: ignore[assignment]
    state.tracker._holds = _Rooms(state.tracker._holds)  # type: ignore[assignment]
    state.tracker._rooms = _Rooms(state.tracker._rooms)  # type: ignore[assignment]
    probes = state.probes(5.0)
    assert probes.owed and probes.live
    state.handle(Tick(), 5.0)  # the exit check and the heartbeat are due
    assert state.next_wakeup() is not None


def test_decode_has_nothing_to_tick_with_nothing_tracked() -> None:
    state = endpoint((("p0", "p1"),), heartbeat_interval_s=1.0)
    state.handle(Tick(), 0.0)
    assert state.next_wakeup() is None  # no room: no exit check, no heartbeat
    state.open(1, (1,), state.default, None, None, 1.0)  # type: ignore[arg-type]
    assert state.next_wakeup() is not None  # its ranks are watched: a heartbeat is due


def test_a_rank_back_up_owing_no_held_room_is_not_looked_for_in_the_held_rooms() -> None:
    # After an owner fence every rank is down until it answers the new Hello
    # (liveness.back_up on each answer): a rank no held room was asked of
    # re-asks nothing, found by the per-writer count, not a walk of the held
    # rooms; a rank that owes rooms is asked for those at once.
    state = endpoint((("p0", "p1"),), heartbeat_interval_s=1.0, owner_fence=OwnerFencePolicy(5.0, 60.0, True))
    assert state.default is not None
    request, _ = state.open(1, (1,), state.default, None, None, 0.0)
    state.abort(request, 0.0)
    state.handle(Tick(), 30.0)  # quarantined
    assert any(isinstance(a, FenceAsOwner) for a in state.handle(Tick(), 35.0))
    state.handle(OwnerFenceDone(b"new-metadata"), 35.5)
    assert state.down.keys() == {0, 1} and not state.owed()
    announce(state, 1, "p1", 1, 36.0)
    held = []
    for room in range(2, 6):
        request, _ = state.open(room, (room,), state.default, frozenset({1}), None, 36.1)
        held += aborts(state.abort(request, 36.1))
    assert len(held) == 4 and state.down.keys() == {0}
    state._held = _Rooms(state._held)  # type: ignore[assignment]
    state.requests = _Rooms(state.requests)  # type: ignore[assignment]
    state.tracker._holds = _Rooms(state.tracker._holds)  # type: ignore[assignment]
    assert aborts(announce(state, 0, "p0", 1, 36.2)) == []
    assert state.down == {}
