"""The values of the room ledger (:mod:`kvconn.protocol.ledger`): a room's
status as engines poll it, its key, its entry, the actions the ledger
returns, and the predicates that say when an entry may be replaced or
forgotten."""

from __future__ import annotations

import enum
import sys
from typing import NamedTuple, TypeVar

import attrs

from kvconn.protocol.messages import AbortAck, RoomStatus


class KVPoll(enum.IntEnum):
    """A room's transfer status, as an engine polls it (SGLang's KVPoll)."""

    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4


#: A room requested and not yet concluded either way: its chunks may be written.
LIVE = frozenset({KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING})


@attrs.frozen(slots=True)
class SendAck:
    reply_to: str
    ack: AbortAck


@attrs.frozen(slots=True)
class NotifyDecode:
    decode: str
    status: RoomStatus


LedgerAction = SendAck | NotifyDecode


class RoomKey(NamedTuple):
    """A room at a rank: decode endpoints choose room ids independently, and
    one rank may write the same room id into several decodes (prefill TP
    smaller than decode TP: each decode rank takes a head slice). Counts,
    acks, tombstones, poison and statuses are all per key."""

    decode: str
    room: int


@attrs.define(slots=True)
class _Room:
    status: KVPoll = KVPoll.BOOTSTRAPPING
    #: The decode endpoint of the room (its key's).
    decode: str = ""
    #: Chunks dequeued and not yet settled (invariant D counts here).
    outstanding: int = 0
    #: Of those, chunks whose writes may still land: the room is poisoned.
    stuck: int = 0
    #: Ack targets: decode id -> (reply address, generation).
    targets: dict[str, tuple[str, int]] = attrs.Factory(dict)
    #: (decode id, generation) pairs already acked: at most one ack each.
    acked: set[tuple[str, int]] = attrs.Factory(set)
    cleared: bool = False
    fenced: bool = False
    #: When an idle entry is forgotten (None: not scheduled).
    expires: float | None = None
    #: Made by an ABORT for a room unknown here: its request has not come yet.
    tombstone: bool = False
    #: In the ledger's expiry heap (at most once: a touched room is not pushed again).
    scheduled: bool = False
    #: Which entry for this room id: decode reuses ids (see RoomLedger.incarnation).
    incarnation: int = 0
    #: The sequence number of decode's request for it (0: none yet).
    seq: int = 0
    #: The destination pages of decode's request (None: no request yet):
    #: this incarnation's own, never an earlier request's of the same id.
    dst_pages: tuple[int, ...] | None = None
    #: Decode's extras slot for the room (None: none asked for).
    extras: int | None = None
    #: A sender took it once (see :meth:`RoomLedger.claim`).
    claimed: bool = False
    #: Why it failed, as decode was told ("" while it has not).
    reason: str = ""


#: A ledger entry as handles see it (read-only, see :meth:`RoomLedger.entry`).
RoomEntry = _Room


def _idle(entry: _Room) -> bool:
    return not entry.outstanding and not entry.stuck and not entry.targets


def _reusable(entry: _Room, seq: int) -> bool:
    """Whether a request numbered ``seq`` (of the entry's decode: entries
    are per decode) may replace ``entry``.

    Only a drained entry (nothing counted, nothing stuck, no ack owed): no
    write of it can land, and a chunk still queued for it is skipped (it
    names its incarnation). A Success room always. A Failed one only if it
    is no tombstone (a tombstone stands for a request that has not arrived:
    this may be that very request, late), decode's abort of it was acked
    (decode released its pages only on that proof, so the id's reuse is a
    new request) and the request is newer than the room's own (a replayed
    or reordered one is not)."""
    if not _idle(entry):
        return False
    if entry.status == KVPoll.SUCCESS:
        return True
    return (
        entry.status == KVPoll.FAILED
        and not entry.tombstone
        and 0 < entry.seq < seq
        and any(d == entry.decode for d, _ in entry.acked)
    )


def _expirable(entry: _Room) -> bool:
    """Idle, and either cleared by the engine or a tombstone."""
    return _idle(entry) and (entry.cleared or entry.expires is not None)


# -- the ledger's compact tombstones -------------------------------------------

#: A compact tombstone's acked generation sits above its queue slot's number.
_POS_BITS = 48
_POS_MASK = (1 << _POS_BITS) - 1


class _Pending(NamedTuple):
    """A compact tombstone whose ack is still to be sent."""

    decode: str
    reply_to: str
    generation: int
    pos: int


def _pos(item: int | _Pending) -> int:
    return item.pos if isinstance(item, _Pending) else item & _POS_MASK


_C = TypeVar(
    "_C", dict[RoomKey, _Room], dict[int, dict[str, _Room]], dict[int, "int | _Pending"], set[RoomKey]
)


def _shrunk(container: _C) -> _C:
    """An empty container in place of an emptied one: neither a dict nor a
    set gives its table back as it empties, so an expired storm would keep
    its peak's memory."""
    return type(container)() if sys.getsizeof(container) > 512 else container
