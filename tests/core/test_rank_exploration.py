"""Every interleaving of small worlds around the real RankState, and
mutants of it the explorer must catch."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import explore_rank as er
import pytest

from kvconn.protocol.drain import Announce
from kvconn.protocol.ledger import LIVE, KVPoll, RoomKey, RoomLedger
from kvconn.protocol.messages import TcpConnection
from kvconn.protocol.rank import CONCLUDED, Action, ChunkEnd, RankState, SenderState, SendPlan

#: name -> the world (each under ~30 s on a loaded 2-core machine)
CONFIGS = {
    # a decode that reuses the room id (2 requests), a replayed request, one sender
    "reuse": er.Config(uses=2, senders=1, replays=1, errors=0, fail=False, fail_room=False),
    # one sender of two decodes (prefill TP < decode TP), each decode aborting anywhere
    "fan-out": er.Config(
        decodes=2, fan_out=2, uses=1, senders=1, replays=0, errors=0, fail=False, fail_room=False
    ),
    # a failed chunk, the engine's fail, clear and fail_room, the deadline and the TTL
    "faults": er.Config(uses=1, senders=1, replays=0, errors=1, fail=True, fail_room=True),
    # two chunks per request, the engine trying a last chunk after the first
    "chunks": er.Config(uses=1, npages=2, senders=1, replays=0, errors=0, fail=False, fail_room=False),
    # the engine drains the rank at any point: requests refused, the grace, done
    "drain": er.Config(uses=1, senders=1, replays=0, errors=1, fail=False, fail_room=False, drain=True),
    # a chunk that ends unsettled or with a raising hook, the writer's fence (proven), which may fail
    "fence": er.Config(
        uses=2, senders=1, replays=0, errors=0, fail=False, fail_room=False, unsettled=1, fence_fails=True
    ),
    # the same with a writer whose fence is not proven (its hook's True proves nothing)
    "no-fence": er.Config(
        uses=2, senders=1, replays=0, errors=0, fail=False, fail_room=False, unsettled=1, writer_fence=False
    ),
    # a drain with a chunk in limbo: done only after the fence, naming what it closed
    "drain-fence": er.Config(
        uses=1, senders=1, replays=0, errors=0, fail=False, fail_room=False, drain=True, unsettled=1
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_rank_is_safe_in_every_interleaving(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = er.explore(CONFIGS[name])
    with capsys.disabled():
        print(
            f"\n  explored rank world {name}: {report.states} states, {report.transitions} transitions, "
            f"{report.terminals} terminal states, {report.reuses} with the id reused"
        )
    assert report.terminals > 0 and report.states > 500
    assert report.reuses > 0 or CONFIGS[name].uses == 1


# -- mutants: each one line of the machine, each caught ------------------------------
class _Untagged(RankState[str]):
    """Chunks queued without their incarnation tag."""

    def plan_send(self, s: SenderState, src: Sequence[int], last: bool, polled: KVPoll) -> SendPlan:
        plan = super().plan_send(s, src, last, polled)
        legs = tuple(leg._replace(incarnation=None) for leg in plan.legs)
        return plan._replace(legs=legs)


class _SettledByAny(RankState[str]):
    """A fan-out sender settled once any one decode settled."""

    def settled(self, s: SenderState) -> bool:
        self._bind(s)
        return any(
            self._leg_status(leg) in CONCLUDED and leg.entry.outstanding == leg.entry.stuck for leg in s.legs
        )


class _SettledUnbound(RankState[str]):
    """settled() over the legs bound so far (today's code before the explorer found it)."""

    def settled(self, s: SenderState) -> bool:
        self._bind(s)
        return all(
            self._leg_status(leg) in CONCLUDED and leg.entry.outstanding == leg.entry.stuck for leg in s.legs
        )


class _ShortLast(RankState[str]):
    """A last chunk that leaves pages of the room unwritten accepted."""

    def plan_send(self, s: SenderState, src: Sequence[int], last: bool, polled: KVPoll) -> SendPlan:
        return super().plan_send(s, src, False, polled)._replace(last=last)


class _DrainIgnoresInFlight(RankState[str]):
    """Drained once no room is live, with a chunk still being written."""

    def drain_tick(self, now: float) -> tuple[bool, list[Action]]:
        cls = type(self.ledger)
        real = cls.unsettled_keys
        try:
            cls.unsettled_keys = lambda ledger: [  # type: ignore[method-assign]
                k for k in real(ledger) if ledger.status(k) in LIVE
            ]
            return super().drain_tick(now)
        finally:
            cls.unsettled_keys = real  # type: ignore[method-assign]


class _AcceptsWhileDraining(RankState[str]):
    """A draining rank that takes new requests."""

    @functools.singledispatchmethod
    def handle(self, msg: object, now: float) -> list[Action]:
        drain, self.drain = self.drain, None
        try:
            return super().handle(msg, now)
        finally:
            self.drain = drain


class _UnsettledAsSettled(RankState[str]):
    """A chunk that ended unsettled counted as settled (its count dropped)."""

    def chunk_ended(
        self, key: RoomKey, end: ChunkEnd, last: bool = False, reason: str = ""
    ) -> Sequence[Action]:
        if end is ChunkEnd.UNSETTLED:
            end = ChunkEnd.FAILED_SETTLED
        return super().chunk_ended(key, end, last, reason)


class _PluginErrorUncounted(RankState[str]):
    """A chunk whose hook raised counted as settled: the fail-safe undone."""

    def chunk_ended(
        self, key: RoomKey, end: ChunkEnd, last: bool = False, reason: str = ""
    ) -> Sequence[Action]:
        if end is ChunkEnd.PLUGIN_ERROR:
            end = ChunkEnd.FAILED_SETTLED
        return super().chunk_ended(key, end, last, reason)


class _TrustsAnUnprovenFence(RankState[str]):
    """A writer's fence trusted without the capability the conformance suite proves."""

    @property
    def _fences(self) -> bool:
        return True


class _FailedFenceSettles(RankState[str]):
    """A fence that failed settles the poisoned rooms all the same."""

    def fence_ended(self, ok: bool, closed: frozenset[TcpConnection] = frozenset()) -> Sequence[Action]:
        return super().fence_ended(True, closed)


class _ForgetsClosedConnections(RoomLedger):
    """Fenced acks that do not name the connections the fence closed."""

    def fenced(self, closed: frozenset[TcpConnection] = frozenset()) -> Any:
        return super().fenced(frozenset())


class _AnnouncesNoConnections(RankState[str]):
    """A drain's ``done`` that does not name the connections the fences closed."""

    def drain_tick(self, now: float) -> tuple[bool, list[Action]]:
        drained, actions = super().drain_tick(now)
        return drained, [attrs.evolve(a, closed=()) if isinstance(a, Announce) else a for a in actions]


def _factory(cls: type[RankState[str]], ledger: type[RoomLedger] = RoomLedger) -> Any:
    def make(cfg: er.Config) -> RankState[str]:
        return cls(ledger(0, er.TTL_S, er.SESSION), er.BOOTSTRAP_S, er.reachable, er.terms(cfg))

    return make


MUTANTS = {
    "untagged": (_Untagged, "reuse", "R2"),
    "settled-by-any": (_SettledByAny, "fan-out", "R3"),
    "settled-unbound": (_SettledUnbound, "faults", "R3"),
    "short-last": (_ShortLast, "chunks", "R2"),
    "drain-ignores-in-flight": (_DrainIgnoresInFlight, "drain", "R4"),
    "accepts-while-draining": (_AcceptsWhileDraining, "drain", "R4"),
    # the chunk path's decisions (RankState.chunk_ended, fence_begins/ended)
    "unsettled-as-settled": (_UnsettledAsSettled, "fence", "R1"),
    "plugin-error-uncounted": (_PluginErrorUncounted, "fence", "R1"),
    "trusts-an-unproven-fence": (_TrustsAnUnprovenFence, "no-fence", "R1"),
    "failed-fence-settles": (_FailedFenceSettles, "fence", "R1"),
    "announces-no-connections": (_AnnouncesNoConnections, "drain-fence", "R5"),
}


@pytest.mark.parametrize("name", [*MUTANTS, "ack-names-no-connections"])
def test_the_explorer_catches_a_mutant(name: str) -> None:
    if name == "ack-names-no-connections":
        factory, world, rule = _factory(RankState, _ForgetsClosedConnections), "fence", "R5"
    else:
        cls, world, rule = MUTANTS[name]
        factory = _factory(cls)
    with pytest.raises(er.Violation, match=rule):
        er.explore(CONFIGS[world], factory)
