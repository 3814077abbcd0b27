"""How a decode endpoint carries out its state machine's actions: sends,
``/proc`` probes the machine asked for (answered at once), metrics and logs.
Called with the endpoint's lock held; nothing here decides anything."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence

from kvconn.metrics import Metrics
from kvconn.protocol.drops import DropReason
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import (
    AckCounted,
    Action,
    Answered,
    CheckDrain,
    Drop,
    Identified,
    Identify,
    RankDown,
    RankRestarted,
    RoomFailed,
    Send,
    Undrained,
)
from kvconn.protocol.hold import Quarantine, Release
from kvconn.protocol.messages import Abort
from kvconn.runtime.control import Outbox
from kvconn.runtime.procs import WriterIdentity
from kvconn.runtime.sockets import undrained
from kvconn.runtime.tracing import NO_TRACER, NoTracer

log = logging.getLogger("kvconn.runtime.decode")


class Carrier:
    """Carries out one endpoint's actions."""

    def __init__(
        self,
        state: EndpointState,
        outbox: Outbox,
        metrics: Metrics,
        bootstrapped: threading.Condition,
        on_drop: Callable[[DropReason], None],
        tracer: NoTracer = NO_TRACER,
    ) -> None:
        self._state = state
        self._outbox = outbox
        self.metrics = metrics
        self._bootstrapped = bootstrapped
        self._on_drop = on_drop
        self._tracer = tracer

    def run(self, actions: Sequence[Action], now: float) -> list[Release]:
        """Carry out ``actions``; the releases are returned, for the engine's
        callback to run outside the lock."""
        releases: list[Release] = []
        for action in actions:
            self._do(action, now, releases)
        return releases

    @functools.singledispatchmethod
    def _do(self, action: object, now: float, releases: list[Release]) -> None:
        raise TypeError(f"no way to carry out {action!r}")

    @_do.register
    def _(self, action: Send, now: float, releases: list[Release]) -> None:
        if self._outbox.send(action.address, self._tracer.outgoing(action.message)) and isinstance(
            action.message, Abort
        ):
            self.metrics.aborts_sent.inc()
            self._tracer.carried(action)

    @_do.register
    def _(self, action: Release, now: float, releases: list[Release]) -> None:
        releases.append(action)
        proof = action.proof.value
        self.metrics.releases.labels(proof).inc()
        self.metrics.released_pages.labels(proof).inc(len(action.pages))
        self.metrics.release_latency.labels(proof).observe(action.held_for)
        self.metrics.quarantine_seconds.inc(action.quarantined_for)
        self._tracer.carried(action)

    @_do.register
    def _(self, action: Quarantine, now: float, releases: list[Release]) -> None:
        self.metrics.quarantines.inc()
        self._tracer.carried(action)
        log.warning("room %d quarantined: %d pages held, no proof yet", action.room, len(action.pages))

    @_do.register
    def _(self, action: Drop, now: float, releases: list[Release]) -> None:
        self._on_drop(action.reason)

    @_do.register
    def _(self, action: Identify, now: float, releases: list[Release]) -> None:
        writer = WriterIdentity.announced(action.ack)
        releases += self.run(self._state.handle(Identified(action.ack, writer), now), now)

    @_do.register
    def _(self, action: CheckDrain, now: float, releases: list[Release]) -> None:
        event = Undrained(action.ack, drained=not undrained(action.ack.closed))
        releases += self.run(self._state.handle(event, now), now)

    @_do.register
    def _(self, action: AckCounted, now: float, releases: list[Release]) -> None:
        self.metrics.acks_received.inc()
        if action.waited is not None:
            self.metrics.ack_wait.labels(str(action.rank)).observe(action.waited)

    @_do.register
    def _(self, action: RankDown, now: float, releases: list[Release]) -> None:
        self.metrics.ranks_down.labels(action.cause).inc()
        log.warning("prefill rank %d is down: %s", action.rank, action.reason)

    @_do.register
    def _(self, action: RankRestarted, now: float, releases: list[Release]) -> None:
        self.metrics.rank_restarts.inc()
        log.warning("prefill rank %d at %s restarted: re-bootstrapped", action.local_rank, action.address)

    @_do.register
    def _(self, action: RoomFailed, now: float, releases: list[Release]) -> None:
        counter = (
            self.metrics.room_deadlines if action.cause == "deadline" else self.metrics.rooms_failed_by_rank
        )
        counter.inc()
        self._tracer.carried(action)

    @_do.register
    def _(self, action: Answered, now: float, releases: list[Release]) -> None:
        self._bootstrapped.notify_all()
