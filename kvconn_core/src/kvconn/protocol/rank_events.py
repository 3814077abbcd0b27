"""What :class:`~kvconn.protocol.rank.RankState` takes and gives: the
values its stimuli carry (a bootstrap's pairing, a chunk's end), the actions
it returns, and its records of decodes and senders. All plain values."""

from __future__ import annotations

import enum
from typing import Any, Generic, NamedTuple, TypeVar

import attrs

from kvconn.protocol.drain import Announce
from kvconn.protocol.drops import DropReason
from kvconn.protocol.ledger import KVPoll, LedgerAction, RoomEntry, RoomKey
from kvconn.protocol.messages import Abort, Hello

#: The layout of a decode's pages as the runtime lowers chunks with it
#: (opaque here: only compared, never read).
L = TypeVar("L")


# -- what the runtime tells the machine ----------------------------------------
@attrs.frozen(slots=True)
class WriterTerms:
    """What this rank's writer offers a decode, fixed for the rank's life."""

    #: The transport's name: a decode of another transport is refused.
    backend: str
    #: The rank's write deadline: it must be shorter than decode's abort
    #: deadline, or decode quarantines rooms a live writer still writes.
    write_timeout_s: float
    #: The transport's own longest wait for a write (None: no limit of its own).
    max_write_timeout_s: float | None = None
    #: The writer's fence is proven (``Capabilities.writer_fence``): only
    #: then does a fence settle a poisoned room.
    writer_fence: bool = False


@attrs.frozen(slots=True)
class Pairing(Generic[L]):
    """How this rank's pages pair with a decode's that said Hello, as the
    runtime worked it out from both layouts."""

    #: How a chunk is lowered into that decode (None: the two do not fit).
    layout: L | None
    #: Why they do not fit ("" when they do).
    misfit: str = ""
    #: The decode's tensor-parallel size (1 for a decode of equal page shards).
    tp_size: int = 1
    #: The source pages a chunk for that decode may name: 0 .. source_pages-1.
    source_pages: int = 0
    #: Whether this rank writes that decode's per-room extras (then a last
    #: chunk names a source slot below ``extras_slots``); None: the pair has
    #: no extras at all (a region of equal shards).
    writes_extras: bool | None = None
    extras_slots: int = 0


class ChunkEnd(enum.Enum):
    """How a counted chunk ended, as the worker saw it (the value is the
    ``outcome`` label of ``kvconn_chunks_total``)."""

    LANDED = "landed"
    SKIPPED = "skipped"
    #: Failed, and the transport proved nothing more of it can land.
    FAILED_SETTLED = "failed_settled"
    #: Failed or late: some bytes may still land.
    UNSETTLED = "unsettled"
    #: A plugin raised with the chunk counted: it may have posted part of it.
    PLUGIN_ERROR = "plugin_error"


# -- actions -----------------------------------------------------------------
@attrs.frozen(slots=True)
class Drop:
    """Count the message as dropped; do nothing else."""

    reason: DropReason


@attrs.frozen(slots=True)
class Requested:
    """Tell the engine decode asked for ``room`` (``npages`` pages)."""

    room: int
    npages: int


@attrs.frozen(slots=True)
class Bootstrap:
    """Pair this rank's layout with the one ``hello`` announces (the
    runtime's layouts), then call :meth:`RankState.bootstrap`."""

    hello: Hello


@attrs.frozen(slots=True)
class Connect:
    """Connect the writer to the decode ``hello`` names (first dropping the
    outbox's connection to ``hello.reply_to`` if ``reset``: another decode
    listened there before), then call :meth:`RankState.connected`."""

    hello: Hello
    pairing: Pairing[Any]
    reset: bool


@attrs.frozen(slots=True)
class AnswerHello:
    """Send ``hello``'s decode a HelloAck: the bootstrap accepted (``error``
    empty) or refused, and why."""

    hello: Hello
    error: str = ""


@attrs.frozen(slots=True)
class AbortHook:
    """Run the plugins' abort hook, then call :meth:`RankState.abort_hooked`
    (the ack waits for it: a raising hook poisons the room)."""

    abort: Abort
    known: bool


@attrs.frozen(slots=True)
class Fence:
    """Run the writer's fence (it waits for every running post), then call
    :meth:`RankState.fence_begins` and :meth:`RankState.fence_ended`:
    nothing else settles a poisoned room."""


@attrs.frozen(slots=True)
class GaveUp:
    """A sender stopped waiting for decode's requests (count it)."""

    room: int


Action = (
    LedgerAction
    | Drop
    | Requested
    | Bootstrap
    | Connect
    | AnswerHello
    | AbortHook
    | Fence
    | GaveUp
    | Announce
)


# -- records -------------------------------------------------------------------
@attrs.define(slots=True, eq=False)
class Peer(Generic[L]):
    """A bootstrapped decode endpoint."""

    reply_to: str
    pairing: Pairing[L]
    #: Its last request's sequence number: a fresh request's is higher.
    last_seq: int = 0

    @property
    def layout(self) -> L:
        assert self.pairing.layout is not None  # only a pair that fits is a peer
        return self.pairing.layout

    @property
    def tp_size(self) -> int:
        return self.pairing.tp_size


@attrs.define(slots=True, eq=False)
class Leg:
    """One decode's request a sender writes: the ledger entry, as the sender
    first saw it (its identity is the request's incarnation)."""

    key: RoomKey
    entry: RoomEntry


@attrs.frozen(slots=True)
class Verdict:
    """How a sender's room ended: SUCCESS or FAILED, with why."""

    status: KVPoll
    #: No chunk of the room is being written any more, at any of its
    #: decodes: the source pages may be reused.
    settled: bool
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status is KVPoll.SUCCESS


@attrs.define(slots=True, eq=False, weakref_slot=True)
class SenderState:
    """The machine's record of one engine sender (see :meth:`RankState.open_sender`)."""

    room: int
    decodes: int
    #: When it stops waiting for decodes' requests (None: never).
    deadline: float | None
    legs: list[Leg] = attrs.Factory(list)
    verdict: KVPoll | None = None
    cleared: bool = False
    gave_up: bool = False
    #: Pages queued so far (into each leg), chunks queued, the last one queued.
    sent: int = 0
    index: int = 0
    last_sent: bool = False
    #: Why the engine failed it ("" if it did not).
    reason: str = ""


class LegChunk(NamedTuple):
    """One leg's share of a chunk to queue: tagged with its incarnation. A
    tuple, not an attrs value: one is made on every send."""

    key: RoomKey
    incarnation: int
    dst_pages: tuple[int, ...]
    #: decode's extras slot, on a last chunk whose extras this rank writes
    extras: int | None
    #: the pair's layout (the Pairing's ``L``: how the chunk is lowered)
    layout: Any


class SendPlan(NamedTuple):
    """A checked send, not yet queued (:meth:`RankState.commit_send`). A
    tuple, not an attrs value: one is made on every send."""

    #: the chunk's number in its room (``Chunk.index``)
    chunk_index: int
    last: bool
    npages: int
    legs: tuple[LegChunk, ...]
    #: this rank's extras slot, copied into each leg's ``extras`` slot
    extras_slot: int | None = None


__all__ = [
    "AbortHook",
    "Action",
    "AnswerHello",
    "Bootstrap",
    "ChunkEnd",
    "Connect",
    "Drop",
    "Fence",
    "GaveUp",
    "Leg",
    "LegChunk",
    "Pairing",
    "Peer",
    "Requested",
    "SendPlan",
    "SenderState",
    "Verdict",
    "WriterTerms",
]
