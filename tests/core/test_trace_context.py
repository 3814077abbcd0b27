"""Trace context on the wire and in the runtime's tracers: an optional
trailing field (a frame without it is the version's frame, byte for byte), a
context that does not parse dropped and counted, and kvconn working with
tracing off or without OpenTelemetry at all."""

from __future__ import annotations

import struct
import subprocess
import sys

import attrs
import pytest

from kvconn.protocol import wire
from kvconn.protocol.messages import Abort, AbortAck, TransferRequest
from kvconn.runtime import tracing

TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def u32(n: int) -> bytes:
    return struct.pack(">I", n)


@pytest.mark.parametrize(
    "message",
    [TransferRequest(9, "dec", (0, 1), 5, 6, 8), Abort(9, 2, "dec", "tcp://d")],
    ids=lambda m: type(m).__name__,
)
def test_trace_context_is_an_optional_trailing_field(message: TransferRequest | Abort) -> None:
    plain = wire.encode(message)
    traced = wire.encode(attrs.evolve(message, trace=TRACEPARENT))
    # a peer that never sets it sends the frame it always sent
    assert traced == plain + u32(len(TRACEPARENT)) + TRACEPARENT
    assert wire.decode(plain) == message
    assert wire.decode(traced).trace == TRACEPARENT  # type: ignore[union-attr]
    # an empty field written out is not canonical, and a length that does not
    # account for the rest of the frame is not the field: both trailing bytes
    for bad in (plain + u32(0), plain + u32(5) + b"abc", plain + b"\x00", traced + b"x"):
        with pytest.raises(wire.FrameError) as info:
            wire.decode(bad)
        assert info.value.reason == "trailing_bytes"
    longest = attrs.evolve(message, trace=b"x" * wire.MAX_OPTIONAL)
    assert wire.decode(wire.encode(longest)) == longest
    too_long = plain + u32(wire.MAX_OPTIONAL + 1) + b"x" * (wire.MAX_OPTIONAL + 1)
    with pytest.raises(wire.FrameError):
        wire.decode(too_long)
    with pytest.raises(ValueError, match="exceeds"):
        wire.encode(attrs.evolve(message, trace=b"x" * (wire.MAX_OPTIONAL + 1)))


def test_messages_without_the_field_keep_refusing_trailing_bytes() -> None:
    ack = wire.encode(AbortAck(9, 1, 2, False))
    with pytest.raises(wire.FrameError) as info:
        wire.decode(ack + u32(len(TRACEPARENT)) + TRACEPARENT)
    assert info.value.reason == "trailing_bytes"


def test_tracing_off_is_the_no_op_tracer() -> None:
    assert tracing.decode_tracer(False) is tracing.NO_TRACER
    assert tracing.rank_tracer(False, lambda: None) is tracing.NO_TRACER
    request = TransferRequest(9, "dec", (0,), 5, 6)
    assert tracing.NO_TRACER.outgoing(request) is request


