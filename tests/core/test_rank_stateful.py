"""Hypothesis drives the real RankState (and its ledger) through random runs
of a bigger world than the rank explorer covers exhaustively: two decodes
that request, abort and reuse a room id, two senders, two-chunk requests, a
replayed request, chunks that land, are skipped, fail settled, end
unsettled or with a raising hook, fences that succeed or fail, the engine's
fail, clear and fail_room, ticks past the bootstrap deadline and the TTL,
and a drain.

The world (``explore_rank.py``) raises on R1-R5 as each action is carried
out (no ack while a write can land, none into pages decode took back, no
settled sender with a chunk being written, no drain announced early, fenced
acks naming the closed connections). After every step this checks the
ledger's own invariants:

* D: every chunk being written or that may land late is counted on its
  room (a room never holds fewer counted chunks than can still land);
* F: a room with an ack target is Failed (the target is registered only
  after the room is marked so);
* a poisoned room holds a stuck chunk, and stuck chunks are counted ones.
"""

from __future__ import annotations

from collections import Counter

import explore_rank as er
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvconn.protocol.ledger import KVPoll

WORLD = er.Config(
    decodes=2,
    uses=2,
    npages=2,
    senders=2,
    replays=1,
    errors=1,
    fail=True,
    fail_room=True,
    drain=True,
    unsettled=2,
    fence_fails=True,
)


def _weight(label: str, rare: bool) -> int:
    """How many tickets a step gets in the draw. What ends or fails the room
    for good (a drain, fail_room, a sender's fail or clear, time past the
    deadlines) only when ``rare``, and the chunk path most: drawn evenly,
    nearly every run fails its room before a chunk is written."""
    if label in ("engine:drain", "engine:fail_room", "tick") or label.endswith((":fail", ":clear")):
        return int(rare)
    if label.startswith("replay:"):
        return int(rare)
    return 6 if label.startswith(("worker:", "writer:", "deliver:", "limbo:")) else 1


class RankMachine(RuleBasedStateMachine):
    world: er.World

    @initialize()
    def start(self) -> None:
        self.world = er.initial(WORLD)

    @rule(pick=st.integers(min_value=0, max_value=10_000), rare=st.integers(min_value=0, max_value=9))
    def step(self, pick: int, rare: int) -> None:
        enabled = [
            mutate for label, mutate in er.steps(self.world, WORLD) for _ in range(_weight(label, rare == 0))
        ]
        if enabled:
            enabled[pick % len(enabled)](self.world)  # raises er.Violation on R1-R5

    @invariant()
    def every_chunk_that_can_land_is_counted(self) -> None:  # D
        w = self.world
        landing = Counter(c.key for c in ([w.writing] if w.writing else []) + w.limbo)
        entries = w.state.ledger.entries()
        for key, n in landing.items():
            assert key in entries and entries[key].outstanding >= n, (key, n, entries.get(key))

    @invariant()
    def ack_targets_only_on_failed_rooms(self) -> None:  # F
        for key, entry in self.world.state.ledger.entries().items():
            assert not entry.targets or entry.status is KVPoll.FAILED, (key, entry)

    @invariant()
    def poison_is_counted(self) -> None:
        entries = self.world.state.ledger.entries()
        for key in self.world.state.ledger.poisoned():
            assert 0 < entries[key].stuck <= entries[key].outstanding, (key, entries[key])
        for key, entry in entries.items():
            assert 0 <= entry.stuck <= entry.outstanding, (key, entry)

    def teardown(self) -> None:
        w = self.world
        event(f"fenced={bool(w.closed)}")
        event(f"lost a chunk={w.unsettled > 0}")
        event(f"drained={w.done}")
        event(f"reused={any(1 in d.released for d in w.decodes)}")


RankMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRankMachine = RankMachine.TestCase
