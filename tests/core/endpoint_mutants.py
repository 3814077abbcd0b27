"""Broken variants of the decode endpoint's state machine, each one change
that must break safety or liveness. ``explore_endpoint`` has to catch every
one; if it ever stops catching one, it has gone blind to that bug."""

from __future__ import annotations

import math

from kvconn.protocol.drain import DrainReport
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import (
    Action,
    LinksChanged,
    Request,
    Send,
    Tick,
    Undrained,
    WriterIdentity,
)
from kvconn.protocol.messages import AbortAck, RankDraining, RoomStatus, TransferRequest
from kvconn.protocol.owner_fence import OwnerFenceDone, OwnerFenceError


class AckOfAnySession(EndpointState):
    """An ack or status is taken from whatever process is at the rank's
    address: a process restarted there acks rooms it never wrote."""

    def _for_us(self, msg):  # type: ignore[no-untyped-def]
        request = self.requests.get(msg.room)
        if request is not None and 0 <= msg.rank < len(request.ids):
            expected = request.writers.get(request.ids[msg.rank])
            if expected is not None:
                msg = type(msg)(**{**_fields(msg), "session": expected.session})
        return super()._for_us(msg)


def _fields(msg: AbortAck | RoomStatus) -> dict[str, object]:
    return {name: getattr(msg, name) for name in msg.__slots__ if not name.startswith("__")}


class ExitWithoutDrain(EndpointState):
    """A writer's exit proves its rooms free at once, while our ends of its
    connections still hold bytes its kernel will deliver."""

    def _exits(self, gone: frozenset[WriterIdentity], peers_drained: bool, now: float) -> list[Action]:
        return super()._exits(gone, True, now)


class FencedAckAtOnce(EndpointState):
    """A fenced ack counts before decode's ends of the connections its fence
    closed drained."""

    def handle(self, stimulus: object, now: float) -> list[Action]:  # type: ignore[override]
        if isinstance(stimulus, Undrained):
            stimulus = Undrained(stimulus.ack, drained=True)
        return super().handle(stimulus, now)


class RestartKeepsOldRooms(EndpointState):
    """A rank restarted at its address: the rooms its earlier process was
    asked to write are not failed, and wait TRANSFERRING for good."""

    def _fail_rooms_of(self, rank: int, writer: WriterIdentity, reason: str, now: float) -> list[Action]:
        if "restarted" in reason:
            return []
        return super()._fail_rooms_of(rank, writer, reason, now)


class DrainedProvesFencedRooms(EndpointState):
    """A rank's "drained" proves its rooms although its fences closed
    connections whose bytes may still be in our socket buffers."""

    def handle(self, stimulus, now):  # type: ignore[no-untyped-def,override]
        if isinstance(stimulus, RankDraining):
            stimulus = RankDraining(stimulus.rank, stimulus.session, stimulus.decode, stimulus.done)
        return super().handle(stimulus, now)


class FailedOwnerFenceReleases(EndpointState):
    """An owner fence that failed is taken for one that happened: the held
    pages come back while a frozen writer can still land in them."""

    def handle(self, stimulus: object, now: float) -> list[Action]:  # type: ignore[override]
        if isinstance(stimulus, OwnerFenceError):
            stimulus = OwnerFenceDone(b"")
        return super().handle(stimulus, now)


class OwnerFenceLeavesRoomsInFlight(EndpointState):
    """The owner fence releases the held rooms but leaves those in flight
    open: nothing their writers send can land any more, and they wait
    TRANSFERRING for good."""

    def _fail_and_abort(self, request: Request, reason: str, now: float) -> list[Action]:
        if "owner" in reason:
            return []
        return super()._fail_and_abort(request, reason, now)


# -- liveness (protocol/liveness.py) ----------------------------------------------
class WatchesNoRank(EndpointState):
    """Heartbeats save their Hellos too eagerly: no rank counts as watched,
    so a rank whose process exited or went silent under an open room is
    never asked, looked up or found down, and the room waits TRANSFERRING
    for good."""

    def watched(self) -> set[int]:
        return set()


