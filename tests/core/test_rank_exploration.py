"""Every interleaving of small worlds around the real RankState, and
mutants of it the explorer must catch."""

from __future__ import annotations

import functools
from typing import Any

import attrs
import explore_rank as er
import pytest

from kvconn.protocol.ledger import LIVE, KVPoll, RoomLedger
from kvconn.protocol.rank import CONCLUDED, Action, RankState, SenderState, SendPlan

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

    def plan_send(self, s: SenderState, npages: int, last: bool, polled: KVPoll) -> SendPlan[str]:
        plan = super().plan_send(s, npages, last, polled)
        legs = tuple(attrs.evolve(leg, incarnation=None) for leg in plan.legs)
        return attrs.evolve(plan, legs=legs)


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

    def plan_send(self, s: SenderState, npages: int, last: bool, polled: KVPoll) -> SendPlan[str]:
        return attrs.evolve(super().plan_send(s, npages, False, polled), last=last)


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


def _factory(cls: type[RankState[str]]) -> Any:
    def make() -> RankState[str]:
        return cls(RoomLedger(0, er.TTL_S, er.SESSION), er.BOOTSTRAP_S, er.reachable)

    return make


MUTANTS = {
    "untagged": (_Untagged, "reuse", "R2"),
    "settled-by-any": (_SettledByAny, "fan-out", "R3"),
    "settled-unbound": (_SettledUnbound, "faults", "R3"),
    "short-last": (_ShortLast, "chunks", "R2"),
    "drain-ignores-in-flight": (_DrainIgnoresInFlight, "drain", "R4"),
    "accepts-while-draining": (_AcceptsWhileDraining, "drain", "R4"),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_the_explorer_catches_a_mutant(name: str) -> None:
    cls, world, rule = MUTANTS[name]
    with pytest.raises(er.Violation, match=rule):
        er.explore(CONFIGS[world], _factory(cls))
