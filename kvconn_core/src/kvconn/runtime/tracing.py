"""Per-room tracing with OpenTelemetry: the glue between the runtime and the
``opentelemetry-api`` package (the ``kvconn-core[trace]`` extra).

One trace per room: decode opens the room's span (``kvconn.room``) when the
engine asks for it and ends it when the pages go back (``finish()``, or a
release, with its proof); the room's :class:`TransferRequest` and every
:class:`Abort` carry its W3C ``traceparent`` (their optional ``trace``
field), and each prefill rank parents its spans on it: ``kvconn.rank.room``
(request to the rank's status or first ack, with its chunk count),
``kvconn.rank.ack`` for each ABORT_ACK it sends, ``kvconn.rank.fence`` for
each room a fence settled. Nothing per chunk: a rank's room span carries
the count.

The protocol core never sees any of it: the runtime calls these tracers
when it carries out an action. Tracing is off unless ``Config.tracing``;
off, or without the package, every call is a no-op method of
:class:`NoTracer`. A context that does not parse is dropped (the message is
still handled) and counted in ``kvconn_trace_contexts_dropped_total``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from kvconn.protocol.endpoint_events import Drop, RoomFailed, Send
from kvconn.protocol.hold import Quarantine, Release
from kvconn.protocol.ledger import RoomKey
from kvconn.protocol.messages import Abort, AbortAck, Message, RoomStatus, TransferRequest
from kvconn.protocol.rank import Drop as RankDrop

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
A = TypeVar("A")

#: Rooms whose spans or contexts a tracer keeps at most: a room the engine
#: never finishes must not grow it without bound (its span is ended, marked).
MAX_ROOMS = 65536
TRACER_NAME = "kvconn"


def _tracer() -> Tracer | None:
    try:
        from opentelemetry import trace
    except ImportError:
        log.warning(
            "Config.tracing is on but opentelemetry-api is not installed: pip install 'kvconn-core[trace]'"
        )
        return None
    return trace.get_tracer(TRACER_NAME)


def room_id(room: int) -> int | str:
    """A room id as a span attribute: OpenTelemetry's integers are signed 64-bit
    (an exporter refuses a larger one, and the batch with it), room ids u64."""
    return room if room < 1 << 63 else str(room)


def _traceparent(span: Span) -> bytes:
    """``span``'s W3C traceparent; b"" for a span that records nothing."""
    sc = span.get_span_context()
    if not sc.is_valid:
        return b""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}".encode()


