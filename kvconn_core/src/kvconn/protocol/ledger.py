"""The prefill rank's room ledger: the writer side of the protocol, sans-I/O.

Stimuli are method calls; each returns the actions the caller must carry out
(send an ack, tell decode a room's outcome). The caller serialises calls (one
lock or one owning thread): "register, then try to ack" is free of lost
wake-ups only if a worker's "uncount, then try to ack" cannot run inside it.

The two invariants are properties of this module's shape, not of its callers:

* **D**: :meth:`RoomLedger.dequeue` counts the chunk *then* looks at the
  status; there is no other way to learn whether a chunk may be written.
* **F**: :meth:`RoomLedger.abort` marks the room Failed *then* registers the
  ack target; there is no other way to register one. And :meth:`_try_ack`
  still demands Failed, so dropping either guard alone is not enough to ack
  early.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from typing import NamedTuple

import attrs

from kvconn.protocol.messages import Abort, AbortAck, RoomOutcome, RoomStatus


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


class RoomLedger:
    """Per-rank bookkeeping of rooms, counts and ack targets."""

    def __init__(self, rank: int, tombstone_ttl: float = 600.0, session: int = 0) -> None:
        self.rank = rank
        self.session = session  #: the rank process's, named in every ack and status
        self.tombstone_ttl = tombstone_ttl
        self._rooms: dict[RoomKey, _Room] = {}
        #: The decodes each room id is requested by (or aborted, failed for).
        self._by_room: dict[int, dict[str, _Room]] = {}
        self._poisoned: set[RoomKey] = set()
        #: Rooms changed since the last expire(): only they can have become
        #: expirable, so expire() never walks the thousands of acked rooms
        #: that wait out their TTL (it runs on every control message).
        self._touched: set[RoomKey] = set()
        self._expiry: list[tuple[float, int, RoomKey, _Room]] = []  # (expires, seq, key, entry)
        self._seq = 0
        self._incarnations = itertools.count(1)

    # -- queries -----------------------------------------------------------
    def status(self, key: RoomKey) -> KVPoll | None:
        entry = self._rooms.get(key)
        return entry.status if entry is not None else None

    def incarnation(self, key: RoomKey) -> int | None:
        """Which entry ``key`` has now (None: none). Decode reuses a room id
        once the room concluded: the engine's handle on the earlier request
        names its incarnation, so that a late clear() or fail() of it leaves
        the new request alone."""
        entry = self._rooms.get(key)
        return entry.incarnation if entry is not None else None

    def entry(self, key: RoomKey) -> RoomEntry | None:
        """The entry ``key`` has now, for a handle to keep (read it under the
        caller's lock, never change it). Once the ledger replaces or forgets
        it, it keeps the status it ended with: how a handle on an earlier
        request learns its outcome without seeing the newer request's."""
        return self._rooms.get(key)

    def decodes_of(self, room: int) -> dict[str, RoomEntry]:
        """The entries room id ``room`` has now, one per decode (a copy)."""
        return dict(self._by_room.get(room, {}))

    def outstanding(self, key: RoomKey) -> int:
        entry = self._rooms.get(key)
        return entry.outstanding if entry is not None else 0

    def in_flight(self, key: RoomKey) -> int:
        """Counted chunks of ``key`` still being written (not yet settled)."""
        entry = self._rooms.get(key)
        return entry.outstanding - entry.stuck if entry is not None else 0

    def poisoned(self) -> frozenset[RoomKey]:
        return frozenset(self._poisoned)

    def poisoned_count(self) -> int:
        return len(self._poisoned)

    # -- room lifecycle ----------------------------------------------------
    def request(
        self, key: RoomKey, seq: int = 0, dst_pages: tuple[int, ...] = (), extras: int | None = None
    ) -> None:
        """Decode ``key.decode`` asked for room ``key.room`` (its request
        numbered ``seq``, growing with every request of that decode) to be
        written into ``dst_pages`` (and its extras into slot ``extras``): its
        pages are known, input may flow. An entry keeps the pages of its
        first request: a duplicate cannot move a room's writes elsewhere.

        A concluded room's id that decode reuses starts a new entry (a new
        incarnation): a Success room once drained, and a Failed one once its
        abort was acked to that decode and the request is newer than the
        room's own (see :func:`_reusable`). Otherwise a tombstoned or Failed
        room stays Failed and will write nothing.
        """
        entry = self._rooms.get(key)
        if entry is not None and _reusable(entry, seq):
            # A new room, whose status starts over (statuses only move forward
            # within one room).
            self._drop(key)
            entry = None
        if entry is None:
            entry = self._put(key, self._new_entry())
        entry.seq = max(entry.seq, seq)
        if entry.dst_pages is None:
            entry.dst_pages, entry.extras = tuple(dst_pages), extras
        if entry.status == KVPoll.BOOTSTRAPPING:
            entry.status = KVPoll.WAITING_FOR_INPUT

    def clear(self, key: RoomKey, incarnation: int | None = None) -> list[LedgerAction]:
        """The engine is done with ``key`` (with that incarnation of it, if
        given). Counted work keeps the entry (an unknown room is not a
        quiescent one); a drained room is forgotten.

        A room still live (requested, its last chunk not landed) fails first,
        and decode is told: its queued chunks are skipped from now on, and
        decode would otherwise wait for them."""
        entry = self._rooms.get(key)
        if entry is None or incarnation not in (None, entry.incarnation):
            return []
        actions: list[LedgerAction] = []
        if entry.status in LIVE:
            actions = self._mark_failed(key, entry, "cleared by the prefill engine before its last chunk")
        entry.cleared = True
        return self._settle(key, entry, actions)

    def fail(self, key: RoomKey, reason: str, incarnation: int | None = None) -> list[LedgerAction]:
        """Prefill-initiated failure (the engine gave up on ``key``, or on
        that incarnation of it: once it is gone, there is nothing to fail)."""
        entry = self._rooms.get(key)
        if incarnation is not None and (entry is None or entry.incarnation != incarnation):
            return []
        if entry is None:
            entry = self._put(key, self._new_entry())
        return self._mark_failed(key, entry, reason) + self._try_ack(key, entry)

    def give_up(self, key: RoomKey, now: float) -> bool:
        """The engine stopped waiting for decode's request for ``key``: if it
        has not come, leave a Failed tombstone, so that a request arriving
        later writes nothing (the caller tells decode). Returns whether the
        key was given up (False: the request is here after all)."""
        if key in self._rooms:
            return False
        entry = self._put(key, self._new_entry(expires=now + self.tombstone_ttl))
        entry.status = KVPoll.FAILED
        entry.tombstone = True
        self._touched.add(key)
        return True

    def claim(self, key: RoomKey) -> None:
        """A sender took ``key``'s entry: once it concluded, it is that
        sender's verdict, never a fresh sender's (see protocol/rank.py)."""
        entry = self._rooms.get(key)
        if entry is not None:
            entry.claimed = True

    # -- the transfer worker's path ----------------------------------------
    def dequeue(self, key: RoomKey, incarnation: int | None = None) -> bool:
        """A worker took a chunk of ``key`` (queued for that incarnation of
        it, if given): count it, then decide.

        Returns True if the chunk must be written, False to skip it. Either
        way the chunk is counted; the worker reports back with
        :meth:`landed`, :meth:`skipped` or :meth:`failed`. A concluded
        (Success) room is skipped too: decode was told it is complete and
        may have handed its pages out again, so a chunk queued behind its
        last one (a duplicate send) must not land there. So is a chunk queued
        for an earlier incarnation: its pages are the earlier request's,
        which decode may have handed out again (counted on the entry the room
        has now, which therefore acks nothing until the skip is over).
        """
        entry = self._rooms.get(key)
        if entry is None:  # unknown here: counted, then skipped
            entry = self._put(key, self._new_entry(cleared=True))
        entry.outstanding += 1  # invariant D: before any status check
        if entry.status not in LIVE or entry.cleared:
            return False
        if incarnation is not None and incarnation != entry.incarnation:
            return False
        entry.status = KVPoll.TRANSFERRING
        return True

    def skipped(self, key: RoomKey) -> list[LedgerAction]:
        entry = self._rooms[key]
        entry.outstanding -= 1
        return self._settle(key, entry, [])

    def landed(self, key: RoomKey, last: bool) -> list[LedgerAction]:
        entry = self._rooms[key]
        entry.outstanding -= 1
        actions: list[LedgerAction] = []
        if last and entry.status == KVPoll.TRANSFERRING:
            entry.status = KVPoll.SUCCESS
            actions.append(NotifyDecode(key.decode, self.room_status(key, RoomOutcome.SUCCESS, "")))
        return self._settle(key, entry, actions)

    def failed(self, key: RoomKey, settled: bool, reason: str) -> list[LedgerAction]:
        """A chunk of ``key`` failed. ``settled``: the transport proved none of
        its writes can still land. Otherwise the room is poisoned: its count
        stays until a fence, and it is never acked before."""
        entry = self._rooms[key]
        actions = self._mark_failed(key, entry, reason)
        if settled:
            entry.outstanding -= 1
        else:
            entry.stuck += 1
            self._poisoned.add(key)
        return self._settle(key, entry, actions)

    def fenced(self) -> list[LedgerAction]:
        """The writer's fence returned: nothing posted before it can land, so
        the stuck chunks of every poisoned room are settled now."""
        actions: list[LedgerAction] = []
        poisoned, self._poisoned = self._poisoned, set()
        for key in sorted(poisoned):
            entry = self._rooms[key]
            if entry.stuck:
                entry.outstanding -= entry.stuck
                entry.stuck = 0
                entry.fenced = True
                actions = self._settle(key, entry, actions)
        return actions

    # -- the control listener's path ---------------------------------------
    def abort(self, msg: Abort, now: float) -> bool:
        """Decode ``msg.decode`` aborted ``msg.room``: mark its room Failed,
        then register the ack target (invariant F). Returns whether the room
        was known here. Only that decode's room: the same room id of another
        decode is another room.

        The caller must then call :meth:`try_ack` (after any hook): that one
        try covers a worker that passed the skip point before the target
        existed, and a room whose chunks all drained already. An unknown room
        gets a tombstone, so a transfer request arriving later writes nothing.
        """
        key = RoomKey(msg.decode, msg.room)
        entry = self._rooms.get(key)
        known = entry is not None and entry.expires is None
        if entry is None:
            entry = self._put(key, self._new_entry(expires=now + self.tombstone_ttl))
            entry.tombstone = True
        self._mark_failed(key, entry, "aborted by decode", notify=False)
        self._touched.add(key)
        if (msg.decode, msg.generation) not in entry.acked:
            current = entry.targets.get(msg.decode)
            if current is None or current[1] < msg.generation:
                entry.targets[msg.decode] = (msg.reply_to, msg.generation)
        return known

    def try_ack(self, key: RoomKey) -> list[LedgerAction]:
        """Ack ``key`` to its targets if nothing of it can land any more."""
        entry = self._rooms.get(key)
        return self._settle(key, entry, []) if entry is not None else []

    def poison(self, key: RoomKey, reason: str) -> list[LedgerAction]:
        """Something outside the count (a plugin that raised) may have left
        writes behind: fail the room and hold it until a fence."""
        entry = self._rooms.get(key)
        if entry is None:
            entry = self._put(key, self._new_entry())
        entry.outstanding += 1
        entry.stuck += 1
        self._poisoned.add(key)
        return self._mark_failed(key, entry, reason)

    def expire(self, now: float) -> list[RoomKey]:
        """Forget tombstones and cleared rooms once idle for ``tombstone_ttl``;
        returns the rooms forgotten.

        Cost: the rooms touched since the last call plus those due, not every
        room the ledger remembers."""
        for key in self._touched:
            entry = self._rooms.get(key)
            if entry is None or entry.scheduled or not _expirable(entry):
                continue
            if entry.expires is None:
                entry.expires = now + self.tombstone_ttl
            entry.scheduled = True
            self._seq += 1
            heapq.heappush(self._expiry, (entry.expires, self._seq, key, entry))
        self._touched.clear()
        forgotten = []
        while self._expiry and self._expiry[0][0] <= now:
            _, _, key, entry = heapq.heappop(self._expiry)
            entry.scheduled = False
            if self._rooms.get(key) is entry and _expirable(entry):
                self._drop(key)
                forgotten.append(key)
            # else: replaced, or busy again; a busy one is touched when it settles
        return forgotten

    # -- internals ---------------------------------------------------------
    def _put(self, key: RoomKey, entry: _Room) -> _Room:
        entry.decode = key.decode
        self._rooms[key] = entry
        self._by_room.setdefault(key.room, {})[key.decode] = entry
        return entry

    def _drop(self, key: RoomKey) -> None:
        del self._rooms[key]
        decodes = self._by_room[key.room]
        del decodes[key.decode]
        if not decodes:
            del self._by_room[key.room]

    def _new_entry(self, cleared: bool = False, expires: float | None = None) -> _Room:
        return _Room(cleared=cleared, expires=expires, incarnation=next(self._incarnations))

    def room_status(self, key: RoomKey, outcome: RoomOutcome, reason: str) -> RoomStatus:
        """A status of ``key`` for its decode, from this rank process."""
        return RoomStatus(key.room, self.rank, outcome, reason, key.decode, self.session)

    def _mark_failed(
        self, key: RoomKey, entry: _Room, reason: str, notify: bool = True
    ) -> list[LedgerAction]:
        if entry.status == KVPoll.FAILED:
            return []
        entry.status = KVPoll.FAILED
        entry.reason = reason
        if notify and key.decode:
            return [NotifyDecode(key.decode, self.room_status(key, RoomOutcome.FAILED, reason))]
        return []

    def _settle(self, key: RoomKey, entry: _Room, actions: list[LedgerAction]) -> list[LedgerAction]:
        actions = actions + self._try_ack(key, entry)
        self._forget_if_idle(key, entry)
        return actions

    def _try_ack(self, key: RoomKey, entry: _Room) -> list[LedgerAction]:
        self._touched.add(key)  # every path that can make a room idle passes here
        if entry.status != KVPoll.FAILED or entry.outstanding or entry.stuck or not entry.targets:
            return []
        actions: list[LedgerAction] = []
        for decode, (reply_to, generation) in entry.targets.items():
            entry.acked.add((decode, generation))
            ack = AbortAck(key.room, self.rank, generation, entry.fenced, decode, self.session)
            actions.append(SendAck(reply_to, ack))
        entry.targets.clear()
        return actions

    def _forget_if_idle(self, key: RoomKey, entry: _Room) -> None:
        # An acked room stays until expire(): a duplicated ABORT must not be
        # acked twice, and a late transfer request must find it Failed.
        if entry.cleared and _idle(entry) and not entry.acked and entry.expires is None:
            self._drop(key)


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
