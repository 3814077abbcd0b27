"""Control-plane messages: frozen value classes, one tag each on the wire.

Field order is wire order; ``wire.py`` encodes them from the field types.
"""

from __future__ import annotations

import enum

import attrs


class Tag(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    TRANSFER_REQUEST = 3
    ABORT = 4
    ABORT_ACK = 5
    ROOM_STATUS = 6
    RANK_DRAINING = 7


class RoomOutcome(enum.IntEnum):
    SUCCESS = 1
    FAILED = 2


@attrs.frozen(slots=True)
class Hello:
    """Decode -> prefill rank: bootstrap. Who the page owner is, where to
    reply, and how to reach its region through the transport.

    ``layout``: decode's :class:`kvconn.layout.KVLayout` (its ``to_bytes``)
    when its pages lie in engine buffers, from which a rank computes where
    its share of each page goes; empty for a region of ``page_bytes`` pages
    split evenly over ``num_ranks`` ranks."""

    decode: str
    reply_to: str
    backend: str
    page_bytes: int
    num_ranks: int
    abort_timeout_ms: int
    metadata: bytes
    layout: bytes = b""


@attrs.frozen(slots=True)
class HelloAck:
    """Prefill rank -> decode: the rank at ``address`` is connected. ``pid``
    and ``start_time`` identify the writer's process for the proven-exit
    check, which holds only where ``pid_namespace`` (the kernel boot and pid
    namespace the pid belongs to; "" if unknown) is decode's own. A non-empty
    ``error`` means the rank refused the bootstrap (other backend, write
    deadline not shorter than decode's). ``session`` names this rank
    process's control session (random): decode's requests must carry it."""

    rank: int
    address: str
    pid_namespace: str
    pid: int
    start_time: int
    error: str
    session: int


@attrs.frozen(slots=True)
class TransferRequest:
    """Decode -> prefill rank: room ``room`` writes into ``dst_pages``.

    Fresh, not replayed: ``session`` is the one the rank named in its
    HelloAck, and ``seq`` grows with every request of this decode. A frame's
    MAC proves who sent it, not when: a recorded request, sent again after
    the room concluded, would make the rank write into pages decode has
    handed out since."""

    room: int
    decode: str
    dst_pages: tuple[int, ...]
    session: int
    seq: int
    #: 1 + decode's slot for the room's per-room extras (aux data), which
    #: travel with its last chunk; 0: the room has none.
    extras_slot: int = 0
    #: The room's trace context (a W3C ``traceparent``, ASCII), b"": none.
    #: Optional on the wire; what it means is the runtime's, never the protocol's.
    trace: bytes = b""

    @property
    def extras(self) -> int | None:
        """Decode's extras slot for the room, or None."""
        return self.extras_slot - 1 if self.extras_slot else None


@attrs.frozen(slots=True)
class Abort:
    """Decode -> prefill rank: stop writing ``room``; ack generation
    ``generation`` to ``reply_to`` once nothing can land."""

    room: int
    generation: int
    decode: str
    reply_to: str
    #: As :attr:`TransferRequest.trace`.
    trace: bytes = b""


@attrs.frozen(slots=True, order=True)
class TcpConnection:
    """One TCP connection, as the writer's end sees it."""

    local_host: str
    local_port: int
    remote_host: str
    remote_port: int


@attrs.frozen(slots=True)
class AbortAck:
    """Prefill rank -> decode: no write of ``room`` by ``rank`` can land.

    ``fenced`` says the proof came from the writer's fence, and ``closed``
    names the TCP connections that fence closed. Closing a connection does
    not take back the bytes already sent on it: decode counts the ack only
    once its own end of each has drained (a frozen decode resumes with
    megabytes in its socket buffers).

    ``decode`` (the name of the endpoint that sent the ABORT) and ``session``
    (the rank process's, from its HelloAck) say whom it is for and from
    whom: a process that took over the rank's address, or the same address's
    earlier decode, never writes for this decode, and its ack proves nothing
    here. Decode drops an ack that does not match both.
    """

    room: int
    rank: int
    generation: int
    fenced: bool
    decode: str = ""
    session: int = 0
    closed: tuple[TcpConnection, ...] = ()


@attrs.frozen(slots=True)
class RoomStatus:
    """Prefill rank -> decode: the rank finished ``room`` (every chunk landed)
    or failed it (prefill-initiated failure, so decode need not wait).
    ``decode`` and ``session`` as in :class:`AbortAck`: an earlier decode's
    SUCCESS for a reused room id must not hand this decode's pages out."""

    room: int
    rank: int
    outcome: RoomOutcome
    reason: str
    decode: str = ""
    session: int = 0


@attrs.frozen(slots=True)
class RankDraining:
    """Prefill rank -> decode: the rank is draining (``done`` False): it
    takes no new rooms, and refuses each request with a FAILED
    :class:`RoomStatus` whose reason is one of ``protocol.drain.DRAIN_REASONS``;
    or it drained (``done`` True): every room it held for ``decode``
    concluded and nothing it posted is in flight, and it writes nothing more
    in this session, so no write of it can land in decode's pages any more.
    ``closed``: the TCP connections its fences closed (as in
    :class:`AbortAck`): decode counts the proof only with none.

    A tag added within wire version 5: a decode of an earlier build drops it
    as ``unknown_tag`` and still sees every refused room FAILED."""

    rank: int
    session: int
    decode: str
    done: bool
    closed: tuple[TcpConnection, ...] = ()


Message = Hello | HelloAck | TransferRequest | Abort | AbortAck | RoomStatus | RankDraining

TAGS: dict[type[Message], Tag] = {
    Hello: Tag.HELLO,
    HelloAck: Tag.HELLO_ACK,
    TransferRequest: Tag.TRANSFER_REQUEST,
    Abort: Tag.ABORT,
    AbortAck: Tag.ABORT_ACK,
    RoomStatus: Tag.ROOM_STATUS,
    RankDraining: Tag.RANK_DRAINING,
}
