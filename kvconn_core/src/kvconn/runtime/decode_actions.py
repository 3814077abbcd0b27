"""How a decode endpoint carries out its state machine's actions: sends,
``/proc`` probes the machine asked for (answered at once), metrics and logs
(:class:`Carrier`, called with the endpoint's lock held), and the gauges that
read its holds when scraped (:func:`gauge_hold_state`). Nothing here decides
anything."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

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
from kvconn.protocol.hold import HoldState, Quarantine, Release
from kvconn.protocol.messages import Abort
from kvconn.protocol.owner_fence import FenceAsOwner, OwnerFenced, OwnerFenceDone, OwnerFenceError
from kvconn.runtime.control import Outbox
from kvconn.runtime.procs import WriterIdentity
from kvconn.runtime.sockets import undrained
from kvconn.runtime.tracing import NO_TRACER, NoTracer
from kvconn.transport import FencedWithoutEndpoint, OwnerFenceUnsupported

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
        owner_fence: Callable[[], bytes] | None = None,
        tracer: NoTracer = NO_TRACER,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``owner_fence``: the region's (``kvconn.transport.owner_fence``):
        fences it and returns its new metadata (``FencedWithoutEndpoint``: no
        endpoint yet).
        ``clock``: the endpoint's, read once a fence is over (it can take a
        second: its releases count it)."""
        self._state = state
        self._outbox = outbox
        self.metrics = metrics
        self._bootstrapped = bootstrapped
        self._on_drop = on_drop
        self._owner_fence = owner_fence
        self._tracer = tracer
        self._clock = clock

    def run(self, actions: Sequence[Action], now: float) -> list[Release]:
        """Carry out ``actions``; the releases are returned, for the engine's
        callback to run outside the lock."""
        releases: list[Release] = []
        for action in actions:
            self._do(action, now, releases)
        return releases

    def _do(self, action: object, now: float, releases: list[Release]) -> None:
        """One action, by its type, in one place (:data:`_DO`, a dict:
        ``singledispatchmethod`` builds a wrapper on every access)."""
        do = _DO.get(type(action))
        if do is None:
            raise TypeError(f"no way to carry out {action!r}")
        do(self, action, now, releases)

    def _send(self, action: Send, now: float, releases: list[Release]) -> None:
        sending = self._tracer.now()  # before the send: the rank may take it at once
        if self._outbox.send(action.address, self._tracer.outgoing(action.message)) and isinstance(
            action.message, Abort
        ):
            self.metrics.aborts_sent.inc()
            self._tracer.abort_sent(action, sending)

    def _release(self, action: Release, now: float, releases: list[Release]) -> None:
        releases.append(action)
        proof = action.proof.value
        m = self.metrics
        m.releases.counts[proof] += 1
        m.released_pages.counts[proof] += len(action.pages)
        m.observe(m.release_latency, "kvconn_abort_to_release_seconds", action.held_for, proof=proof)
        if action.quarantined_for:
            m.quarantine_seconds.inc(action.quarantined_for)
        self._tracer.carried(action)

    def _quarantine(self, action: Quarantine, now: float, releases: list[Release]) -> None:
        self.metrics.quarantines.inc()
        self._tracer.carried(action)
        waiting = ", ".join(self.rank_name(r) for r in sorted(self._state.tracker.unproven(action.room)))
        log.warning(
            "room %d quarantined: %d pages held, no proof yet from %s",
            action.room,
            len(action.pages),
            waiting or "no rank",
        )

    def rank_name(self, rank: int) -> str:
        """How the log names an endpoint-wide rank id: with its address (the
        id alone counts ranks across the instances this decode serves)."""
        writer = self._state.writers.get(rank)
        return f"prefill rank {rank}" if writer is None else f"prefill rank {rank} ({writer.address})"

    def _labels(self, rank: int) -> tuple[str, str]:
        writer = self._state.writers.get(rank)
        return str(rank), "" if writer is None else writer.address

    def _drop(self, action: Drop, now: float, releases: list[Release]) -> None:
        self._on_drop(action.reason)

    def _identify(self, action: Identify, now: float, releases: list[Release]) -> None:
        writer = WriterIdentity.announced(action.ack)
        releases += self.run(self._state.handle(Identified(action.ack, writer), now), now)

    def _check_drain(self, action: CheckDrain, now: float, releases: list[Release]) -> None:
        event = Undrained(action.ack, drained=not undrained(action.ack.closed))
        releases += self.run(self._state.handle(event, now), now)

    def _ack_counted(self, action: AckCounted, now: float, releases: list[Release]) -> None:
        self.metrics.acks_received.inc()
        if action.waited is not None:
            rank, address = self._labels(action.rank)
            m = self.metrics
            m.observe(m.ack_wait, "kvconn_abort_to_ack_seconds", action.waited, rank=rank, address=address)

    def _rank_down(self, action: RankDown, now: float, releases: list[Release]) -> None:
        self.metrics.ranks_down.labels(action.cause, *self._labels(action.rank)).inc()
        log.warning("%s is down: %s", self.rank_name(action.rank), action.reason)

    def _rank_restarted(self, action: RankRestarted, now: float, releases: list[Release]) -> None:
        self.metrics.rank_restarts.inc()
        log.warning("prefill rank %d at %s restarted: re-bootstrapped", action.local_rank, action.address)

    def _room_failed(self, action: RoomFailed, now: float, releases: list[Release]) -> None:
        if action.cause == "deadline":
            self.metrics.room_deadlines.inc()
        elif action.cause == "rank":
            self.metrics.rooms_failed_by_rank.inc()  # an owner fence's are in its log line
        self._tracer.carried(action)

    def _fence_as_owner(self, action: FenceAsOwner, now: float, releases: list[Release]) -> None:
        # Under the endpoint's lock, on purpose: no request, bootstrap or
        # Hello may go out with the old name while the old endpoint goes.
        event: OwnerFenceDone | OwnerFenceError
        try:
            if self._owner_fence is None:
                raise OwnerFenceUnsupported("this endpoint has no owner fence")
            event = OwnerFenceDone(self._owner_fence())
        except FencedWithoutEndpoint as exc:  # it held: releases, then retries for the endpoint
            event = OwnerFenceDone(None, str(exc))
        except Exception as exc:  # OwnerFenceFailed or anything else: nothing proven
            log.debug("owner fence raised", exc_info=True)
            event = OwnerFenceError(f"{type(exc).__name__}: {exc}")
        # Its releases are timed from when the fence was over, not asked for.
        after = now if self._clock is None else self._clock()
        releases += self.run(self._state.handle(event, after), after)

    def _owner_fenced(self, action: OwnerFenced, now: float, releases: list[Release]) -> None:
        outcome = "failed" if not action.ok else "ok" if action.endpoint else "no_endpoint"
        self.metrics.owner_fences.labels(outcome).inc()
        if not action.ok:
            log.warning("owner fence failed, every held page stays held: %s", action.reason)
            return
        if not action.endpoint:
            log.warning(
                "decode has no transport endpoint since its owner fence (%s): new rooms are refused "
                "until a retry makes one",
                action.reason,
            )
        self.metrics.owner_fence_pages.inc(action.pages)
        log.warning(
            "owner fence: %d rooms (%d pages) recovered, %d rooms in flight failed; "
            "prefill ranks re-bootstrap with decode %s",
            action.rooms,
            action.pages,
            action.failed,
            action.name,
        )

    def _answered(self, action: Answered, now: float, releases: list[Release]) -> None:
        self._bootstrapped.notify_all()


