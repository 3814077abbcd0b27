"""A room's spans are in the order things happened, even when a message's
peer acts on it before its sender's thread runs again (a loaded machine
deschedules a thread right after a send; the bench's traces had 6 of 9
``kvconn.rank.ack`` spans starting after decode took the ack, by up to
15.5 ms). Here the peer always wins that race: the sender's send does not
return until the peer acted on the message."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from kvconn.config import Config
from kvconn.hookspecs import hookimpl
from kvconn.plugins import get_backend
from kvconn.protocol.hold import Release
from kvconn.protocol.messages import Abort, AbortAck, Message
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.tracing import finished_spans, memory_exporter, order_errors
from kvconn.testing.waiting import wait_for


def _slow_sender(outbox: Any, kind: type[Message], until: Callable[[], bool]) -> None:
    """``outbox.send`` of a ``kind`` message returns only once ``until()``
    (bounded): the thread that sent it was descheduled that long."""
    send = outbox.send

    def sending(address: str, message: Message) -> bool:
        ok = bool(send(address, message))
        if isinstance(message, kind):
            wait_for(until, 20, f"the peer acting on {kind.__name__}")
        return ok

    outbox.send = sending


class _SawAbort:
    """A hook observer: the rank handled an ABORT (it is called before the ack)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    @hookimpl
    def on_abort_notification(self, abort: Abort, known: bool) -> None:
        self.event.set()


class _PostFailsFenceWaitsForTheAbort:
    """The room's write raises (the rank poisons it and fences), and the
    fence waits until the rank has decode's ABORT: its ack is then sent as
    the fence ends."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.posted = threading.Event()

    @hookimpl
    def on_post(self, chunk: Any, segments: Any) -> object:
        self.posted.set()
        raise RuntimeError("injected: the write fails")

    @hookimpl
    def on_abort_notification(self, abort: Abort, known: bool) -> None:
        self.aborted.set()

    @hookimpl(wrapper=True)
    def on_fence(self) -> Any:
        wait_for(self.aborted.is_set, 20, "decode's abort at the rank")
        return (yield)


def _aborted_room_spans(slow: str) -> list[dict[str, Any]]:
    """One room requested and aborted, with ``slow``'s send (``ack``: the
    rank's ABORT_ACK; ``abort``: decode's ABORT; ``fenced ack``: the ack a
    fence sends) returning only once its peer acted on it; the spans of
    both sides."""
    memory_exporter().clear()
    config = Config(tracing=True)
    rank = PrefillRank(get_backend("loopback"), rank=0, source_bytes=1 << 20, config=config)
    released: list[Release] = []
    decode = DecodeEndpoint(
        get_backend("loopback"),
        num_pages=64,
        page_bytes=4096,
        prefill=[rank.address],
        config=config,
        on_release=released.append,
    )
    fenced = _PostFailsFenceWaitsForTheAbort()
    try:
        if slow in ("ack", "fenced ack"):  # returns once decode took the ack and released the room
            _slow_sender(rank._outbox, AbortAck, lambda: bool(released))
            if slow == "fenced ack":
                rank.pm.register(fenced, name="test-fence-waits")
        else:  # returns once the rank handled the abort
            saw = _SawAbort()
            rank.pm.register(saw, name="test-saw-abort")
            _slow_sender(decode._outbox, Abort, saw.event.is_set)
        receiver = decode.receiver(room=42, pages=[0, 1, 2, 3])
        wait_for(lambda: rank.requesting_tp(42) is not None, 20, "the request at the rank")
        if slow == "fenced ack":
            rank.sender(42).send([0, 1, 2, 3], last=True)  # its post raises: poisoned, fenced
            wait_for(fenced.posted.is_set, 20, "the post that raises")  # before the abort comes
        receiver.abort()
        wait_for(lambda: bool(released), 20, "the release")
        wait_for(
            lambda: any(s["name"] == "kvconn.rank.ack" for s in finished_spans()), 20, "the rank's ack span"
        )
    finally:
        decode.close()
        rank.close()
    assert released[0].proof.value == ("writer_fence" if slow == "fenced ack" else "acks")
    spans = finished_spans()
    assert {s["name"] for s in spans} >= {"kvconn.room", "kvconn.rank.room", "kvconn.rank.ack"}
    if slow == "fenced ack":
        assert "kvconn.rank.fence" in {s["name"] for s in spans}
    return spans


@pytest.mark.parametrize("slow", ["ack", "abort", "fenced ack"])
def test_spans_of_an_aborted_room_are_in_order_when_the_peer_acts_first(slow: str) -> None:
    assert order_errors(_aborted_room_spans(slow)) == []


def _root(*events: dict[str, Any]) -> dict[str, Any]:
    """A room's root span record, 0 to 100 ms."""
    return {
        "name": "kvconn.room",
        "trace_id": "t",
        "span_id": "r",
        "parent_id": None,
        "start_ns": 0,
        "end_ns": 100_000_000,
        "pid": 1,
        "attributes": {},
        "events": list(events),
    }


