"""The engine's handle on one request for a room at decode
(:class:`Receiver`): its verdict, abort, finish and where its pages are. It
acts through its :class:`~kvconn.runtime.decode.DecodeEndpoint`'s state
machine, one :meth:`~kvconn.runtime.decode.DecodeEndpoint.step` per call
(under that endpoint's lock)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconn.protocol import drain
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import Action, Request
from kvconn.protocol.hold import HoldState
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.tracing import NO_TRACER, NoTracer

if TYPE_CHECKING:
    from kvconn.runtime.decode import DecodeEndpoint


class Receiver:
    """The engine's handle on one request for a room at decode (like
    SGLang's KVReceiver).

    It belongs to its own request: once the room id is reused by a newer
    request, this handle's ``abort()`` does nothing, its ``poll()`` keeps its
    own verdict and its ``finish()`` raises, never acting on the newer one.
    """

    def __init__(self, endpoint: DecodeEndpoint, request: Request, tracer: NoTracer = NO_TRACER) -> None:
        self._endpoint = endpoint
        self._request = request
        self._tracer = tracer
        self.room = request.room

    def poll(self) -> KVPoll:
        """TRANSFERRING until every rank reported every chunk landed
        (SUCCESS) or the room failed (FAILED); then that, for good, except
        that abort() makes it FAILED (for good)."""
        return self._endpoint.poll(self._request)

    def failure(self) -> str | None:
        """Why the room failed, as a rank or this endpoint said (None: no
        reason given, or not failed)."""
        return self._endpoint.step(lambda state, now: (self._request.failure, ()))

    def abort(self) -> None:
        """Give the room up. Its pages come back through ``on_release`` once
        proven free (at once if every rank already completed). Does nothing
        once the pages are the engine's (after finish()) or already on their
        way back."""

        def abort(state: EndpointState, now: float) -> tuple[None, list[Action]]:
            actions = state.abort(self._request, now)
            if actions:  # this request's own: a handle on an earlier one changes nothing
                self._tracer.aborted(self.room)
            return None, actions

        self._endpoint.step(abort)

    def finish(self) -> tuple[int, ...]:
        """Take a completed room's pages (poll() said SUCCESS). Raises
        :class:`~kvconn.errors.FinishRefusedError` (a
        :class:`~kvconn.errors.RoomStateError` and a ValueError) if it is not
        completed, was aborted, or was finished already."""

        def finish(state: EndpointState, now: float) -> tuple[tuple[int, ...], tuple[()]]:
            pages = state.finish(self._request)
            self._tracer.finished(self.room)
            return pages, ()

        return self._endpoint.step(finish)

    @property
    def draining(self) -> bool:
        """The room failed because an instance drains (its prefill rank, or
        this endpoint): route the request elsewhere or recompute it, it is
        no fault (reasons: ``kvconn.protocol.drain.DRAIN_REASONS``)."""
        return self._endpoint.step(lambda state, now: (self._request.failure in drain.DRAIN_REASONS, ()))

    def state(self) -> HoldState | None:
        """Where the room's pages are (None: back with the engine)."""
        return self._endpoint.step(lambda state, now: (state.hold_state(self._request), ()))