#: Carrier._do's one dispatch: action type -> how it is carried out.
_DO: dict[type, Callable[[Carrier, Any, float, list[Release]], None]] = {
    Send: Carrier._send,
    Release: Carrier._release,
    Quarantine: Carrier._quarantine,
    Drop: Carrier._drop,
    Identify: Carrier._identify,
    CheckDrain: Carrier._check_drain,
    AckCounted: Carrier._ack_counted,
    RankDown: Carrier._rank_down,
    RankRestarted: Carrier._rank_restarted,
    RoomFailed: Carrier._room_failed,
    FenceAsOwner: Carrier._fence_as_owner,
    OwnerFenced: Carrier._owner_fenced,
    Answered: Carrier._answered,
}


def gauge_hold_state(
    metrics: Metrics, state: EndpointState, lock: threading.Lock, clock: Callable[[], float]
) -> None:
    """The hold gauges read the tracker when scraped, under the endpoint's
    ``lock``: kept up to date on every message instead, they cost a scan of
    the held rooms each time, and the quarantine's age went stale between
    messages."""

    def locked(read: Callable[[], float]) -> Callable[[], float]:
        def value() -> float:
            with lock:
                return read()

        return value

    tracker, held, quarantined = state.tracker, HoldState.HELD, HoldState.QUARANTINED
    metrics.rooms_held.set_function(
        locked(lambda: len(tracker.rooms_in(held)) + len(tracker.rooms_in(quarantined)))
    )
    metrics.pages_held.set_function(locked(state.held_pages))
    metrics.pages_quarantined.set_function(locked(lambda: tracker.pages_in(quarantined)))
    metrics.quarantine_age.set_function(locked(lambda: tracker.oldest_quarantine(clock())))
    metrics.acks_draining.set_function(locked(lambda: len(state.draining)))
    metrics.endpoint_up.set_function(locked(lambda: 0.0 if state.endpoint_down is not None else 1.0))

    def ranks_up() -> list[tuple[tuple[str, str], float]]:
        with lock:
            return [
                ((str(r), w.address), float(r not in state.down)) for r, w in sorted(state.writers.items())
            ]

    def awaiting() -> list[tuple[tuple[str, str, str], float]]:
        with lock:
            counts = tracker.awaiting()
            return [
                ((str(r), w.address, hold.value), float(counts.get((r, hold), 0)))
                for r, w in sorted(state.writers.items())
                for hold in (held, quarantined)
            ]

    metrics.rank_up.set_function(ranks_up)
    metrics.awaiting_rank.set_function(awaiting)
