"""Versioned wire form of the control messages.

A frame is ``b"KV" | version:u8 | tag:u8 | body`` and, when the deployment
sets a key, a 32-byte HMAC-SHA256 over everything before it. The body is the
message's fields in declaration order; integers are big-endian u64 (pages
u32), strings and bytes carry a u32 length. Decoding never trusts a length: a
frame that is short, long, oversized, of another version, of an unknown tag
or with a bad MAC raises :class:`FrameError` with a reason the listener counts.

Within a version, a message may end with one optional field (code ``t``):
absent when empty, so a frame that does not use it is byte for byte the
version's frame, and a peer that never sets it still works. When present it
is a u32 length (1 to ``MAX_OPTIONAL``) and its bytes; anything else after
the required fields is ``trailing_bytes``, as before. A peer that predates
the field drops a frame carrying it (``trailing_bytes``): turn on what sets
it only once both sides read it. Trace context travels this way.
"""

from __future__ import annotations

import hashlib
import hmac
import operator
import struct
from collections.abc import Callable
from typing import Any

import attrs

from kvconn.protocol.drops import DropReason
from kvconn.protocol.messages import (
    TAGS,
    Abort,
    AbortAck,
    Hello,
    HelloAck,
    Message,
    RankDraining,
    RoomOutcome,
    RoomStatus,
    Tag,
    TcpConnection,
    TransferRequest,
)

MAGIC = b"KV"
VERSION = 5
MAX_FRAME = 4 << 20
MAX_PAGES = 1 << 20
MAX_CONNECTIONS = 1 << 16
MAC_BYTES = 32
#: The longest optional trailing field (a W3C traceparent is 55 bytes).
MAX_OPTIONAL = 1024

_HEADER = struct.Struct(">2sBB")
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")

#: Field codes: u = u64 int, s = utf-8 str, b = bytes, p = tuple of u32 pages,
#: ? = bool, o = RoomOutcome, c = tuple of TcpConnection; t = optional
#: trailing bytes (last only; see the module's docstring).
_SCHEMA: dict[type[Message], str] = {
    Hello: "sssuuubb",
    HelloAck: "ussuusu",
    TransferRequest: "uspuuut",
    Abort: "uusst",
    AbortAck: "uuu?suc",
    RoomStatus: "uuossu",
    RankDraining: "uus?c",
}
_BY_TAG: dict[int, type[Message]] = {int(tag): cls for cls, tag in TAGS.items()}


class FrameError(ValueError):
    """A frame that cannot be decoded; ``reason`` is a short counter label."""

    def __init__(self, reason: DropReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason
        self.detail = detail


def encode(message: Message, key: bytes | None = None) -> bytes:
    cls = type(message)
    parts = [_HEADER.pack(MAGIC, VERSION, TAGS[cls])]
    for enc, value in zip(_ENCODE[cls], _FIELDS[cls](message), strict=True):
        parts.append(enc(value))
    frame = b"".join(parts)
    if key is not None:
        frame += hmac.digest(key, frame, hashlib.sha256)
    if len(frame) > MAX_FRAME:
        raise ValueError(f"{type(message).__name__} frame of {len(frame)} bytes exceeds {MAX_FRAME}")
    return frame


def decode(frame: bytes, key: bytes | None = None) -> Message:
    if len(frame) > MAX_FRAME:
        raise FrameError(DropReason.OVERSIZE, f"{len(frame)} bytes")
    if key is not None:
        if len(frame) < _HEADER.size + MAC_BYTES:
            # too short to carry a MAC: unauthenticated, like a wrong MAC
            raise FrameError(DropReason.BAD_MAC, "frame too short for a MAC")
        frame, mac = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.digest(key, frame, hashlib.sha256)):
            raise FrameError(DropReason.BAD_MAC)
    if len(frame) < _HEADER.size:
        raise FrameError(DropReason.SHORT)
    magic, version, tag = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise FrameError(DropReason.BAD_MAGIC)
    if version != VERSION:
        raise FrameError(DropReason.BAD_VERSION, str(version))
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise FrameError(DropReason.UNKNOWN_TAG, str(tag))
    reader = _Reader(frame, _HEADER.size)
    try:
        values = [dec(reader) for dec in _DECODE[cls]]
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise FrameError(DropReason.BAD_BODY, f"{cls.__name__}: {exc}") from None
    if _SCHEMA[cls].endswith("t"):
        values.append(_optional(reader, cls.__name__))
    if reader.pos != len(frame):
        raise FrameError(DropReason.TRAILING_BYTES, cls.__name__)
    return cls(*values)


