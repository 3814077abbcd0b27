"""Hypothesis drives the decode endpoint's state machine (the real
:class:`~kvconn.protocol.endpoint.EndpointState`) through random runs of a
bigger world than the exhaustive explorer covers: two instances (one of two
ranks), three rooms reused up to three times, restarts, exits, freezes,
fences, a rank's drain, the endpoint's own drain, transfer deadlines and the
owner fence (ok or failing), with forged, stale, replayed and strangers'
messages thrown in. The world is ``explore_endpoint``'s: its rank processes,
network and probes, and its checks.

Checked at every release (S1): each rank the room was asked of is proven
by what the world really did, not by what the machine believes: an ack its
own process (the request's writer) sent for an ABORT of this hold, after
the fence's connections drained if it fenced; that process's proven exit
(it is gone and nothing it sent is still on its way); its announced drain
with no connection left undrained; its SUCCESS for this request; or an owner
fence since the request. A forged or stale message never releases a page
(S3). The explorer's S (no release while a process that took the request can
still write) holds throughout. At the end of every run, once everything
drained (L): no page is pinned once every proof has come.
"""

from __future__ import annotations

from collections import defaultdict

import explore_endpoint as explore
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import Action, Drop, Request, Tick, Undrained
from kvconn.protocol.hold import Release, SendAbort
from kvconn.protocol.messages import AbortAck, RankDraining, RoomOutcome, RoomStatus
from kvconn.protocol.owner_fence import OwnerFenceDone

INSTANCES = (("p0", "p1"), ("q0",))
LIMITS = explore.Limits(
    rooms=((1, 0), (2, 0), (3, 1)),
    requests_per_room=3,
    ticks=8,
    aborts=4,
    restarts=1,
    exits=1,
    fenced=True,
    drains=1,
    freezes=1,
    owner_fence_after_s=2.0,
    fence_fails=1,
    transfer_timeout_s=2.5,
    decode_drain=True,
    distinct_sessions=True,
)


class Evidence:
    """What the world really sent the machine, per room's current request
    and hold (the machine's own tables are not consulted)."""

    def __init__(self) -> None:
        self.forging = False  #: the test, not the world, is sending
        self.generations: dict[int, set[int]] = defaultdict(set)  #: ABORTs of each room's current hold
        self.acks: dict[int, set[tuple[int, int, int]]] = defaultdict(set)  #: room -> (rank, session, gen)
        self.fenced: dict[tuple[int, int, int], int] = {}  #: fenced acks: (room, session, gen) -> rank
        self.successes: dict[int, set[tuple[int, int]]] = defaultdict(set)  #: room -> (rank, session)
        self.drained: set[tuple[int, int]] = set()  #: (rank, session) announced drained, nothing closed
        self.owner_fenced: dict[int, bool] = defaultdict(bool)  #: room -> an owner fence since its request
        self.releases = 0
        self.world: explore.World | None = None

    def opened(self, room: int) -> None:
        for table in (self.generations, self.acks, self.successes):
            table.pop(room, None)
        self.owner_fenced[room] = False

    def delivered(self, stimulus: object) -> None:
        if self.forging:
            return
        if isinstance(stimulus, AbortAck):
            key = (stimulus.room, stimulus.session, stimulus.generation)
            if stimulus.closed:  # a fenced ack: proof once its connections drained
                self.fenced[key] = stimulus.rank
            else:
                self.acks[stimulus.room].add((stimulus.rank, stimulus.session, stimulus.generation))
        elif isinstance(stimulus, Undrained) and stimulus.drained:  # the world's probe found them drained
            self._drained(stimulus.ack)
        elif isinstance(stimulus, Tick):
            for ack in stimulus.drained:
                self._drained(ack)
        elif isinstance(stimulus, RoomStatus) and stimulus.outcome is RoomOutcome.SUCCESS:
            self.successes[stimulus.room].add((stimulus.rank, stimulus.session))
        elif isinstance(stimulus, RankDraining) and stimulus.done and not stimulus.closed:
            self.drained.add((stimulus.rank, stimulus.session))
        elif isinstance(stimulus, OwnerFenceDone):
            for room in self.owner_fenced:
                self.owner_fenced[room] = True

    def _drained(self, ack: AbortAck) -> None:
        """The connections a fenced ack names drained (the machine passes the
        ack back with its rank renumbered: the world's own copy says whose)."""
        rank = self.fenced.get((ack.room, ack.session, ack.generation))
        if rank is not None:
            self.acks[ack.room].add((rank, ack.session, ack.generation))

    def check(self, release: Release, request: Request | None) -> None:
        """S1: every rank of the room is proven by the world."""
        assert self.world is not None
        assert request is not None, f"room {release.room} released with no request"
        self.releases += 1
        for rank_id, writer in request.writers.items():
            local = request.ids.index(rank_id)
            proc = explore._proc(self.world, writer.address, writer.session)
            acked = any(
                (local, writer.session, g) in self.acks[release.room] for g in self.generations[release.room]
            )
            proofs = {
                "ack": acked,
                "exit": not proc.alive and not proc.undrained,
                "drained": (local, writer.session) in self.drained,
                "completed": (local, writer.session) in self.successes[release.room],
                "owner_fence": self.owner_fenced[release.room],
            }
            assert any(proofs.values()), (
                f"S1: room {release.room} released ({release.proof.value}) with rank {rank_id} "
                f"({writer.address}/{writer.session}) unproven"
            )