def test_kvconn_runs_without_opentelemetry_and_tracing_on_is_a_warned_no_op() -> None:
    # A process where `import opentelemetry` fails: endpoints with tracing on
    # still transfer a room (in process, loopback) and trace nothing.
    script = """
import sys, logging
sys.modules["opentelemetry"] = None
logging.basicConfig(level=logging.WARNING)
from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.runtime import tracing
from kvconn.protocol.ledger import KVPoll
from kvconn.testing.waiting import wait_for
cfg = Config(tracing=True)
rank = PrefillRank(get_backend("loopback"), 0, 4 * 4096, cfg, on_request=lambda room, n: None)
dec = DecodeEndpoint(get_backend("loopback"), 4, 4096, [rank.address], cfg)
assert dec._tracer is tracing.NO_TRACER and rank._tracer is tracing.NO_TRACER
rx = dec.receiver(1, [0, 1])
wait_for(lambda: rank.requesting_tp(1) is not None, 10, "request")
sender = rank.sender(1)
sender.send([0, 1], last=True)
wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 10, "room")
rx.finish()
dec.close(); rank.close()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert "opentelemetry-api is not installed" in out.stderr


def test_a_traced_decode_and_an_untraced_rank_work_together() -> None:
    pytest.importorskip("opentelemetry.sdk.trace")
    from kvconn.config import Config
    from kvconn.plugins import get_backend
    from kvconn.protocol.ledger import KVPoll
    from kvconn.runtime.decode import DecodeEndpoint
    from kvconn.runtime.prefill import PrefillRank
    from kvconn.testing.tracing import finished_spans, memory_exporter
    from kvconn.testing.waiting import wait_for

    memory_exporter().clear()
    rank = PrefillRank(get_backend("loopback"), 0, 4 * 4096, Config(), on_request=lambda room, n: None)
    released: list[object] = []
    dec = DecodeEndpoint(
        get_backend("loopback"), 4, 4096, [rank.address], Config(tracing=True), on_release=released.append
    )
    try:
        rx = dec.receiver(1, [0, 1])
        wait_for(lambda: rank.requesting_tp(1) is not None, 10, "request")
        rank.sender(1).send([0, 1], last=True)
        wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 10, "room written")
        rx.finish()
        aborted = dec.receiver(2, [2, 3])
        wait_for(lambda: rank.requesting_tp(2) is not None, 10, "request")
        aborted.abort()
        wait_for(lambda: bool(released), 10, "release")
    finally:
        dec.close()
        rank.close()
    spans = finished_spans()
    assert sorted(s["attributes"]["kvconn.room"] for s in spans) == [1, 2]  # decode's only
    assert {s["name"] for s in spans} == {"kvconn.room"}
    assert rank.metrics.value("kvconn_dropped_messages_total", reason="trailing_bytes") == 0


def test_a_context_that_does_not_parse_is_dropped_counted_and_the_message_still_handled() -> None:
    pytest.importorskip("opentelemetry.sdk.trace")
    from kvconn.protocol.drops import DropReason
    from kvconn.protocol.rank import Drop, Requested

    bad: list[int] = []
    tracer = tracing.rank_tracer(True, lambda: bad.append(1))
    assert isinstance(tracer, tracing.RankTracer)
    actions: list[object] = [Requested(9, 2)]
    for junk in (b"nonsense", b"\xff\xfe", b"00-" + b"0" * 32 + b"-" + b"0" * 16 + b"-01", TRACEPARENT[:-3]):
        msg = TransferRequest(9, "dec", (0, 1), 5, 6, trace=junk)
        assert tracer.request(msg, 0, actions) is actions  # the rank's answer goes on unchanged
    assert len(bad) == 4
    assert not tracer._spans
    # a good context starts the rank's room span; a dropped request starts none
    tracer.request(TransferRequest(9, "dec", (0, 1), 5, 6, trace=TRACEPARENT), 0, actions)
    assert len(tracer._spans) == 1
    tracer.request(
        TransferRequest(10, "dec", (0,), 5, 7, trace=TRACEPARENT), 0, [Drop(DropReason.STALE_REQUEST)]
    )
    assert len(tracer._spans) == 1
    tracer.close()
    assert not tracer._spans


def test_a_tracer_keeps_at_most_max_rooms(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.sdk.trace")
    monkeypatch.setattr(tracing, "MAX_ROOMS", 3)
    tracer = tracing.decode_tracer(True)
    assert isinstance(tracer, tracing.DecodeTracer)
    for room in range(5):
        tracer.opened(room, 1, [0], "dec")
    assert list(tracer._spans) == [2, 3, 4]  # the oldest ended (marked evicted), not kept
    tracer.close()


def test_room_ids_past_int64_are_strings_in_attributes() -> None:
    # OpenTelemetry's integers are signed 64-bit; room ids are u64
    assert tracing.room_id((1 << 63) - 1) == (1 << 63) - 1
    assert tracing.room_id(1 << 63) == str(1 << 63)
    assert tracing.room_id((1 << 64) - 1) == str((1 << 64) - 1)
