"""The control-message wire form, byte for byte, and every refusal by name.

Fast and deterministic (the fuzz tests in tests/fuzz cover random input):
the layout is pinned, so a change to a field's encoding, an off-by-one in a
bound or a wrong refusal reason fails here (issue 25, mutation testing).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import attrs
import pytest

from kvconn.protocol import wire
from kvconn.protocol.messages import (
    Abort,
    AbortAck,
    Hello,
    HelloAck,
    Message,
    RankDraining,
    RoomOutcome,
    RoomStatus,
    TcpConnection,
    TransferRequest,
)

KEY = b"k" * 32


def u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def u32(n: int) -> bytes:
    return struct.pack(">I", n)


def text(s: str) -> bytes:
    return u32(len(s.encode())) + s.encode()


def header(tag: int) -> bytes:
    return b"KV" + bytes([wire.VERSION, tag])


def refusal(frame: bytes, key: bytes | None = None) -> wire.FrameError:
    with pytest.raises(wire.FrameError) as info:
        wire.decode(frame, key)
    return info.value


CONN = TcpConnection("127.0.0.1", 5000, "::1", 40000)
EXAMPLES: list[tuple[Message, bytes]] = [
    (
        Hello("dec", "tcp://r", "loopback", 4096, 2, 1500, b"\x00\xff", b"L\x01\x02"),
        header(1)
        + text("dec")
        + text("tcp://r")
        + text("loopback")
        + u64(4096)
        + u64(2)
        + u64(1500)
        + u32(2)
        + b"\x00\xff"
        + u32(3)
        + b"L\x01\x02",
    ),
    (
        HelloAck(3, "tcp://a", "ns", 99, 12345, "", 7),
        header(2) + u64(3) + text("tcp://a") + text("ns") + u64(99) + u64(12345) + text("") + u64(7),
    ),
    (
        TransferRequest(9, "dec", (0, 1, 0xFFFFFFFF), 5, 6, 8),
        header(3)
        + u64(9)
        + text("dec")
        + u32(3)
        + u32(0)
        + u32(1)
        + u32(0xFFFFFFFF)
        + u64(5)
        + u64(6)
        + u64(8),
    ),
    (Abort(9, 2, "dé", "tcp://d"), header(4) + u64(9) + u64(2) + text("dé") + text("tcp://d")),
    (
        AbortAck(9, 1, 2, True, "dec", 7, (CONN,)),
        header(5)
        + u64(9)
        + u64(1)
        + u64(2)
        + b"\x01"
        + text("dec")
        + u64(7)
        + u32(1)
        + text("127.0.0.1")
        + u32(5000)
        + text("::1")
        + u32(40000),
    ),
    (
        AbortAck(9, 1, 2, False),
        header(5) + u64(9) + u64(1) + u64(2) + b"\x00" + text("") + u64(0) + u32(0),
    ),
    (
        RoomStatus(9, 1, RoomOutcome.FAILED, "why", "dec", 7),
        header(6) + u64(9) + u64(1) + b"\x02" + text("why") + text("dec") + u64(7),
    ),
    (
        RoomStatus(9, 1, RoomOutcome.SUCCESS, "", "", 0),
        header(6) + u64(9) + u64(1) + b"\x01" + text("") + text("") + u64(0),
    ),
    (
        RankDraining(1, 7, "dec", True, (TcpConnection("::1", 40000, "127.0.0.1", 5000),)),
        header(7)
        + u64(1)
        + u64(7)
        + text("dec")
        + b"\x01"
        + u32(1)
        + text("::1")
        + u32(40000)
        + text("127.0.0.1")
        + u32(5000),
    ),
]


@pytest.mark.parametrize(("message", "frame"), EXAMPLES, ids=lambda v: type(v).__name__)
def test_every_message_has_its_pinned_layout_and_round_trips(message: Message, frame: bytes) -> None:
    assert wire.encode(message) == frame
    assert wire.decode(frame) == message
    keyed = wire.encode(message, KEY)
    assert keyed == frame + hmac.digest(KEY, frame, hashlib.sha256)
    assert wire.decode(keyed, KEY) == message


def test_each_malformed_frame_is_refused_with_its_reason() -> None:
    abort = wire.encode(Abort(1, 2, "d", "r"))
    assert refusal(abort[:3]).reason == "short"
    assert refusal(b"").reason == "short"
    assert refusal(b"XV" + abort[2:]).reason == "bad_magic"
    bad_version = refusal(b"KV\x03" + abort[3:])
    assert (bad_version.reason, str(bad_version)) == ("bad_version", "bad_version: 3")
    assert refusal(header(0) + abort[4:]).reason == "unknown_tag"
    assert str(refusal(header(8) + abort[4:])) == "unknown_tag: 8"
    assert str(refusal(abort[:-1])) == "bad_body: Abort: truncated"  # inside a string
    assert str(refusal(header(4))) == "bad_body: Abort: truncated"  # a header and no body
    trailing = refusal(abort + b"\x00")
    assert (trailing.reason, str(trailing)) == ("trailing_bytes", "trailing_bytes: Abort")


def test_a_field_out_of_its_domain_is_a_bad_body() -> None:
    ack = wire.encode(AbortAck(1, 2, 3, True))
    flag = 4 + 24  # the bool after three u64
    assert wire.decode(ack[:flag] + b"\x01" + ack[flag + 1 :]) == AbortAck(1, 2, 3, True)
    assert "bool 2" in str(refusal(ack[:flag] + b"\x02" + ack[flag + 1 :]))
    status = wire.encode(RoomStatus(1, 2, RoomOutcome.SUCCESS, ""))
    outcome = 4 + 16
    assert refusal(status[:outcome] + b"\x03" + status[outcome + 1 :]).reason == "bad_body"
    bad_utf8 = header(4) + u64(1) + u64(2) + u32(1) + b"\xff" + text("r")
    assert refusal(bad_utf8).reason == "bad_body"


def test_page_and_connection_counts_are_bounded_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    too_many_pages = refusal(header(3) + u64(1) + text("d") + u32(wire.MAX_PAGES + 1))
    assert too_many_pages.reason == "bad_body" and f"{wire.MAX_PAGES + 1} pages" in str(too_many_pages)
    # The connection bound, exactly (lowered: 65536 connections are slow to
    # build, and the bound is read at each decode)
    monkeypatch.setattr(wire, "MAX_CONNECTIONS", 3)
    conn = TcpConnection("", 0, "", 0)
    at_limit = AbortAck(1, 2, 3, True, "d", 4, (conn,) * 3)
    assert wire.decode(wire.encode(at_limit)) == at_limit
    over = wire.encode(attrs.evolve(at_limit, closed=(conn,) * 4))
    too_many = refusal(over)
    assert too_many.reason == "bad_body" and "4 connections" in str(too_many)


def test_a_string_length_beyond_the_frame_is_refused_not_read() -> None:
    frame = header(4) + u64(1) + u64(2) + u32(2) + b"d"
    assert refusal(frame).reason == "bad_body"
    assert refusal(header(4) + u64(1) + u64(2) + u32(1)).reason == "bad_body"


def test_frame_size_limits_are_exact() -> None:
    base = len(wire.encode(Hello("", "", "", 0, 0, 0, b"")))
    largest = Hello("", "", "", 0, 0, 0, b"x" * (wire.MAX_FRAME - base))
    frame = wire.encode(largest)
    assert len(frame) == wire.MAX_FRAME and wire.decode(frame) == largest
    with pytest.raises(ValueError, match=f"^Hello frame of {wire.MAX_FRAME + 1} bytes exceeds"):
        wire.encode(Hello("", "", "", 0, 0, 0, b"x" * (wire.MAX_FRAME - base + 1)))
    # with a key, the MAC counts toward the limit
    with pytest.raises(ValueError, match="exceeds"):
        wire.encode(largest, KEY)
    assert refusal(frame + b"x").reason == "oversize"
    assert str(refusal(frame + b"x")) == f"oversize: {wire.MAX_FRAME + 1} bytes"
    assert refusal(frame + b"x", KEY).reason == "oversize"


def test_a_keyed_frame_needs_its_mac() -> None:
    message = Abort(1, 2, "d", "r")
    keyed = wire.encode(message, KEY)
    assert refusal(keyed, b"other key" * 4).reason == "bad_mac"
    assert refusal(wire.encode(message), KEY).reason == "bad_mac"  # unkeyed frame, keyed reader
    assert refusal(keyed[:-1] + bytes([keyed[-1] ^ 1]), KEY).reason == "bad_mac"
    # a frame too short to hold a MAC says so; one just long enough is checked
    assert str(refusal(b"K" * (4 + wire.MAC_BYTES - 1), KEY)) == "bad_mac: frame too short for a MAC"
    assert str(refusal(b"K" * (4 + wire.MAC_BYTES), KEY)) == "bad_mac"
    # a keyed frame read without the key: its MAC is trailing garbage
    assert refusal(keyed).reason == "trailing_bytes"