class Spy(EndpointState):
    """The real machine; it only reports what it was fed and what it did."""

    evidence: Evidence

    def open(self, room, pages, instance, ranks, extras_slot, now):  # type: ignore[no-untyped-def,override]
        request, sends = super().open(room, pages, instance, ranks, extras_slot, now)
        self.evidence.opened(room)
        return request, sends

    def handle(self, stimulus: object, now: float) -> list[Action]:  # type: ignore[override]
        self.evidence.delivered(stimulus)
        return super().handle(stimulus, now)

    def carry(self, actions):  # type: ignore[no-untyped-def,override]
        for action in actions:
            if isinstance(action, SendAbort):
                self.evidence.generations[action.abort.room].add(action.abort.generation)
            elif isinstance(action, Release):
                self.evidence.check(action, self.requests.get(action.room))
        return super().carry(actions)


class EndpointMachine(RuleBasedStateMachine):
    world: explore.World

    @initialize()
    def start(self) -> None:
        self.evidence = Evidence()

        def factory(*args: object, **kwargs: object) -> Spy:
            spy = Spy(*args, **kwargs)  # type: ignore[arg-type]
            spy.evidence = self.evidence
            return spy

        self.world = explore.initial(INSTANCES, LIMITS, factory)
        self.evidence.world = self.world
        self.forged = 0

    @rule(pick=st.integers(min_value=0, max_value=10_000))
    def step(self, pick: int) -> None:
        enabled = list(explore.steps(self.world, LIMITS, len(INSTANCES)))
        if enabled:
            label, mutate = enabled[pick % len(enabled)]
            self.world.trace = (*self.world.trace, label)
            mutate(self.world)

    @rule(
        kind=st.sampled_from(
            ["stale_generation", "other_session", "other_decode", "stranger_rank", "replay"]
        ),
        what=st.sampled_from(["ack", "success", "drained"]),
        room=st.sampled_from([1, 2, 3]),
        rank=st.integers(0, 1),
    )
    def forge(self, kind: str, what: str, room: int, rank: int) -> None:
        state = self.world.state
        generation = max(self.evidence.generations.get(room) or {0})
        name, session = state.name, 1
        request = state.requests.get(room)
        if request is not None and rank < len(request.ids):
            session = request.writers[request.ids[rank]].session
        if kind == "stale_generation":
            generation += 1000
        elif kind == "other_session":
            session += 10_000  # no process of the world has it
        elif kind == "other_decode":
            name = "another-decode"
        elif kind == "stranger_rank":
            rank += 5
        elif kind == "replay":  # a genuine message of an earlier hold: its generation is not this one's
            generation = min(self.evidence.generations.get(room) or {0}) - 1
        if what == "ack":
            msg: object = AbortAck(room, rank, generation, False, name, session)
        elif what == "success":
            if kind in ("stale_generation", "replay"):
                return  # a status names no generation: a genuine one is the world's
            msg = RoomStatus(room, rank, RoomOutcome.SUCCESS, "", name, session)
        else:
            if kind in ("stale_generation", "replay"):
                return
            msg = RankDraining(rank, session, name, True)
        self.world.trace = (*self.world.trace, f"forge:{what}:{kind}:{room}:{rank}")
        self.evidence.forging = True
        try:
            released = self.evidence.releases
            actions = state.handle(msg, self.world.now)
        finally:
            self.evidence.forging = False
        assert self.evidence.releases == released and not any(isinstance(a, Release) for a in actions), (
            f"S3: forged {what} ({kind}) released {actions}"
        )
        assert [a for a in actions if not isinstance(a, Drop)] == [], (kind, what, actions)
        self.forged += 1

    @invariant()
    def holds_match_requests(self) -> None:
        # every tracked room has its current request; pages of released rooms are out of the table
        state = self.world.state
        assert set(state.requests) == {room for room in (1, 2, 3) if state.tracker.state(room) is not None}, (
            "a tracked room without its request, or a request left behind"
        )

    def teardown(self) -> None:
        if not hasattr(self, "world"):
            return
        for _ in range(20_000):
            enabled = list(explore.steps(self.world, LIMITS, len(INSTANCES)))
            if not enabled:
                break
            enabled[0][1](self.world)
        else:
            raise AssertionError("the world never settled")
        explore._check_terminal(self.world, LIMITS)  # L
        event(f"releases={self.evidence.releases > 0} forged={self.forged > 0}")


EndpointMachine.TestCase.settings = settings(
    # about 3 s on an idle 2-core machine: a few seconds of CI
    max_examples=30,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEndpoint = EndpointMachine.TestCase
