"""``HoldTracker`` answers hold questions (pages per state, held rooms, the
next deadline) from an index of the rooms not OPEN and per-state page counts,
not by walking every open room. Hypothesis drives it through random stimuli
over a few rooms and checks every answer against a walk of all rooms."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvconn.protocol.hold import HoldState, HoldTracker, SendAbort
from kvconn.protocol.messages import AbortAck

ROOMS = st.integers(0, 4)
RANKS = frozenset({0, 1})


class IndexMatchesWalk(RuleBasedStateMachine):
    @initialize(unsafe=st.booleans())
    def start(self, unsafe: bool) -> None:
        self.tracker = HoldTracker("d", "tcp://d", abort_timeout=5.0, unsafe_release_at_deadline=unsafe)
        self.now = 0.0
        self.sent: list[SendAbort] = []

    @rule(room=ROOMS, npages=st.integers(1, 4))
    def open(self, room: int, npages: int) -> None:
        if self.tracker.state(room) is None:
            self.tracker.open(room, tuple(range(room * 10, room * 10 + npages)), RANKS)

    @rule(room=ROOMS, rank=st.sampled_from(sorted(RANKS)))
    def succeeded(self, room: int, rank: int) -> None:
        if self.tracker.succeeded(room, rank) and self.tracker.state(room) is HoldState.OPEN:
            self.tracker.finish(room)

    @rule(room=ROOMS)
    def abort(self, room: int) -> None:
        self.sent += [a for a in self.tracker.abort(room, self.now) if isinstance(a, SendAbort)]

    @rule(pick=st.integers(0, 1000), fenced=st.booleans())
    def ack(self, pick: int, fenced: bool) -> None:
        if self.sent:
            s = self.sent[pick % len(self.sent)]
            self.tracker.ack(AbortAck(s.abort.room, s.rank, s.abort.generation, fenced), self.now)

    @rule(rank=st.sampled_from(sorted(RANKS)))
    def writer_exited(self, rank: int) -> None:
        self.tracker.writer_exited(rank, self.now)

    @rule(dt=st.sampled_from([0.0, 1.0, 5.0, 30.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.sent += [a for a in self.tracker.tick(self.now) if isinstance(a, SendAbort)]

    @invariant()
    def answers_match_a_walk(self) -> None:
        if not hasattr(self, "tracker"):
            return
        rooms = self.tracker._rooms
        for state in HoldState:
            assert self.tracker.pages_in(state) == sum(
                len(e.pages) for e in rooms.values() if e.state is state
            )
            assert sorted(self.tracker.rooms_in(state)) == sorted(
                r for r, e in rooms.items() if e.state is state
            )
        held = [e for e in rooms.values() if e.state is not HoldState.OPEN]
        deadlines = [e.deadline if e.state is HoldState.HELD else e.resend_at for e in held]
        assert self.tracker.next_deadline() == min(deadlines, default=None)
        since = [e.quarantined_at for e in held if e.state is HoldState.QUARANTINED]
        assert self.tracker.oldest_quarantine(self.now) == (max(0.0, self.now - min(since)) if since else 0.0)


IndexMatchesWalk.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestIndexMatchesWalk = IndexMatchesWalk.TestCase


class _NoWalk(dict[int, object]):
    """A dict that refuses to be walked: only looked up by key."""

    def _refuse(self, *args: object) -> None:
        raise AssertionError("walked every hold")

    items = values = keys = __iter__ = _refuse  # type: ignore[assignment]


def test_tick_and_next_deadline_look_up_only_the_holds_that_are_due() -> None:
    """They run after every control message: in an abort storm a walk of
    every hold made each ack cost O(holds). A due hold still quarantines
    and re-sends, the others are not looked at."""
    tracker = HoldTracker("d", "tcp://d", abort_timeout=5.0, resend_interval=1.0)
    for room in range(200):
        tracker.open(room, (room,), RANKS)
        tracker.abort(room, now=float(room))  # room r's deadline: r + 5
    tracker._holds = _NoWalk(tracker._holds)  # type: ignore[assignment]
    assert tracker.next_deadline() == 5.0
    assert tracker.tick(4.0) == []
    actions = tracker.tick(5.5)  # only room 0 is due
    assert [a.room for a in actions if not isinstance(a, SendAbort)] == [0]
    assert {a.abort.room for a in actions if isinstance(a, SendAbort)} == {0}
    assert tracker.state(0) is HoldState.QUARANTINED and tracker.state(1) is HoldState.HELD
    assert tracker.next_deadline() == 6.0  # room 1's deadline, then room 0's re-send at 6.5
    tracker.tick(6.5)
    assert tracker.next_deadline() == 7.0
