"""Hypothesis drives the real core through random interleavings of a bigger
world than the exhaustive explorer can cover (3 ranks, 3 chunks, 2 ERRs),
with forged, stale, duplicate and stranger acks thrown in.

Checked after every step: S1 and S2 (raised by the explorer's world), S3
(every bogus ack is dropped, with a reason, and releases nothing); at the end
of every run, L2 (the world is drained: the aborted room left hold, released
whenever every write settled)."""

from __future__ import annotations

import explore
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvconn.protocol.hold import Dropped
from kvconn.protocol.messages import AbortAck

RANKS, CHUNKS, ERRORS = 3, 3, 2


class ProtocolMachine(RuleBasedStateMachine):
    world: explore.World

    @initialize()
    def start(self) -> None:
        self.world = explore.initial(RANKS, explore.RoomLedger, explore.default_tracker)
        self.delivered: list[AbortAck] = []
        self.bogus_dropped = 0

    @rule(pick=st.integers(min_value=0, max_value=10_000))
    def step(self, pick: int) -> None:
        enabled = list(explore.steps(self.world, CHUNKS, ERRORS))
        if not enabled:
            return
        label, mutate = enabled[pick % len(enabled)]
        if label.startswith("decode:ack"):
            self.delivered.append(self.world.acks[int(label.removeprefix("decode:ack"))])
        mutate(self.world)

    @rule(
        kind=st.sampled_from(["stale_generation", "stranger_rank", "other_room", "duplicate"]),
        rank=st.integers(0, RANKS - 1),
    )
    def bogus_ack(self, kind: str, rank: int) -> None:
        tracker = self.world.tracker
        entry = tracker._rooms.get(explore.ROOM)
        issued = max(entry.generations) if entry and entry.generations else 0
        if kind == "stale_generation":
            ack = AbortAck(explore.ROOM, rank, issued + 1000, False)
        elif kind == "stranger_rank":
            ack = AbortAck(explore.ROOM, RANKS + rank, issued, False)
        elif kind == "other_room":
            ack = AbortAck(explore.ROOM + 1, rank, issued, False)
        else:
            if not self.delivered:
                return
            ack = self.delivered[rank % len(self.delivered)]
        released_before = self.world.released
        actions = tracker.ack(ack, now=0.0)
        assert len(actions) == 1 and isinstance(actions[0], Dropped), (kind, actions)
        assert self.world.released == released_before
        self.bogus_dropped += 1

    @invariant()
    def no_write_lands_after_release(self) -> None:
        if self.world.released:
            assert all(not r.in_flight and r.phase != "write" for r in self.world.ranks)

    def teardown(self) -> None:
        # L2: let every remaining step happen (first enabled, bounded), then
        # the aborted room must have left hold.
        for _ in range(10_000):
            enabled = list(explore.steps(self.world, CHUNKS, ERRORS))
            if not enabled:
                break
            enabled[0][1](self.world)
        else:
            raise AssertionError("the world never drained")
        explore._check_terminal(self.world)
        event(
            f"aborted={self.world.aborted} released={self.world.released} "
            f"unsettled_errors={self.world.unsettled_errors > 0}"
        )


ProtocolMachine.TestCase.settings = settings(
    max_examples=500, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestProtocol = ProtocolMachine.TestCase