def parse_traceparent(value: bytes) -> Context | None:
    """The context ``value`` names, or None if it is not a valid traceparent."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    ctx = TraceContextTextMapPropagator().extract({"traceparent": text})
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


class _Bounded(OrderedDict[Any, Any]):
    """Insertion-ordered, at most :data:`MAX_ROOMS`; ``on_evict`` sees what falls out."""

    def __init__(self, on_evict: Callable[[Any], None] = lambda _: None) -> None:
        super().__init__()
        self._on_evict = on_evict

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        while len(self) > MAX_ROOMS:
            self._on_evict(self.popitem(last=False)[1])


def _end_evicted(span: Span) -> None:
    span.set_attribute("kvconn.evicted", True)
    span.end()


@attrs.define(slots=True)
class _RankRoom:
    span: Span
    chunks: int = 0


class NoTracer:
    """Tracing off: every call does nothing (and costs a method call)."""

    enabled = False

    def now(self) -> int:
        """The span clock's time (Unix epoch ns), read just before a message
        goes out: what :meth:`abort_sent`, :meth:`acked` and :meth:`notified`
        are given, so that no span or event of the sender dates after what the
        message caused at its peer (0 with tracing off)."""
        return 0

    # -- decode ------------------------------------------------------------
    def opened(self, room: int, pages: int, ranks: Sequence[int], decode: str) -> None:
        pass

    def outgoing(self, message: M) -> M:
        return message

    def received(self, msg: Message, actions: Sequence[object]) -> None:
        pass

    def carried(self, action: object) -> None:
        pass

    def abort_sent(self, action: Send, sent_ns: int) -> None:
        pass

    def aborted(self, room: int) -> None:
        pass

    def finished(self, room: int) -> None:
        pass

    # -- prefill -----------------------------------------------------------
    def request(self, msg: Message, rank: int, actions: list[A]) -> list[A]:
        return actions

    def landed(self, key: RoomKey) -> None:
        pass

    def acked(self, ack: AbortAck, rank: int, sent_ns: int) -> None:
        pass

    def notified(self, decode: str, status: RoomStatus, sent_ns: int) -> None:
        pass

    def contexts(self, rooms: frozenset[RoomKey]) -> list[tuple[RoomKey, Context]]:
        """(Under the rank's lock.) The trace contexts of those of ``rooms`` that have one."""
        return []

    @contextmanager
    def fence(
        self, contexts: list[tuple[RoomKey, Context]], rooms: int, rank: int
    ) -> Iterator[dict[str, Any]]:
        yield {}

    def close(self) -> None:
        """The endpoint closed: end the spans still open (an unended span is never exported)."""


NO_TRACER = NoTracer()


class DecodeTracer(NoTracer):
    """A decode endpoint's room spans (called under the endpoint's lock)."""

    enabled = True

    def now(self) -> int:
        return time.time_ns()  # the SDK's span clock

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._spans: _Bounded = _Bounded(_end_evicted)
        self._parents: dict[int, bytes] = {}

    def opened(self, room: int, pages: int, ranks: Sequence[int], decode: str) -> None:
        span = self._tracer.start_span(
            "kvconn.room",
            attributes={
                "kvconn.room": room_id(room),
                "kvconn.pages": pages,
                "kvconn.ranks": list(ranks),
                "kvconn.decode": decode,
            },
        )
        self._spans.put(room, span)

    def outgoing(self, message: M) -> M:
        if isinstance(message, TransferRequest | Abort):
            span = self._spans.get(message.room)
            if span is not None:
                return attrs.evolve(message, trace=_traceparent(span))
        return message

    def received(self, msg: Message, actions: Sequence[object]) -> None:
        if not isinstance(msg, AbortAck | RoomStatus):
            return
        span = self._spans.get(msg.room)
        if span is None:
            return
        dropped = [str(a.reason) for a in actions if isinstance(a, Drop)]
        result = f"dropped:{dropped[0]}" if dropped else "taken"
        if isinstance(msg, AbortAck):
            span.add_event(
                "kvconn.ack",
                {
                    "kvconn.rank": msg.rank,
                    "kvconn.generation": msg.generation,
                    "kvconn.fenced": msg.fenced,
                    "kvconn.closed_connections": len(msg.closed),
                    "kvconn.result": result,
                },
            )
        else:
            span.add_event(
                "kvconn.status",
                {
                    "kvconn.rank": msg.rank,
                    "kvconn.outcome": msg.outcome.name.lower(),
                    "kvconn.reason": msg.reason,
                    "kvconn.result": result,
                },
            )

    def carried(self, action: object) -> None:
        if isinstance(action, Release):
            span = self._spans.pop(action.room, None)
            if span is not None:
                proof = action.proof.value
                span.add_event(
                    "kvconn.release",
                    {
                        "kvconn.proof": proof,
                        "kvconn.held_s": action.held_for,
                        "kvconn.quarantined_s": action.quarantined_for,
                    },
                )
                span.set_attribute("kvconn.proof", proof)
                span.end()
        elif isinstance(action, Quarantine):
            span = self._spans.get(action.room)
            if span is not None:
                span.add_event("kvconn.quarantine", {"kvconn.pages": len(action.pages)})
        elif isinstance(action, RoomFailed):
            span = self._spans.get(action.room)
            if span is not None:
                span.add_event("kvconn.room_failed", {"kvconn.cause": action.cause})

    def abort_sent(self, action: Send, sent_ns: int) -> None:
        """An ABORT went out; ``sent_ns``: :meth:`now` just before the send
        (the rank may take it, and record it, before this thread runs again)."""
        assert isinstance(action.message, Abort)
        span = self._spans.get(action.message.room)
        if span is not None:
            rank = -1 if action.rank is None else action.rank
            span.add_event(
                "kvconn.abort_sent",
                {"kvconn.rank": rank, "kvconn.generation": action.message.generation},
                timestamp=sent_ns,
            )

    def aborted(self, room: int) -> None:
        span = self._spans.get(room)
        if span is not None:
            span.add_event("kvconn.abort")

    def finished(self, room: int) -> None:
        span = self._spans.pop(room, None)
        if span is not None:
            span.set_attribute("kvconn.outcome", "finished")
            span.end()

    def close(self) -> None:
        while self._spans:
            span = self._spans.popitem()[1]
            span.set_attribute("kvconn.outcome", "open at close")
            span.end()


class RankTracer(NoTracer):
    """A prefill rank's spans, parented on the contexts decode's messages carry."""

    enabled = True

    def __init__(self, tracer: Tracer, on_bad_context: Callable[[], None]) -> None:
        self._tracer = tracer
        self._on_bad_context = on_bad_context
        #: (decode, room) -> the context decode's last message for it carried.
        self._contexts: _Bounded = _Bounded()
        #: (decode, room) -> the rank's open room span and its chunks landed.
        self._spans: _Bounded = _Bounded(lambda room: _end_evicted(room.span))

    def request(self, msg: Message, rank: int, actions: list[A]) -> list[A]:
        """(Under the rank's lock, before ``actions``, the rank's answer to
        ``msg``, are carried out.) A request's span starts, an abort is noted."""
        if not isinstance(msg, TransferRequest | Abort) or not msg.trace:
            return actions
        ctx = parse_traceparent(msg.trace)
        if ctx is None:
            self._on_bad_context()
            return actions
        if any(isinstance(a, RankDrop) for a in actions):
            return actions  # a stale or stranger's message: not this room's
        self._trace(msg, rank, ctx)
        return actions

    def _trace(self, msg: TransferRequest | Abort, rank: int, ctx: Context) -> None:
        key = RoomKey(msg.decode, msg.room)
        self._contexts.put(key, ctx)
        attributes: dict[str, str | int] = {
            "kvconn.room": room_id(msg.room),
            "kvconn.rank": rank,
            "kvconn.decode": msg.decode,
        }
        if isinstance(msg, TransferRequest):
            self._conclude(key, "replaced")
            attributes["kvconn.pages"] = len(msg.dst_pages)
            span = self._tracer.start_span("kvconn.rank.room", context=ctx, attributes=attributes)
            self._spans.put(key, _RankRoom(span))
            return
        attributes["kvconn.generation"] = msg.generation
        room = self._spans.get(key)
        if room is not None:
            room.span.add_event("kvconn.abort_received", {"kvconn.generation": msg.generation})
        else:  # the rank never saw the request (or concluded it): the abort is its own span
            self._tracer.start_span("kvconn.rank.abort", context=ctx, attributes=attributes).end()

    def landed(self, key: RoomKey) -> None:
        """(Under the rank's lock.) One chunk of ``key`` landed."""
        room = self._spans.get(key)
        if room is not None:
            room.chunks += 1

    def now(self) -> int:
        return time.time_ns()  # the SDK's span clock

    def acked(self, ack: AbortAck, rank: int, sent_ns: int) -> None:
        """(Under the rank's lock.) ``ack`` was sent; ``sent_ns``: :meth:`now`
        just before. The ack's span starts there, and the room's span ends
        there: decode may take the ack (its ``kvconn.ack`` event) before
        this thread runs again, and no span of the rank may start after
        what it caused at decode."""
        key = RoomKey(ack.decode, ack.room)
        ctx = self._contexts.get(key)
        if ctx is None:
            return
        self._conclude(key, "acked", sent_ns)
        attributes = {
            "kvconn.room": room_id(ack.room),
            "kvconn.rank": rank,
            "kvconn.generation": ack.generation,
            "kvconn.fenced": ack.fenced,
            "kvconn.closed_connections": len(ack.closed),
        }
        # A point in time: the send itself is queued, decode takes it on its own.
        self._tracer.start_span(
            "kvconn.rank.ack", context=ctx, attributes=attributes, start_time=sent_ns
        ).end(end_time=sent_ns)

    def notified(self, decode: str, status: RoomStatus, sent_ns: int) -> None:
        """(Under the rank's lock.) ``status`` was sent to ``decode``
        (``sent_ns``: :meth:`now` just before): the room's span ends there."""
        self._conclude(RoomKey(decode, status.room), status.outcome.name.lower(), sent_ns, status.reason)

    def close(self) -> None:
        for key in list(self._spans):
            self._conclude(key, "open at close")

    def _conclude(self, key: RoomKey, outcome: str, end_ns: int | None = None, reason: str = "") -> None:
        room = self._spans.pop(key, None)
        if room is None:
            return
        span = room.span
        span.set_attribute("kvconn.chunks", room.chunks)
        span.set_attribute("kvconn.outcome", outcome)
        if reason:
            span.set_attribute("kvconn.reason", reason)
        span.end(end_time=end_ns)

    def contexts(self, rooms: frozenset[RoomKey]) -> list[tuple[RoomKey, Context]]:
        return [(key, ctx) for key in sorted(rooms) if (ctx := self._contexts.get(key)) is not None]

    @contextmanager
    def fence(
        self, contexts: list[tuple[RoomKey, Context]], rooms: int, rank: int
    ) -> Iterator[dict[str, Any]]:
        """Around a fence of ``rooms`` rooms (outside the rank's lock): one
        ``kvconn.rank.fence`` span in the trace of each of ``contexts``; the
        caller fills in what it found (``result``, ``closed``)."""
        found: dict[str, Any] = {}
        spans = [
            self._tracer.start_span(
                "kvconn.rank.fence",
                context=ctx,
                attributes={"kvconn.room": room_id(key.room), "kvconn.rank": rank, "kvconn.rooms": rooms},
            )
            for key, ctx in contexts
        ]
        try:
            yield found
        finally:
            for span in spans:
                span.set_attribute("kvconn.result", str(found.get("result", "failed")))
                span.set_attribute("kvconn.closed_connections", int(found.get("closed", 0)))
                span.end()


def decode_tracer(enabled: bool) -> NoTracer:
    """A decode endpoint's tracer: :data:`NO_TRACER` unless ``enabled`` and
    ``opentelemetry-api`` is installed."""
    tracer = _tracer() if enabled else None
    return NO_TRACER if tracer is None else DecodeTracer(tracer)


def rank_tracer(enabled: bool, on_bad_context: Callable[[], None]) -> NoTracer:
    """A prefill rank's tracer, as :func:`decode_tracer`."""
    tracer = _tracer() if enabled else None
    return NO_TRACER if tracer is None else RankTracer(tracer, on_bad_context)


__all__ = ["MAX_ROOMS", "NO_TRACER", "DecodeTracer", "NoTracer", "RankTracer", "decode_tracer", "rank_tracer"]