def test_order_errors_finds_an_ack_span_that_starts_after_decode_took_the_ack() -> None:
    root = _root(
        {
            "name": "kvconn.ack",
            "time_ns": 50_000_000,
            "attributes": {"kvconn.rank": 0, "kvconn.generation": 1, "kvconn.result": "taken"},
        }
    )
    ack = {
        "name": "kvconn.rank.ack",
        "trace_id": "t",
        "span_id": "a",
        "parent_id": "r",
        "start_ns": 60_000_000,
        "end_ns": 60_000_000,
        "pid": 2,
        "attributes": {"kvconn.rank": 0, "kvconn.generation": 1},
        "events": [],
    }
    (error,) = order_errors([root, ack])
    assert "starts 10.000 ms after decode took it" in error
    assert order_errors([root, {**ack, "start_ns": 40_000_000, "end_ns": 40_000_000}]) == []


def test_order_errors_lets_a_rank_answer_a_repeated_abort_after_the_release() -> None:
    """A rank stopped while decode re-sent its ABORT (a new generation each
    time) answers every copy when it resumes; decode releases on the first
    ack. The repeats' spans end after the root; a first answer that late,
    or another rank's, is still an error."""
    root = _root()

    def rank_span(name: str, span_id: str, at: int) -> dict[str, Any]:
        return {
            "name": name,
            "trace_id": "t",
            "span_id": span_id,
            "parent_id": "r",
            "start_ns": at,
            "end_ns": at,
            "pid": 2,
            "attributes": {"kvconn.rank": 0, "kvconn.generation": 2},
            "events": [],
        }

    first = rank_span("kvconn.rank.ack", "a1", 99_000_000)
    repeats = [
        rank_span("kvconn.rank.abort", "b2", 100_100_000),
        rank_span("kvconn.rank.ack", "a2", 100_200_000),
    ]
    assert order_errors([root, first, *repeats]) == []
    late_first = {**first, "start_ns": 100_050_000, "end_ns": 100_050_000}
    assert order_errors([root, late_first]) == ["kvconn.rank.ack ends 0.050 ms after the root"]
    later_generation = {**repeats[0], "attributes": {"kvconn.rank": 0, "kvconn.generation": 3}}
    assert order_errors([root, first, later_generation]) == []
    other_rank = {**repeats[0], "attributes": {"kvconn.rank": 1, "kvconn.generation": 2}}
    assert order_errors([root, first, other_rank]) == ["kvconn.rank.abort ends 0.100 ms after the root"]


def test_span_ids_do_not_follow_pythons_seeded_random() -> None:
    """Engines seed ``random`` (vLLM: 0 in every worker); the SDK's default
    ids come from it, and decode's and prefill's spans shared ids."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider

    from kvconn.runtime.trace_export import OsRandomIds

    def first_span_id() -> int:
        random.seed(0)
        provider = TracerProvider(id_generator=OsRandomIds())  # type: ignore[arg-type]
        span = provider.get_tracer("t").start_span("s")
        span.end()
        return span.get_span_context().span_id

    assert first_span_id() != first_span_id()
    random.seed(0)
    seeded = TracerProvider().get_tracer("t").start_span("s").get_span_context().span_id
    random.seed(0)
    assert TracerProvider().get_tracer("t").start_span("s").get_span_context().span_id == seeded  # the SDK's