class SilentNeverDown(EndpointState):
    """A watched rank is Hello'd but never judged: one that leaves every
    Hello unanswered is never down, and its open rooms never fail."""

    def handle(self, stimulus: object, now: float) -> list[Action]:  # type: ignore[override]
        if isinstance(stimulus, Tick):
            self._asked.clear()
        return super().handle(stimulus, now)


# -- the endpoint's own drain (protocol/drain.py) ---------------------------------
class DrainGraceNeverEnds(EndpointState):
    """A draining endpoint never aborts what the engine left: the rooms stay
    open and their pages never come back."""

    def begin_drain(self, now: float, grace_s: float, settle_s: float) -> list[Action]:
        return super().begin_drain(now, math.inf, settle_s)


class DrainReportsAtGraceEnd(EndpointState):
    """The drain reports drained once its grace ran out, aborted rooms or not:
    the engine closes and frees a region writers may still reach."""

    def drain_tick(self, now: float) -> tuple[DrainReport | None, list[Action]]:
        report, actions = super().drain_tick(now)
        if self.drain is not None and self.drain.grace_over and report is None:
            report = DrainReport(True, now - self.drain.since)
        return report, actions


class DrainWaitsForEveryPage(EndpointState):
    """The drain's wait has no end: with a writer frozen for good, drain()
    never returns."""

    def drain_tick(self, now: float) -> tuple[DrainReport | None, list[Action]]:
        if self.drain is not None:
            self.drain.settle_s = math.inf
        return super().drain_tick(now)


# -- the bootstrap (protocol/bootstrap.py) ------------------------------------------
class BootstrapNeverResends(EndpointState):
    """Hellos go out once: one lost Hello or HelloAck fails the bootstrap of
    an instance whose ranks are all up."""

    def begin_bootstrap(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        instance = super().begin_bootstrap(*args, **kwargs)
        instance.resend_every = math.inf
        return instance


class BootstrapWithoutDeadline(EndpointState):
    """A bootstrap waits for a silent rank for good: the engine's receiver()
    (or the constructor) never returns."""

    def begin_bootstrap(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        instance = super().begin_bootstrap(*args, **kwargs)
        instance.give_up_at = math.inf
        return instance


__all__ = [
    "AckOfAnySession",
    "BootstrapNeverResends",
    "BootstrapWithoutDeadline",
    "DrainGraceNeverEnds",
    "DrainReportsAtGraceEnd",
    "DrainWaitsForEveryPage",
    "DrainedProvesFencedRooms",
    "ExitWithoutDrain",
    "FailedOwnerFenceReleases",
    "FencedAckAtOnce",
    "OwnerFenceLeavesRoomsInFlight",
    "RestartKeepsOldRooms",
]


class LinksIgnored(EndpointState):
    """Liveness judges a rank by its Hellos alone, as before the control
    link's heartbeat: a rank slow to answer (its Python starved by load) is
    called down although its process runs and its link is up."""

    def handle(self, stimulus: object, now: float) -> list[Action]:  # type: ignore[override]
        actions = super().handle(stimulus, now)
        if isinstance(stimulus, LinksChanged):
            self._link = {}
        return actions


class SendsBlind(EndpointState):
    """A request goes to a rank whose link was lost as to the process decode
    knew there, without asking who answers there now."""

    def open(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        saved, self.unconfirmed = self.unconfirmed, set()
        try:
            return super().open(*args, **kwargs)
        finally:
            self.unconfirmed = saved


class WaitingNeverSent(EndpointState):
    """A rank that answers after its link came back is confirmed, but the
    requests that waited for it are not sent: they wait for good."""

    def handle(self, stimulus: object, now: float) -> list[Action]:  # type: ignore[override]
        waiting = {room: set(r.unsent) for room, r in self.requests.items() if r.unsent}
        actions = super().handle(stimulus, now)
        for room, ranks in waiting.items():
            request = self.requests.get(room)
            if request is not None and not request.aborted and request.verdict is None:
                request.unsent |= ranks  # put back what was just sent
        return [
            a
            for a in actions
            if not (
                isinstance(a, Send) and isinstance(a.message, TransferRequest) and a.message.room in waiting
            )
        ]