def _optional(r: _Reader, name: str) -> bytes:
    """The optional trailing field: b"" when the frame ends here. Bytes that
    do not form one (a length of 0 is not canonical) are trailing bytes."""
    left = len(r.buf) - r.pos
    if left == 0:
        return b""
    if left >= 4:
        n = r.u32()
        if 0 < n <= MAX_OPTIONAL and n == left - 4:
            return bytes(r.take(n))
    raise FrameError(DropReason.TRAILING_BYTES, name)


def _enc_optional(value: bytes) -> bytes:
    if not value:
        return b""
    if len(value) > MAX_OPTIONAL:
        raise ValueError(f"optional field of {len(value)} bytes exceeds {MAX_OPTIONAL}")
    return _enc_bytes(value)


class _Reader:
    """A frame's fields, one after the other (ints read in place: on every
    message)."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf)

    def take(self, n: int) -> bytes:
        pos = self.pos
        if n < 0 or pos + n > self.end:
            raise ValueError("truncated")
        self.pos = pos + n
        return self.buf[pos : pos + n]

    def u64(self) -> int:
        pos = self.pos
        if pos + 8 > self.end:
            raise ValueError("truncated")
        self.pos = pos + 8
        return int(_U64.unpack_from(self.buf, pos)[0])

    def u32(self) -> int:
        pos = self.pos
        if pos + 4 > self.end:
            raise ValueError("truncated")
        self.pos = pos + 4
        return int(_U32.unpack_from(self.buf, pos)[0])


def _enc_bytes(value: bytes) -> bytes:
    return _U32.pack(len(value)) + value


def _enc_pages(pages: tuple[int, ...]) -> bytes:
    return _U32.pack(len(pages)) + struct.pack(f">{len(pages)}I", *pages)


def _dec_pages(r: _Reader) -> tuple[int, ...]:
    n = r.u32()
    if n > MAX_PAGES:
        raise ValueError(f"{n} pages")
    pos = r.pos
    r.take(0 if n == 0 else 4 * n)  # bounds checked
    return struct.unpack_from(f">{n}I", r.buf, pos)


def _enc_str(value: str) -> bytes:
    return _enc_bytes(value.encode())


def _dec_str(r: _Reader) -> str:
    return r.take(r.u32()).decode("utf-8")


def _enc_connections(conns: tuple[TcpConnection, ...]) -> bytes:
    parts = [_U32.pack(len(conns))]
    for c in conns:
        parts += [
            _enc_str(c.local_host),
            _U32.pack(c.local_port),
            _enc_str(c.remote_host),
            _U32.pack(c.remote_port),
        ]
    return b"".join(parts)


def _dec_connections(r: _Reader) -> tuple[TcpConnection, ...]:
    n = r.u32()
    if n > MAX_CONNECTIONS:
        raise ValueError(f"{n} connections")
    return tuple(TcpConnection(_dec_str(r), r.u32(), _dec_str(r), r.u32()) for _ in range(n))


def _dec_bool(r: _Reader) -> bool:
    b = r.take(1)[0]
    if b > 1:
        raise ValueError(f"bool {b}")
    return b == 1


_ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "u": _U64.pack,
    "s": _enc_str,
    "b": _enc_bytes,
    "p": _enc_pages,
    "?": lambda v: b"\x01" if v else b"\x00",
    "o": lambda v: bytes([int(v)]),
    "c": _enc_connections,
    "t": _enc_optional,
}
_DECODERS: dict[str, Callable[[_Reader], Any]] = {
    "u": _Reader.u64,
    "s": _dec_str,
    "b": lambda r: r.take(r.u32()),
    "p": _dec_pages,
    "?": _dec_bool,
    "o": lambda r: RoomOutcome(r.take(1)[0]),
    "c": _dec_connections,
}

#: Per message type, its fields' encoders and a getter of its fields, in
#: schema order; and its decoders (the optional trailing field apart).
_ENCODE = {cls: tuple(_ENCODERS[code] for code in schema) for cls, schema in _SCHEMA.items()}
_FIELDS = {cls: operator.attrgetter(*(f.name for f in attrs.fields(cls))) for cls in _SCHEMA}
_DECODE = {
    cls: tuple(_DECODERS[code] for code in (schema[:-1] if schema.endswith("t") else schema))
    for cls, schema in _SCHEMA.items()
}

__all__ = ["FrameError", "Tag", "decode", "encode", "MAX_FRAME", "VERSION"]
