"""The decode side: which rooms' pages are held, and what proves them free.

Sans-I/O like the ledger: the caller passes ``now`` and carries out the
returned actions. A room's pages leave the tracker only through
:class:`Release`, and a release always names its :class:`Proof`.

Generations: every ABORT this tracker sends carries a fresh generation, and
a hold remembers the generations it sent. An ack counts only if its
generation belongs to the *current* hold of that room: acks of an earlier
hold (a reused room id) and forged generations are dropped. Re-sent ABORTs
get new generations so a writer never has to ack one generation twice.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Collection

import attrs

from kvconn.errors import FinishRefusedError, KvconnError, RequestError, RoomInUseError
from kvconn.protocol.drops import DropReason
from kvconn.protocol.messages import Abort, AbortAck


class Proof(enum.Enum):
    """Why pages may be handed out again."""

    ACKS = "acks"  #: every rank acked the current hold before the deadline
    LATE_ACKS = "late_acks"  #: the last ack came while quarantined
    WRITER_FENCE = "writer_fence"  #: a rank's ack followed its own fence
    WRITER_EXIT = "writer_exit"  #: the last unproven rank's process is gone
    #: the last unproven rank drained: nothing of its process can land (protocol/drain.py)
    WRITER_DRAINED = "writer_drained"
    COMPLETED = "completed"  #: every rank reported every chunk landed
    NOTHING_SENT = "nothing_sent"  #: no writer was ever told the pages
    OWNER_FENCE = "owner_fence"  #: decode destroyed the transport endpoint every writer reached it by
    UNSAFE_TIMEOUT = "unsafe_timeout"  #: legacy mode: the deadline alone


class HoldState(enum.Enum):
    OPEN = "open"  #: transferring, pages belong to the request
    HELD = "held"  #: aborted, waiting for proof before the deadline
    QUARANTINED = "quarantined"  #: past the deadline, still waiting for proof


@attrs.frozen(slots=True)
class SendAbort:
    rank: int
    abort: Abort


@attrs.frozen(slots=True)
class Release:
    room: int
    pages: tuple[int, ...]
    proof: Proof
    held_for: float
    quarantined_for: float


@attrs.frozen(slots=True)
class Quarantine:
    room: int
    pages: tuple[int, ...]


@attrs.frozen(slots=True)
class Dropped:
    """An ack that proves nothing; ``reason`` is a counter label."""

    reason: DropReason
    ack: AbortAck


HoldAction = SendAbort | Release | Quarantine | Dropped


@attrs.define(slots=True)
class _Room:
    pages: tuple[int, ...]
    ranks: frozenset[int]
    state: HoldState = HoldState.OPEN
    succeeded: set[int] = attrs.Factory(set)
    generations: set[int] = attrs.Factory(set)
    proven: set[int] = attrs.Factory(set)
    fenced: bool = False
    held_at: float = 0.0
    deadline: float = 0.0
    quarantined_at: float = 0.0
    resend_at: float = 0.0
    resend_every: float = 0.0
    #: Some rank was proven by its process's exit rather than an ack.
    exited: bool = False
    #: ... or by its drain.
    drained: bool = False


def _due(entry: _Room) -> float:
    """When a hold next has something to do at a tick."""
    return entry.deadline if entry.state is HoldState.HELD else entry.resend_at


def _about(room: int, error: KvconnError) -> KvconnError:
    """``error`` naming ``room``, its message kept as this module always wrote it."""
    error.room = room
    return error


class HoldTracker:
    """Decode's rooms, their holds after an abort, and their release."""

    def __init__(
        self,
        decode: str,
        reply_to: str,
        abort_timeout: float,
        resend_interval: float = 1.0,
        max_resend_interval: float = 30.0,
        unsafe_release_at_deadline: bool = False,
    ) -> None:
        self.decode = decode
        self.reply_to = reply_to
        self.abort_timeout = abort_timeout
        self.resend_interval = resend_interval
        self.max_resend_interval = max_resend_interval
        self.unsafe_release_at_deadline = unsafe_release_at_deadline
        self._rooms: dict[int, _Room] = {}
        #: The rooms not OPEN, and pages per state: every control message and
        #: tick asks about holds, and a serving decode has hundreds of open
        #: rooms for each held one.
        self._holds: dict[int, _Room] = {}
        self._pages = dict.fromkeys(HoldState, 0)
        self._generations = itertools.count(1)
        #: When each hold has something to do next (its deadline while HELD,
        #: its next re-send while QUARANTINED): (when, seq, room), a heap. An
        #: item whose room is no longer held, or is due at another time now,
        #: is stale and skipped. tick() and next_deadline() run after every
        #: control message; a walk of every hold made each ack cost O(holds),
        #: thousands in an abort storm.
        self._wakeups: list[tuple[float, int, int]] = []
        self._wakeup_seq = itertools.count()

    # -- queries -----------------------------------------------------------
    def state(self, room: int) -> HoldState | None:
        entry = self._rooms.get(room)
        return entry.state if entry is not None else None

    def pages_in(self, state: HoldState) -> int:
        return self._pages[state]

    def rooms_in(self, state: HoldState) -> list[int]:
        rooms = self._rooms if state is HoldState.OPEN else self._holds
        return [r for r, e in rooms.items() if e.state is state]

    def oldest_quarantine(self, now: float) -> float:
        """Seconds the longest-quarantined room has waited (0: none)."""
        since = [e.quarantined_at for e in self._holds.values() if e.state is HoldState.QUARANTINED]
        return max(0.0, now - min(since)) if since else 0.0

    def quarantined(self) -> list[tuple[int, float, int]]:
        """(room, quarantined since, pages) of every quarantined room."""
        return [
            (r, e.quarantined_at, len(e.pages))
            for r, e in self._holds.items()
            if e.state is HoldState.QUARANTINED
        ]

    def held_since(self, room: int) -> float | None:
        """When ``room`` was aborted, if its pages are held (or quarantined)."""
        entry = self._holds.get(room)
        return entry.held_at if entry is not None else None

    def unproven(self, room: int) -> frozenset[int]:
        """The ranks whose proof a held ``room`` still waits for (none for a
        room not held)."""
        entry = self._holds.get(room)
        return frozenset() if entry is None else frozenset(entry.ranks - entry.proven)

    def awaiting(self) -> dict[tuple[int, HoldState], int]:
        """(rank, state) -> how many held rooms in that state (held or
        quarantined) still wait for that rank's proof: which rank an
        operator's quarantine waits for."""
        counts: dict[tuple[int, HoldState], int] = {}
        for entry in self._holds.values():
            for rank in entry.ranks - entry.proven:
                counts[(rank, entry.state)] = counts.get((rank, entry.state), 0) + 1
        return counts

    def ranks_of(self, room: int) -> frozenset[int]:
        """The ranks writing ``room``; none for a room not tracked."""
        entry = self._rooms.get(room)
        return entry.ranks if entry is not None else frozenset()

    # -- stimuli -----------------------------------------------------------
    def open(self, room: int, pages: tuple[int, ...], ranks: frozenset[int]) -> None:
        """The engine created a receiver: ``ranks`` will write ``pages``."""
        if room in self._rooms:
            raise _about(
                room, RoomInUseError(f"room {room} is still tracked ({self._rooms[room].state.value})")
            )
        if not ranks:
            raise _about(room, RequestError("a room needs at least one writing rank"))
        self._rooms[room] = _Room(pages=pages, ranks=ranks)
        self._pages[HoldState.OPEN] += len(pages)

    def succeeded(self, room: int, rank: int) -> bool:
        """``rank`` reported every chunk of ``room`` landed. True once all have."""
        entry = self._rooms.get(room)
        if entry is None or rank not in entry.ranks:
            return False
        entry.succeeded.add(rank)
        return entry.succeeded >= entry.ranks

    def finish(self, room: int) -> tuple[int, ...]:
        """The engine took a completed room's pages: stop tracking it."""
        entry = self._rooms.get(room)
        if entry is None or entry.state is not HoldState.OPEN or not entry.succeeded >= entry.ranks:
            raise _about(room, FinishRefusedError(f"room {room} is not completed"))
        del self._rooms[room]
        self._pages[HoldState.OPEN] -= len(entry.pages)
        return entry.pages

    def abort(self, room: int, now: float) -> list[HoldAction]:
        """The engine aborted ``room``: hold its pages until proof arrives."""
        entry = self._rooms.get(room)
        if entry is None or entry.state is not HoldState.OPEN:
            return []
        entry.proven = set(entry.succeeded)
        if entry.proven >= entry.ranks:
            return [self._release(room, entry, Proof.COMPLETED, now)]
        self._move(entry, HoldState.HELD)
        self._holds[room] = entry
        entry.held_at = now
        entry.deadline = now + self.abort_timeout
        self._schedule(room, entry)
        return self._send_aborts(room, entry)

    def ack(self, msg: AbortAck, now: float) -> list[HoldAction]:
        entry = self._rooms.get(msg.room)
        if entry is None or entry.state is HoldState.OPEN:
            return [Dropped(DropReason.NOT_HELD, msg)]
        if msg.rank not in entry.ranks:
            return [Dropped(DropReason.STRANGER_RANK, msg)]
        if msg.generation not in entry.generations:
            return [Dropped(DropReason.STALE_GENERATION, msg)]
        if msg.rank in entry.proven:
            return [Dropped(DropReason.DUPLICATE, msg)]
        entry.proven.add(msg.rank)
        entry.fenced = entry.fenced or msg.fenced
        if entry.proven < entry.ranks:
            return []
        return [self._release(msg.room, entry, self._proof(entry), now)]

    def writer_exited(
        self, rank: int, now: float, rooms: Collection[int] | None = None, drained: bool = False
    ) -> list[HoldAction]:
        """``rank``'s process is proven gone (``drained``: it drained): it
        can write nothing more (into ``rooms`` only, if given: those the gone
        process was asked to write; a process restarted at the rank's
        address owes the others)."""
        actions: list[HoldAction] = []
        for room, entry in list(self._holds.items()):
            if rank not in entry.ranks or (rooms is not None and room not in rooms):
                continue
            if rank in entry.proven:
                continue
            entry.proven.add(rank)
            if drained:
                entry.drained = True
            else:
                entry.exited = True
            if entry.proven >= entry.ranks:
                actions.append(self._release(room, entry, self._proof(entry), now))
        return actions

    def reask(self, rank: int, rooms: Collection[int], now: float) -> list[HoldAction]:
        """``rank`` is reachable again (it answered after being down): ask it
        at once, with fresh generations, for each held room of ``rooms`` it
        has not proven, instead of at the room's next re-send (backed off up
        to ``max_resend_interval``), and re-send from the shortest interval
        again."""
        actions: list[HoldAction] = []
        for room in sorted(rooms):
            entry = self._holds.get(room)
            if entry is None or rank not in entry.ranks or rank in entry.proven:
                continue
            generation = next(self._generations)
            entry.generations.add(generation)
            actions.append(SendAbort(rank, Abort(room, generation, self.decode, self.reply_to)))
            if entry.state is HoldState.QUARANTINED:
                entry.resend_every = self.resend_interval
                entry.resend_at = now + entry.resend_every
                self._schedule(room, entry)
        return actions

    def owner_fenced(self, now: float) -> list[HoldAction]:
        """The page owner fenced: nothing sent to the region's old metadata
        can land, so every held or quarantined room (all were asked under
        it) is free."""
        return [
            self._release(room, entry, Proof.OWNER_FENCE, now) for room, entry in list(self._holds.items())
        ]

    def tick(self, now: float) -> list[HoldAction]:
        """Move held rooms past their deadline to quarantine (or, in the
        legacy unsafe mode, free them), and re-send ABORTs while quarantined."""
        actions: list[HoldAction] = []
        wakeups = self._wakeups
        while wakeups and wakeups[0][0] <= now:
            when, _, room = heapq.heappop(wakeups)
            entry = self._holds.get(room)
            if entry is None or _due(entry) != when:
                continue  # released, or rescheduled since
            if entry.state is HoldState.HELD:
                if self.unsafe_release_at_deadline:
                    actions.append(self._release(room, entry, Proof.UNSAFE_TIMEOUT, now))
                    continue
                self._move(entry, HoldState.QUARANTINED)
                entry.quarantined_at = now
                entry.resend_every = self.resend_interval
                actions.append(Quarantine(room, entry.pages))
            actions += self._send_aborts(room, entry)
            entry.resend_at = now + entry.resend_every
            entry.resend_every = min(entry.resend_every * 2, self.max_resend_interval)
            self._schedule(room, entry)
        return actions

    def next_deadline(self) -> float | None:
        """The earliest instant at which :meth:`tick` has something to do."""
        wakeups = self._wakeups
        while wakeups:
            when, _, room = wakeups[0]
            entry = self._holds.get(room)
            if entry is not None and _due(entry) == when:
                return when
            heapq.heappop(wakeups)
        return None

    # -- internals ---------------------------------------------------------
    def _schedule(self, room: int, entry: _Room) -> None:
        heapq.heappush(self._wakeups, (_due(entry), next(self._wakeup_seq), room))
        if len(self._wakeups) > 2 * len(self._holds) + 64:
            # Released holds leave their items behind until due: drop them.
            self._wakeups = [w for w in self._wakeups if (e := self._holds.get(w[2])) and _due(e) == w[0]]
            heapq.heapify(self._wakeups)

    def _send_aborts(self, room: int, entry: _Room) -> list[HoldAction]:
        generation = next(self._generations)
        entry.generations.add(generation)
        abort = Abort(room, generation, self.decode, self.reply_to)
        return [SendAbort(rank, abort) for rank in sorted(entry.ranks - entry.proven)]

    @staticmethod
    def _proof(entry: _Room) -> Proof:
        """A release names the strongest claim it rests on: a writer's exit,
        then a writer's fence, then acks (late ones if quarantined)."""
        if entry.exited:
            return Proof.WRITER_EXIT
        if entry.drained:
            return Proof.WRITER_DRAINED
        if entry.fenced:
            return Proof.WRITER_FENCE
        return Proof.LATE_ACKS if entry.state is HoldState.QUARANTINED else Proof.ACKS

    def _move(self, entry: _Room, state: HoldState) -> None:
        self._pages[entry.state] -= len(entry.pages)
        self._pages[state] += len(entry.pages)
        entry.state = state

    def _release(self, room: int, entry: _Room, proof: Proof, now: float) -> Release:
        del self._rooms[room]
        self._holds.pop(room, None)
        self._pages[entry.state] -= len(entry.pages)
        held = now - entry.held_at if entry.state is not HoldState.OPEN else 0.0
        quarantined = now - entry.quarantined_at if entry.state is HoldState.QUARANTINED else 0.0
        return Release(room, entry.pages, proof, held, quarantined)
