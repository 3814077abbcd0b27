"""Decode's hold tracker: its queries and multi-room stimuli, exactly (issue 25).

The runtime sizes its waits from ``next_deadline``, exports pages per state
and checks exits for the ranks of held rooms: a wrong answer there stalls a
release or checks the wrong writer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from kvconn.protocol.hold import HoldState, HoldTracker, Proof, Release, SendAbort
from kvconn.protocol.messages import AbortAck


def tracker() -> HoldTracker:
    return HoldTracker("decode", "tcp://decode", abort_timeout=10.0, resend_interval=1.0)


def generation(actions: Sequence[object]) -> int:
    [gen] = {a.abort.generation for a in actions if isinstance(a, SendAbort)}
    return gen


def test_next_deadline_of_a_quarantined_room_is_its_next_resend() -> None:
    t = tracker()
    t.open(1, (0,), frozenset({0}))
    t.abort(1, now=0.0)
    t.tick(now=10.0)  # quarantined, first re-send now, the next one a second later
    assert t.state(1) is HoldState.QUARANTINED
    assert t.next_deadline() == 11.0


def test_success_counts_only_ranks_of_the_room() -> None:
    t = tracker()
    assert t.succeeded(1, 0) is False  # not tracked
    t.open(1, (0,), frozenset({0, 1}))
    assert t.succeeded(1, 5) is False  # a stranger
    assert t.succeeded(1, 0) is False
    with pytest.raises(ValueError, match="not completed"):
        t.finish(1)
    assert t.succeeded(1, 1) is True
    assert t.finish(1) == (0,) and t.state(1) is None and t.pages_in(HoldState.OPEN) == 0


def test_a_writer_exit_releases_every_room_it_alone_held() -> None:
    t = tracker()
    t.open(1, (1,), frozenset({0}))  # rank 1 does not write room 1
    t.open(2, (2,), frozenset({0, 1}))
    t.open(3, (3,), frozenset({1}))
    t.abort(1, now=0.0)
    gen = generation(t.abort(2, now=0.0))
    t.abort(3, now=0.0)
    t.ack(AbortAck(2, 1, gen, False), now=0.5)  # rank 1 proven for room 2 already
    released = t.writer_exited(1, now=1.0)
    assert [(r.room, r.proof) for r in released if isinstance(r, Release)] == [(3, Proof.WRITER_EXIT)]
    assert t.state(1) is HoldState.HELD and t.state(2) is HoldState.HELD


def test_hold_queries_answer_per_room_and_state() -> None:
    t = tracker()
    t.open(1, (1, 2), frozenset({0, 1}))
    t.open(2, (3,), frozenset({0}))
    assert t.ranks_of(1) == {0, 1} and t.ranks_of(9) == frozenset()
    assert t.rooms_in(HoldState.OPEN) == [1, 2] and t.rooms_in(HoldState.HELD) == []
    assert t.held_since(1) is None
    t.abort(1, now=2.0)
    assert t.held_since(1) == 2.0 and t.held_since(2) is None
    assert t.rooms_in(HoldState.HELD) == [1] and t.rooms_in(HoldState.OPEN) == [2]
    assert (t.pages_in(HoldState.OPEN), t.pages_in(HoldState.HELD)) == (1, 2)
    assert t.oldest_quarantine(now=5.0) == 0.0
    t.tick(now=12.0)
    assert t.rooms_in(HoldState.QUARANTINED) == [1] and t.pages_in(HoldState.QUARANTINED) == 2
    assert t.oldest_quarantine(now=15.5) == 3.5
    assert t.held_since(1) == 2.0
    t.abort(2, now=20.0)
    t.tick(now=30.0)
    assert t.oldest_quarantine(now=31.0) == 19.0  # the longest-waiting one
    assert t.oldest_quarantine(now=11.0) == 0.0  # never negative


def test_a_release_reports_how_long_the_pages_were_held_and_quarantined() -> None:
    t = tracker()
    t.open(1, (0, 1), frozenset({0}))
    gen = generation(t.abort(1, now=2.0))
    [release] = t.ack(AbortAck(1, 0, gen, False), now=3.5)
    assert isinstance(release, Release)
    assert (release.held_for, release.quarantined_for) == (1.5, 0.0)
    assert t.pages_in(HoldState.HELD) == 0 and t.pages_in(HoldState.OPEN) == 0
    t.open(2, (0, 1), frozenset({0}))
    t.succeeded(2, 0)
    [done] = t.abort(2, now=9.0)  # completed: released at once, never held
    assert isinstance(done, Release) and done.proof is Proof.COMPLETED
    assert (done.held_for, done.quarantined_for) == (0.0, 0.0)
    assert t.pages_in(HoldState.OPEN) == 0


def test_quarantine_names_the_room_and_its_pages() -> None:
    t = tracker()
    t.open(4, (7, 8), frozenset({0}))
    t.abort(4, now=0.0)
    quarantines = [a for a in t.tick(now=10.0) if not isinstance(a, SendAbort)]
    assert [(q.room, q.pages) for q in quarantines] == [(4, (7, 8))]  # type: ignore[union-attr]


def test_quarantined_aborts_are_resent_with_doubling_intervals_up_to_the_cap() -> None:
    t = HoldTracker(
        "decode", "tcp://decode", abort_timeout=10.0, resend_interval=1.0, max_resend_interval=3.0
    )
    t.open(1, (0,), frozenset({0}))
    t.abort(1, now=0.0)
    resent = []
    for step in range(100, 200):  # every 0.1 s from 10.0 to 19.9
        now = step / 10
        if any(isinstance(a, SendAbort) for a in t.tick(now)):
            resent.append(now)
    assert resent == [10.0, 11.0, 13.0, 16.0, 19.0]  # intervals 1, 2, then capped at 3


def test_the_unsafe_legacy_mode_frees_every_room_past_its_deadline() -> None:
    t = HoldTracker("decode", "tcp://decode", abort_timeout=10.0, unsafe_release_at_deadline=True)
    for room in (1, 2):
        t.open(room, (room,), frozenset({0}))
        t.abort(room, now=0.0)
    released = t.tick(now=10.0)
    assert [(r.room, r.proof) for r in released if isinstance(r, Release)] == [
        (1, Proof.UNSAFE_TIMEOUT),
        (2, Proof.UNSAFE_TIMEOUT),
    ]


def test_pages_per_state_add_up_over_rooms() -> None:
    t = tracker()
    t.open(1, (1, 2), frozenset({0}))
    t.open(2, (3, 4, 5), frozenset({0}))
    assert t.pages_in(HoldState.OPEN) == 5
    t.abort(1, now=0.0)
    t.abort(2, now=0.0)
    assert (t.pages_in(HoldState.OPEN), t.pages_in(HoldState.HELD)) == (0, 5)


def test_abort_of_an_unknown_or_held_room_changes_nothing() -> None:
    t = tracker()
    assert t.abort(9, now=0.0) == []
    t.open(1, (0,), frozenset({0}))
    assert len(t.abort(1, now=0.0)) == 1
    assert t.abort(1, now=5.0) == []  # the engine aborting again: no new generation
    assert t.next_deadline() == 10.0  # nor a later deadline


def test_every_dropped_ack_carries_the_ack_for_the_log() -> None:
    t = tracker()
    t.open(1, (0,), frozenset({0}))
    gen = generation(t.abort(1, now=0.0))
    t.open(2, (0,), frozenset({0}))
    bogus = [
        AbortAck(2, 0, gen, False),  # not held
        AbortAck(1, 5, gen, False),  # stranger
        AbortAck(1, 0, gen + 9, False),  # stale
    ]
    for ack in bogus:
        [drop] = t.ack(ack, now=0.0)
        assert drop.ack == ack  # type: ignore[union-attr]
    t2 = tracker()
    t2.open(1, (0,), frozenset({0, 1}))
    gen = generation(t2.abort(1, now=0.0))
    first = AbortAck(1, 0, gen, False)
    t2.ack(first, now=0.0)
    [dup] = t2.ack(first, now=0.0)
    assert dup.ack == first  # type: ignore[union-attr]


def test_a_room_is_opened_once_and_with_a_writer() -> None:
    t = tracker()
    t.open(1, (0,), frozenset({0}))
    with pytest.raises(ValueError, match=r"^room 1 is still tracked \(open\)$"):
        t.open(1, (0,), frozenset({0}))
    with pytest.raises(ValueError, match=r"^a room needs at least one writing rank$"):
        t.open(2, (0,), frozenset())


def test_default_resends_back_off_to_thirty_seconds() -> None:
    t = HoldTracker("decode", "tcp://decode", abort_timeout=10.0)
    t.open(1, (0,), frozenset({0}))
    t.abort(1, now=0.0)
    resent = [now for now in range(10, 200) if any(isinstance(a, SendAbort) for a in t.tick(float(now)))]
    assert [b - a for a, b in itertools.pairwise(resent)] == [1, 2, 4, 8, 16, 30, 30, 30, 30, 30]


def test_a_writers_exit_proves_nothing_for_rooms_it_does_not_write() -> None:
    """Rank 1's exit releases its own room; room 1, written by rank 0 only,
    stays held and, once acked, names the ack as its proof, not an exit."""
    t = tracker()
    t.open(1, (0,), frozenset({0}))
    t.open(2, (1,), frozenset({1}))
    gen1, _ = generation(t.abort(1, now=0.0)), t.abort(2, now=0.0)
    [release] = t.writer_exited(1, now=0.0)
    assert isinstance(release, Release) and (release.room, release.proof) == (2, Proof.WRITER_EXIT)
    assert t.writer_exited(1, now=0.0, rooms={1}) == [] and t.state(1) is HoldState.HELD
    [acked] = [a for a in t.ack(AbortAck(1, 0, gen1, False, "decode"), now=0.0) if isinstance(a, Release)]
    assert (acked.room, acked.proof) == (1, Proof.ACKS)
