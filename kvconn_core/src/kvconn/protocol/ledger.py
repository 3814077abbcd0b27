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

import copy
import itertools
import math
from collections import deque
from typing import ClassVar

import attrs

from kvconn.protocol.deadlines import DeadlineQueue
from kvconn.protocol.messages import Abort, AbortAck, RoomOutcome, RoomStatus, TcpConnection
from kvconn.protocol.room_entry import (
    _POS_BITS,
    _POS_MASK,
    LIVE,
    KVPoll,
    LedgerAction,
    NotifyDecode,
    RoomEntry,
    RoomKey,
    SendAck,
    _expirable,
    _idle,
    _Pending,
    _pos,
    _reusable,
    _Room,
    _shrunk,
)

#: How many fences' closed connections a fenced ack names: a room fenced by
#: one fence may be acked after later ones (its ABORT came late).
FENCES_REMEMBERED = 16

__all__ = [
    "FENCES_REMEMBERED",
    "LIVE",
    "KVPoll",
    "LedgerAction",
    "NotifyDecode",
    "RoomEntry",
    "RoomKey",
    "RoomLedger",
    "SendAck",
]


class RoomLedger:
    """Per-rank bookkeeping of rooms, counts and ack targets.

    An abort storm leaves a tombstone for every room id a rank never heard
    of, kept for ``tombstone_ttl`` (about ``aborts/s x TTL`` of them). The
    common one, an ABORT of an unknown room once acked, is kept *compact*:
    one int in :attr:`_tombs` and one slot of the deadline queue, instead of
    a full entry (about 150 B instead of about 1 KB). It turns into a full
    entry (:meth:`_promote`) the moment anything but a duplicate ABORT or
    :meth:`expire` looks at it, so every other path sees one kind of entry.
    """

    #: Keep acked tombstones compact (the scanning reference of the tests
    #: turns it off, to be the ledger as it was).
    _compact_tombstones: ClassVar[bool] = True
    #: The least time between two expire() calls :meth:`next_expiry` asks
    #: for: rooms touched since the last call are scheduled by the next one
    #: (their TTL counts from then: later, never early), and a backlog of
    #: rooms due is taken ``expire_budget`` at a time, one call per pace.
    EXPIRE_PACE_S: ClassVar[float] = 0.05

    def __init__(
        self, rank: int, tombstone_ttl: float = 600.0, session: int = 0, expire_budget: int = 256
    ) -> None:
        self.rank = rank
        self.session = session  #: the rank process's, named in every ack and status
        self.tombstone_ttl = tombstone_ttl
        #: Rooms one expire() call forgets at most, beyond those scheduled
        #: since the previous call (see :meth:`expire`).
        self.expire_budget = expire_budget
        self._rooms: dict[RoomKey, _Room] = {}
        #: The decodes each room id is requested by (or aborted, failed for).
        self._by_room: dict[int, dict[str, _Room]] = {}
        #: Compact tombstones, at most one per room id: room id -> its ack
        #: still pending (:class:`_Pending`), or ``generation << 48 | pos``
        #: once acked (the ack of ``generation`` sent, no target left). Its
        #: decode and deadline are slot ``pos`` of :attr:`_expiry`.
        self._tombs: dict[int, int | _Pending] = {}
        self._poisoned: set[RoomKey] = set()
        #: Rooms changed since the last expire(): only they can have become
        #: expirable, so expire() never walks the thousands of acked rooms
        #: that wait out their TTL (it runs on every control message).
        self._touched: set[RoomKey] = set()
        self._expiry: DeadlineQueue[_Tag] = DeadlineQueue()
        #: Tombstones made since the last expire(): each pays for its own
        #: forgetting later, so forgetting keeps up with any abort rate.
        self._credit = 0
        #: When expire() last ran (its pace: see :meth:`next_expiry`).
        self._expired_at = -math.inf
        self._incarnations = itertools.count(1)
        #: The TCP connections the last fences closed, and their union, which
        #: every fenced ack names (decode counts it once its ends drained).
        self._fence_closed: deque[frozenset[TcpConnection]] = deque(maxlen=FENCES_REMEMBERED)
        self.closed_by_fences: tuple[TcpConnection, ...] = ()

    # -- queries -----------------------------------------------------------
    def status(self, key: RoomKey) -> KVPoll | None:
        entry = self._rooms.get(key)
        if entry is not None:
            return entry.status
        return KVPoll.FAILED if self._compact(key) is not None else None

    def incarnation(self, key: RoomKey) -> int | None:
        """Which entry ``key`` has now (None: none). Decode reuses a room id
        once the room concluded: the engine's handle on the earlier request
        names its incarnation, so that a late clear() or fail() of it leaves
        the new request alone."""
        entry = self._lookup(key)
        return entry.incarnation if entry is not None else None

    def entry(self, key: RoomKey) -> RoomEntry | None:
        """The entry ``key`` has now, for a handle to keep (read it under the
        caller's lock, never change it). Once the ledger replaces or forgets
        it, it keeps the status it ended with: how a handle on an earlier
        request learns its outcome without seeing the newer request's."""
        return self._lookup(key)

    def decodes_of(self, room: int) -> dict[str, RoomEntry]:
        """The entries room id ``room`` has now, one per decode (a copy)."""
        item = self._tombs.get(room)
        if item is not None:
            self._promote(RoomKey(self._decode_at(_pos(item)), room), item)
        return dict(self._by_room.get(room, {}))

    def entries(self) -> dict[RoomKey, RoomEntry]:
        """Every room remembered here (for model checkers and tests): a
        compact tombstone as a detached full entry, so looking changes
        nothing (it has no incarnation yet: 0)."""
        rooms = dict(self._rooms)
        for room, item in self._tombs.items():
            pos = _pos(item)
            key = RoomKey(self._decode_at(pos), room)
            rooms[key] = self._full(key, item, self._expiry.deadline_at(pos), incarnation=0)
        return rooms

    def is_failed(self, key: RoomKey) -> bool:
        """``key`` has a full entry that failed (decode aborted it, or it
        failed here): nothing more of it will be written. One dict lookup and
        one read, safe without the caller's lock for a hint (a worker's: see
        ``runtime/transfer.py``), never for a decision."""
        entry = self._rooms.get(key)
        return entry is not None and entry.status is KVPoll.FAILED

    def outstanding(self, key: RoomKey) -> int:
        entry = self._rooms.get(key)
        return entry.outstanding if entry is not None else 0

    def in_flight(self, key: RoomKey) -> int:
        """Counted chunks of ``key`` still being written (not yet settled)."""
        entry = self._rooms.get(key)
        return entry.outstanding - entry.stuck if entry is not None else 0

    def unsettled_keys(self) -> list[RoomKey]:
        """Rooms that may still be written: live, or with counted chunks not
        settled (a compact tombstone is neither)."""
        return [
            key
            for key, entry in self._rooms.items()
            if (entry.status in LIVE and not entry.cleared) or entry.outstanding
        ]

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
        entry = self._lookup(key)
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
        entry = self._lookup(key)
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
        entry = self._lookup(key)
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
        if key in self._rooms or self._compact(key) is not None:
            return False
        self._credit += 1
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
        entry = self._lookup(key)
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

    def fenced(self, closed: frozenset[TcpConnection] = frozenset()) -> list[LedgerAction]:
        """The writer's fence returned, having closed the TCP connections
        ``closed``: nothing posted before it can land, so the stuck chunks of
        every poisoned room are settled now."""
        self._fence_closed.append(closed)
        self.closed_by_fences = tuple(sorted(frozenset().union(*self._fence_closed)))
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
        key = _key(msg.decode, msg.room)
        entry = self._rooms.get(key)
        if entry is None:
            item = self._tombs.get(msg.room)
            if item is None:
                if self._compact_tombstones:
                    # Unknown here: a compact tombstone, Failed from the start (F).
                    pos = self._expiry.push(now + self.tombstone_ttl, msg.room, msg.decode)
                    if pos is not None:
                        self._tombs[msg.room] = _Pending(msg.decode, msg.reply_to, msg.generation, pos)
                        self._credit += 1
                        return False
            elif isinstance(item, _Pending):
                if item.decode == msg.decode:
                    if item.generation < msg.generation:  # the newer target replaces the older
                        self._tombs[msg.room] = _Pending(msg.decode, msg.reply_to, msg.generation, item.pos)
                    return False
            elif self._decode_at(item & _POS_MASK) == msg.decode:
                if item >> _POS_BITS == msg.generation:
                    return False  # a duplicate of the ABORT acked: at most one ack each
                entry = self._promote(key, item)
        known = entry is not None and entry.expires is None
        if entry is None:
            self._credit += 1
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
        if entry is not None:
            return self._settle(key, entry, [])
        item = self._tombs.get(key.room)
        if isinstance(item, _Pending) and item.decode == key.decode:
            # Nothing of an unknown room was counted, nothing can land: ack,
            # and keep only which generation was acked.
            self._tombs[key.room] = item.generation << _POS_BITS | item.pos
            ack = AbortAck(key.room, self.rank, item.generation, False, key.decode, self.session)
            return [SendAck(item.reply_to, ack)]
        return []

    def poison(self, key: RoomKey, reason: str) -> list[LedgerAction]:
        """Something outside the count (a plugin that raised) may have left
        writes behind: fail the room and hold it until a fence."""
        entry = self._lookup(key)
        if entry is None:
            entry = self._put(key, self._new_entry())
        entry.outstanding += 1
        entry.stuck += 1
        self._poisoned.add(key)
        return self._mark_failed(key, entry, reason)

    def next_expiry(self) -> float | None:
        """When :meth:`expire` next has something to do (None: nothing until
        a room is touched): the earliest deadline queued, or one pace
        (:attr:`EXPIRE_PACE_S`) after the last call when rooms touched since
        wait to be scheduled, whichever is first; never sooner than one pace
        after the last call. The caller may call expire() later than this
        (its thread sleeps until then or until a message comes): a room is
        then forgotten later, never earlier."""
        due = self._expiry.earliest()
        if self._touched:  # the next call schedules them
            due = self._expired_at if due is None else min(due, self._expired_at)
        return None if due is None else max(due, self._expired_at + self.EXPIRE_PACE_S)

    def expire(self, now: float) -> list[RoomKey]:
        """Forget tombstones and cleared rooms once idle for ``tombstone_ttl``;
        returns the rooms forgotten.

        Never early: a room is forgotten only once ``now`` is past its
        deadline. Bounded: the rooms touched since the previous call are
        scheduled (each cost its own call more than that), and at most
        ``expire_budget`` rooms, plus one per room scheduled since the
        previous call, are forgotten, however many the ledger remembers or
        are due: it never stalls the thread that handles control messages
        (the listener calls it when :meth:`next_expiry` is due: at most one
        call a pace, while anything is due). Never forever: what is
        left due is taken first by the next calls (deadline order), and the
        rooms scheduled meanwhile pay for their own share, so a room is
        forgotten at most ``backlog / expire_budget`` calls late."""
        credit = self._credit
        self._credit = 0
        self._expired_at = now
        expiry = self._expiry
        for key in self._touched:
            entry = self._rooms.get(key)
            if entry is None or entry.scheduled or not _expirable(entry):
                continue
            if entry.expires is None:
                entry.expires = now + self.tombstone_ttl
            entry.scheduled = True
            credit += 1
            if expiry.push(entry.expires, key.room, entry) is None:
                expiry.push_late(entry.expires, key.room, entry)
        self._touched.clear()
        self._touched = _shrunk(self._touched)
        forgotten = []
        tombs = self._tombs
        new = tuple.__new__
        for room, tag, deadline in expiry.take(now, self.expire_budget + credit):
            if isinstance(tag, str):  # a compact tombstone (a promoted one is retagged)
                key = new(RoomKey, (tag, room))
                item = tombs[room]
                if isinstance(item, _Pending):
                    # Its ack not sent yet (a hook ran in between, or try_ack
                    # never came): a full entry, scheduled again once idle.
                    self._promote(key, item, popped=deadline)
                    continue
                del tombs[room]
                forgotten.append(key)
            else:
                key = _key(tag.decode, room)
                tag.scheduled = False
                if self._rooms.get(key) is tag and _expirable(tag):
                    self._drop(key)
                    forgotten.append(key)
                # else: replaced, or busy again; a busy one is touched when it settles
        if not self._tombs:
            self._tombs = _shrunk(self._tombs)
        if not self._rooms:
            self._rooms = _shrunk(self._rooms)
            self._by_room = _shrunk(self._by_room)
        return forgotten

    def copy(self) -> RoomLedger:
        """An independent copy, entries included (a model checker forks
        worlds with it)."""
        new = copy.copy(self)
        entries = {
            id(e): attrs.evolve(e, targets=dict(e.targets), acked=set(e.acked)) for e in self._rooms.values()
        }
        new._rooms = {k: entries[id(e)] for k, e in self._rooms.items()}
        new._by_room = {}
        for k, e in new._rooms.items():
            new._by_room.setdefault(k.room, {})[k.decode] = e
        new._tombs = dict(self._tombs)
        new._poisoned = set(self._poisoned)
        new._touched = set(self._touched)
        new._fence_closed = self._fence_closed.copy()
        new._expiry = self._expiry.copy(
            lambda tag: tag if isinstance(tag, str) else entries.get(id(tag), tag)
        )
        return new

    # -- internals ---------------------------------------------------------
    def _decode_at(self, pos: int) -> str:
        """The decode of the compact tombstone at expiry slot ``pos``."""
        tag = self._expiry.tag_at(pos)
        assert isinstance(tag, str)
        return tag

    def _lookup(self, key: RoomKey) -> _Room | None:
        """The full entry of ``key``, a compact tombstone made one."""
        entry = self._rooms.get(key)
        if entry is not None:
            return entry
        item = self._compact(key)
        return None if item is None else self._promote(key, item)

    def _compact(self, key: RoomKey) -> int | _Pending | None:
        item = self._tombs.get(key.room)
        if item is None or self._decode_at(_pos(item)) != key.decode:
            return None
        return item

    def _promote(self, key: RoomKey, item: int | _Pending, popped: float | None = None) -> _Room:
        """Make a compact tombstone a full entry, with the deadline it had:
        its slot in the deadline queue, still to come, names the entry from
        now on (``popped``: the slot was just taken, at this deadline, and
        the entry is not scheduled)."""
        pos = _pos(item)
        del self._tombs[key.room]
        if popped is None:
            entry = self._full(key, item, self._expiry.deadline_at(pos))
            entry.scheduled = True
            self._expiry.retag(pos, entry)
        else:
            entry = self._full(key, item, popped)
        return self._put(key, entry)

    def _full(
        self, key: RoomKey, item: int | _Pending, expires: float | None, incarnation: int = -1
    ) -> _Room:
        entry = _Room(
            status=KVPoll.FAILED,
            decode=key.decode,
            expires=expires,
            tombstone=True,
            incarnation=next(self._incarnations) if incarnation < 0 else incarnation,
        )
        if isinstance(item, _Pending):
            entry.targets[key.decode] = (item.reply_to, item.generation)
        else:
            entry.acked.add((key.decode, item >> _POS_BITS))
        return entry

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
            closed = self.closed_by_fences if entry.fenced else ()
            ack = AbortAck(key.room, self.rank, generation, entry.fenced, decode, self.session, closed)
            actions.append(SendAck(reply_to, ack))
        entry.targets.clear()
        return actions

    def _forget_if_idle(self, key: RoomKey, entry: _Room) -> None:
        # An acked room stays until expire(): a duplicated ABORT must not be
        # acked twice, and a late transfer request must find it Failed.
        if entry.cleared and _idle(entry) and not entry.acked and entry.expires is None:
            self._drop(key)


def _key(decode: str, room: int) -> RoomKey:
    """RoomKey(decode, room) without the Python-level ``__new__`` of a
    NamedTuple (on the abort path, several times per message)."""
    return tuple.__new__(RoomKey, (decode, room))


_Tag = str | _Room
