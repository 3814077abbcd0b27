"""A prefill rank's handling of requests, senders and verdicts, sans-I/O.

:class:`RankState` decides everything a rank does above the chunk path
(which stays :class:`~kvconn.protocol.ledger.RoomLedger`'s): which decode's
request is fresh, which request a room id names now (its incarnation), which
requests an engine's sender writes (its legs), what the sender may still
send and into which pages, and what its verdict is. Each stimulus (a message,
an engine call, a tick) takes the time as an argument and returns the
actions the caller carries out; the caller serialises the calls (one lock).

Why this is the one place:

* **Incarnations by identity.** Decode reuses a room id once the room's
  pages came back. A sender keeps the ledger entry it first saw (a *leg*):
  an entry replaced or forgotten since is over for it, so its late
  ``clear()``/``fail()`` never touches the request that took the id, and it
  never sends into that request's pages (every chunk it queues names its
  leg's incarnation; :meth:`RoomLedger.dequeue` skips one that does not
  match).
* **One TTL.** A room a sender gave up on (or failed before every decode
  asked) is refused for the ledger's own ``tombstone_ttl``, whichever decode
  asks: the same TTL as every tombstone.
* **Verdicts.** A sender's status is the sum of its legs: FAILED if any leg
  failed, SUCCESS once all succeeded; it is *settled* only once no chunk of
  any leg is still being written (its source pages may then be reused).
* **A chunk's end.** The worker reports how each counted chunk ended
  (:meth:`RankState.chunk_ended`); one that may still land poisons its room
  until a fence this rank's writer is proven to have (:class:`WriterTerms`),
  and a fenced ack names the connections the fences closed.

Its stimuli's values, actions and records are in ``rank_events.py``; a
Hello's checks in ``rank_bootstrap.py``; a drain's in ``drain.py``.
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic

from kvconn.errors import ArgumentError, IncompleteRoomError, KvconnError, PageError, RoomStateError
from kvconn.protocol import drain as _drain
from kvconn.protocol import rank_bootstrap as _bootstrap
from kvconn.protocol.drain import DrainReport, RankDrain
from kvconn.protocol.drops import DropReason
from kvconn.protocol.ledger import (
    LIVE,
    KVPoll,
    NotifyDecode,
    RoomEntry,
    RoomKey,
    RoomLedger,
)
from kvconn.protocol.messages import Abort, Hello, RoomOutcome, TcpConnection, TransferRequest
from kvconn.protocol.rank_events import (
    AbortHook,
    Action,
    AnswerHello,
    Bootstrap,
    ChunkEnd,
    Connect,
    Drop,
    Fence,
    GaveUp,
    L,
    Leg,
    LegChunk,
    Pairing,
    Peer,
    Requested,
    SenderState,
    SendPlan,
    Verdict,
    WriterTerms,
)

CONCLUDED = frozenset({KVPoll.SUCCESS, KVPoll.FAILED})
_LANDED = ChunkEnd.LANDED


class RankState(Generic[L]):
    """A prefill rank's decisions above the chunk path (see the module doc)."""

    def __init__(
        self,
        ledger: RoomLedger,
        bootstrap_timeout: float | None = None,
        reachable: Callable[[str], bool] = lambda address: True,
        writer: WriterTerms | None = None,
    ) -> None:
        """``bootstrap_timeout``: how long a sender waits for every decode's
        request (None: for ever). ``reachable``: whether a reply address can
        be sent to at all (an abort naming one that cannot is dropped whole,
        or the ledger would keep an ack target that fails every send).
        ``writer``: what the rank's writer offers (None: no bootstrap is
        taken and no fence trusted)."""
        self.ledger = ledger
        self.writer = writer
        self.bootstrap_timeout = bootstrap_timeout
        self._reachable = reachable
        self.peers: dict[str, Peer[L]] = {}
        #: Rooms given up (room id -> until when): a request arriving later
        #: is refused, whichever decode sends it. ``_given_up_order``: the
        #: same, by when (a heap; an item stale once the room was given up
        #: again later): a tick forgets the ones due without a walk.
        self._given_up: dict[int, float] = {}
        self._given_up_order: list[tuple[float, int]] = []
        #: Requests (incarnations) a live sender took. A sender dropped
        #: unused frees them: the engine's handle is the sender, and only it.
        self._taken: weakref.WeakValueDictionary[int, SenderState] = weakref.WeakValueDictionary()
        #: The rank's drain, once told to (protocol/drain.py).
        self.drain: RankDrain | None = None

    # -- messages --------------------------------------------------------------
    def handle(self, msg: object, now: float) -> list[Action]:
        """A control message from a decode endpoint, dispatched by its type in
        one place (:data:`_HANDLERS`: a dict, not ``singledispatchmethod``,
        which builds a wrapper on every access and runs on every message)."""
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            return [Drop(DropReason.UNEXPECTED_TYPE)]
        return handler(self, msg, now)

    def _request(self, msg: TransferRequest, now: float) -> list[Action]:
        peer = self.peers.get(msg.decode)
        if peer is None:
            return [Drop(DropReason.UNKNOWN_DECODE)]
        if msg.session != self.ledger.session or msg.seq <= peer.last_seq:
            return [Drop(DropReason.STALE_REQUEST)]  # replayed, or for another process
        peer.last_seq = msg.seq
        # A room is this decode's: the same id requested by another decode is
        # another room (its own pages, counts and acks).
        key = RoomKey(msg.decode, msg.room)
        ledger = self.ledger
        if self.drain is not None:
            return _drain.refuse_request(self, key, msg.seq, msg.dst_pages, msg.extras)
        if ledger.entry(key) is None and self.given_up(msg.room, now):
            ledger.give_up(key, now)  # its sender gave up: write nothing
        ledger.request(key, msg.seq, msg.dst_pages, msg.extras)
        actions: list[Action] = []
        if ledger.status(key) is KVPoll.FAILED:
            # It will write nothing: say so, or decode waits for a transfer
            # that never comes.
            reason = (
                "room is failed or tombstoned at this rank (aborted, its sender gave up "
                "waiting for this request, or its id reused too soon)"
            )
            actions.append(NotifyDecode(msg.decode, ledger.room_status(key, RoomOutcome.FAILED, reason)))
        actions.append(Requested(msg.room, len(msg.dst_pages)))
        return actions

    def _abort(self, msg: Abort, now: float) -> list[Action]:
        if not self._reachable(msg.reply_to):
            return [Drop(DropReason.BAD_REPLY_TO)]
        return [AbortHook(msg, self.ledger.abort(msg, now))]

    def _hello(self, msg: Hello, now: float) -> list[Action]:
        return _bootstrap.hello(self, msg)

    def bootstrap(self, msg: Hello, pairing: Pairing[L]) -> list[Action]:
        """The runtime paired this rank's layout with ``msg``'s (a
        :class:`Bootstrap` asked it to): refuse, ack, or :class:`Connect`."""
        return _bootstrap.paired(self, msg, pairing)

    def connected(self, connect: Connect, error: str = "") -> list[Action]:
        """The writer connected to a decode (``error``: why it could not)."""
        return _bootstrap.connected(self, connect, error)

    def abort_hooked(self, abort: Abort, raised: bool) -> list[Action]:
        """The abort hook ran (``raised``: it raised, and may have left
        writes behind): ack the room if nothing of it can land."""
        key = RoomKey(abort.decode, abort.room)
        actions: list[Action] = []
        if raised:
            actions += self.ledger.poison(key, "on_abort_notification raised")
            actions += self._fence()
        actions += self.ledger.try_ack(key)
        return actions

    def add_peer(self, decode: str, reply_to: str, pairing: Pairing[L]) -> None:
        """``decode`` is connected: :meth:`connected` without a Hello (a
        second one that raced it keeps the first)."""
        self.peers.setdefault(decode, Peer(reply_to, pairing))

    # -- the chunk path ----------------------------------------------------------
    def chunk_ended(
        self, key: RoomKey, end: ChunkEnd, last: bool = False, reason: str = ""
    ) -> Sequence[Action]:
        """A worker's counted chunk of ``key`` ended (``last``: the room's
        last chunk; ``reason``: what raised, for a plugin error)."""
        if end is _LANDED:  # on every chunk: a module global, not an enum lookup
            return self.ledger.landed(key, last)
        if end is ChunkEnd.SKIPPED:
            return self.ledger.skipped(key)
        reason = reason or f"transfer {end.value}"
        if end is ChunkEnd.FAILED_SETTLED:
            return self.ledger.failed(key, True, reason)
        # Unsettled, or a plugin raised with the chunk counted: bytes may
        # still land. The count stays until a fence proves none can.
        return self.ledger.failed(key, False, reason) + self._fence()

    def fence_begins(self) -> frozenset[RoomKey]:
        """The rooms a fence starting now settles if it succeeds (none: no
        fence is needed, as when an earlier one settled them all)."""
        return self.ledger.poisoned() if self._fences else frozenset()

    def fence_ended(self, ok: bool, closed: frozenset[TcpConnection] = frozenset()) -> Sequence[Action]:
        """The writer's fence returned (``ok``: it said it fenced), having
        closed the TCP connections ``closed``: every poisoned room is
        settled, if this writer's fence is proven. Their acks, and every
        later fenced ack, name the connections the fences closed."""
        if not ok or not self._fences:
            return []  # unproven or failed: the rooms wait for the writer's exit
        return self.ledger.fenced(closed)

    @property
    def _fences(self) -> bool:
        return self.writer is not None and self.writer.writer_fence

    def _fence(self) -> list[Action]:
        # Without a proven fence nothing settles a poisoned room here: decode
        # takes its pages back on the writer's exit.
        return [Fence()] if self._fences else []

    def tick(self, now: float) -> list[Action]:
        """Forget what expired: idle tombstones and cleared rooms, given-up
        rooms. Due at :meth:`next_wakeup` (earlier calls cost little)."""
        self.ledger.expire(now)
        order = self._given_up_order
        while order and order[0][0] <= now:
            until, room = heapq.heappop(order)
            if self._given_up.get(room) == until:
                del self._given_up[room]
        return []

    def next_wakeup(self) -> float | None:
        """When :meth:`tick` next has something to do (None: nothing until
        a room changes); the runtime's listener sleeps until then or until
        a message comes."""
        due = self.ledger.next_expiry()
        if self._given_up_order:
            first = self._given_up_order[0][0]
            due = first if due is None else min(due, first)
        return due

    def begin_drain(self, now: float, grace_s: float, report_after_s: float = math.inf) -> list[Action]:
        """Drain: refuse new requests, give held rooms ``grace_s`` to finish
        (see protocol/drain.py); then :meth:`drain_tick` until drained, or
        :meth:`drain_report` until it reports (drained, or ``report_after_s``
        from now: :func:`~kvconn.protocol.drain.rank_report_after`)."""
        return _drain.begin_rank_drain(self, now, grace_s, report_after_s)

    def drain_tick(self, now: float) -> tuple[bool, list[Action]]:
        """(drained, actions): fails live rooms once the grace ran out, and
        announces ``done`` once nothing of this rank can be written."""
        return _drain.rank_drain_tick(self, now)

    def drain_report(self, now: float) -> tuple[DrainReport | None, list[Action]]:
        """:meth:`drain_tick`, and the drain's report once it is drained or
        its wait is up (None: wait on)."""
        return _drain.rank_drain_report(self, now)

    def given_up(self, room: int, now: float) -> bool:
        until = self._given_up.get(room)
        return until is not None and until > now

    # -- the engine's calls ----------------------------------------------------
    def requesting_tp(self, room: int) -> int | None:
        """The tensor-parallel size of a decode whose request for ``room``
        no sender took, or None while there is none."""
        for decode, entry in self.ledger.decodes_of(room).items():
            if entry.dst_pages is not None and self._takeable(entry):
                return self.peers[decode].tp_size
        return None

    def open_sender(self, room: int, decodes: int, now: float) -> SenderState:
        if decodes < 1:
            raise ArgumentError(f"a sender writes into at least one decode, got decodes={decodes}", room)
        deadline = None if self.bootstrap_timeout is None else now + self.bootstrap_timeout
        return SenderState(room, decodes, deadline)

    def poll(self, s: SenderState, now: float) -> tuple[KVPoll, list[Action]]:
        """The sender's status (binding any requests that came); past its
        bootstrap deadline without every decode's request, it gives up."""
        if s.verdict is not None:
            return s.verdict, []
        self._bind(s)
        statuses = [self._leg_status(leg) for leg in s.legs]
        if KVPoll.FAILED in statuses:
            s.verdict = KVPoll.FAILED
            return s.verdict, []
        if len(s.legs) < s.decodes:
            if (s.deadline is not None and now >= s.deadline) or self.drain is not None:
                if self.drain is not None:
                    s.reason = s.reason or _drain.REFUSED  # it refuses the requests still to come
                return KVPoll.FAILED, self._give_up(s, now)
            return KVPoll.BOOTSTRAPPING, []
        if all(status is KVPoll.SUCCESS for status in statuses):
            s.verdict = KVPoll.SUCCESS
            return s.verdict, []
        if any(status >= KVPoll.TRANSFERRING for status in statuses):
            return KVPoll.TRANSFERRING, []
        return KVPoll.WAITING_FOR_INPUT, []

    def leg_statuses(self, s: SenderState) -> dict[str, KVPoll]:
        """Each leg's status, by decode (after :meth:`poll`)."""
        return {leg.key.decode: self._leg_status(leg) for leg in s.legs}

    def settled(self, s: SenderState) -> bool:
        """Every decode's leg concluded and nothing of any is being written.
        A sender still waiting for a decode's request is not settled (it may
        yet write); one concluded without it (failed, gave up, cleared)
        wrote nothing into that decode."""
        self._bind(s)
        if s.verdict is None and len(s.legs) < s.decodes:
            return False
        return all(
            self._leg_status(leg) in CONCLUDED and leg.entry.outstanding == leg.entry.stuck for leg in s.legs
        )

    def verdict(self, s: SenderState, now: float) -> tuple[Verdict | None, list[Action]]:
        """The sender's verdict once its room concluded (None before)."""
        status, actions = self.poll(s, now)
        if status not in CONCLUDED:
            return None, actions
        reason = s.reason
        if not reason and status is KVPoll.FAILED:
            failed = [leg.entry.reason for leg in s.legs if leg.entry.reason]
            if failed:
                reason = failed[0]
            elif s.gave_up:
                reason = "the prefill engine gave up waiting for every decode's request"
            elif s.cleared:
                reason = "cleared by the prefill engine"
        return Verdict(status, self.settled(s), reason), actions

    def plan_next(
        self, s: SenderState, src_pages: Sequence[int], last: bool, now: float, extras_slot: int | None = None
    ) -> tuple[SendPlan | KvconnError, list[Action]]:
        """:meth:`poll`, then :meth:`plan_send`, as one stimulus: the poll's
        actions (a give-up) are the caller's to carry out even when the send
        is refused (then returned in place of the plan). A sender bound to
        every decode's request is polled only for a refusal's message: its
        poll could only cache a verdict that the next poll finds the same,
        and this is on every chunk."""
        bound = len(s.legs) >= s.decodes and s.verdict is None
        polled, actions = (KVPoll.TRANSFERRING, []) if bound else self.poll(s, now)
        try:
            return self.plan_send(s, src_pages, last, polled, extras_slot), actions
        except KvconnError as exc:
            if not bound:
                return exc, actions
        # Refused: polled after all, for the refusal to say what poll() says.
        polled, actions = self.poll(s, now)
        try:
            self.plan_send(s, src_pages, last, polled, extras_slot)
        except KvconnError as exc:
            return exc, actions
        raise AssertionError("plan_send refused a send, then took it")  # pragma: no cover

    def plan_send(
        self,
        s: SenderState,
        src_pages: Sequence[int],
        last: bool,
        polled: KVPoll,
        extras_slot: int | None = None,
    ) -> SendPlan:
        """Check the sender's next chunk, of the source pages ``src_pages``
        (with a last chunk, this rank's extras slot ``extras_slot``;
        ``polled``: its status just now), and say where each leg's share
        goes. Raises, and changes nothing, if it may not be sent. (On every
        send: one pass over the legs, tuples rather than value objects.)"""
        room, npages = s.room, len(src_pages)
        if s.last_sent:
            raise RoomStateError("its last chunk was sent, no chunk may follow it", room)
        rooms = self.ledger._rooms
        unasked = succeeded = False
        for leg in s.legs:
            entry = leg.entry
            if rooms.get(leg.key) is not entry and self.ledger.entry(leg.key) is not entry:
                raise RoomStateError(
                    "its request is over (the room was cleared, or requested again since this sender began)",
                    room,
                )
            unasked = unasked or entry.dst_pages is None
            succeeded = succeeded or entry.status is KVPoll.SUCCESS
        if s.cleared:
            raise RoomStateError(f"this sender was cleared ({polled.name})", room)
        if s.gave_up:
            raise RoomStateError("this sender gave up waiting for decode's request", room)
        bound = len(s.legs) >= s.decodes
        if not bound and any(
            entry.status is KVPoll.SUCCESS for entry in self.ledger.decodes_of(room).values()
        ):
            # Complete here, and not this sender's: its pages are decode's again.
            raise RoomStateError("complete at this rank: no chunk may follow its last", room)
        if not bound or unasked:
            raise RoomStateError(
                f"not bootstrapped yet ({len(s.legs)} of {s.decodes} decodes requested it; "
                f"poll() says {polled.name})",
                room,
            )
        if succeeded:
            # Its last chunk landed and decode was told: the pages are decode's again.
            raise RoomStateError("complete at this rank: no chunk may follow its last", room)
        sent, legs, new = s.sent, [], tuple.__new__
        # Every source page within this rank's source for that decode (min
        # and max, not a walk).
        low, high = (min(src_pages), max(src_pages)) if npages else (0, -1)
        for leg in s.legs:
            entry = leg.entry
            dst_all = entry.dst_pages
            assert dst_all is not None  # checked above
            dst = dst_all[sent : sent + npages]
            left = len(dst_all) - sent
            if len(dst) != npages:
                raise PageError(f"{left} pages left, got {npages}", room)
            if last and npages != left:
                raise IncompleteRoomError(
                    f"a last chunk of {npages} pages leaves {left - npages} of the "
                    f"room's {len(dst_all)} destination pages unwritten",
                    room,
                )
            pairing = self.peers[leg.key.decode].pairing
            if low < 0 or high >= pairing.source_pages:
                _check_source(room, src_pages, pairing.source_pages)
            extras = _extras(room, pairing, entry.extras, extras_slot) if last else None
            legs.append(new(LegChunk, (leg.key, entry.incarnation, dst, extras, pairing.layout)))
        return new(SendPlan, (s.index, last, npages, tuple(legs), extras_slot))

    def commit_send(self, s: SenderState, plan: SendPlan) -> list[Action]:
        """The planned chunk is being queued (its legs' shares lowered)."""
        s.sent += plan.npages
        s.index += 1
        s.last_sent = plan.last
        return []

    def fail(self, s: SenderState, reason: str, now: float) -> list[Action]:
        """Prefill-initiated failure of the sender's requests; a decode whose
        request has not come yet is told FAILED when it does."""
        self._bind(s)
        s.reason = s.reason or reason
        actions: list[Action] = []
        for leg in s.legs:
            actions += self.ledger.fail(leg.key, reason, leg.entry.incarnation)
        if len(s.legs) < s.decodes:
            self._give_up_room(s.room, now)
            s.verdict = KVPoll.FAILED
        return actions + self.poll(s, now)[1]

    def clear(self, s: SenderState, now: float) -> list[Action]:
        """The engine is done with the sender: a leg still live fails (its
        decode is told), drained legs are forgotten, the verdict is final."""
        if s.cleared:
            return []
        self._bind(s)
        s.cleared = True  # binds nothing from now on
        ledger = self.ledger
        if not s.legs:
            # A sender that never saw a request live clears whatever the room
            # has now (as it always did), and only that.
            present = sorted((entry.incarnation, d, entry) for d, entry in ledger.decodes_of(s.room).items())
            s.legs = [Leg(RoomKey(d, s.room), entry) for _, d, entry in present[: s.decodes]]
            if not s.legs:
                s.verdict = KVPoll.FAILED  # nothing requested: nothing will be sent
                return []
        actions: list[Action] = []
        for leg in s.legs:
            actions += ledger.clear(leg.key, leg.entry.incarnation)
        verdict, more = self.poll(s, now)
        s.verdict = verdict if verdict in CONCLUDED else KVPoll.FAILED
        return actions + more

    def fail_room(self, room: int, reason: str, now: float) -> list[Action]:
        """The engine fails ``room`` for every decode, before (or without)
        knowing how many will ask: requests here now fail (a sender's legs
        included), and any arriving within the tombstone TTL is refused.
        The requests no sender took are cleared too: no handle would."""
        self._give_up_room(room, now)
        actions: list[Action] = []
        for decode, entry in sorted(self.ledger.decodes_of(room).items()):
            key = RoomKey(decode, room)
            actions += self.ledger.fail(key, reason, entry.incarnation)
            if entry.incarnation not in self._taken:
                actions += self.ledger.clear(key, entry.incarnation)
        return actions

    # -- internals -------------------------------------------------------------
    def _takeable(self, entry: RoomEntry) -> bool:
        """A request a new sender may take: live, or concluded Failed before
        any sender took it (decode aborted it first): that sender's verdict
        is FAILED, not a wait for a request that will not come."""
        if entry.incarnation in self._taken:
            return False
        if entry.status in LIVE:
            return True
        return entry.status is KVPoll.FAILED and not entry.claimed and not entry.cleared

    def _bind(self, s: SenderState) -> None:
        """Take requests for the room, oldest first, up to ``decodes``: a
        room concluded and claimed is an earlier request's, not this one's."""
        if len(s.legs) >= s.decodes or s.cleared:
            return
        free = sorted(
            (entry.incarnation, decode, entry)
            for decode, entry in self.ledger.decodes_of(s.room).items()
            if self._takeable(entry)
        )
        for _, decode, entry in free[: s.decodes - len(s.legs)]:
            key = RoomKey(decode, s.room)
            s.legs.append(Leg(key, entry))
            self._taken[entry.incarnation] = s
            self.ledger.claim(key)

    def _leg_status(self, leg: Leg) -> KVPoll:
        status = leg.entry.status
        if leg.entry is not self.ledger.entry(leg.key) and status < KVPoll.SUCCESS:
            status = KVPoll.FAILED  # forgotten unconcluded: nothing of it is written any more
        return status

    def _give_up(self, s: SenderState, now: float) -> list[Action]:
        """Stop waiting for decodes' requests: one arriving later writes
        nothing (decode is told FAILED), and those already taken fail."""
        self._give_up_room(s.room, now)
        actions: list[Action] = [GaveUp(s.room)]
        for leg in s.legs:
            reason = "the prefill engine gave up waiting for every decode's request"
            actions += self.ledger.fail(leg.key, reason, leg.entry.incarnation)
        s.verdict = KVPoll.FAILED
        s.gave_up = True
        return actions

    def _give_up_room(self, room: int, now: float) -> None:
        # The ledger's TTL: a given-up room is refused as long as a tombstone is.
        until = self._given_up[room] = now + self.ledger.tombstone_ttl
        heapq.heappush(self._given_up_order, (until, room))


#: RankState.handle's one dispatch: message type -> handler.
_HANDLERS: dict[type, Callable[[RankState[Any], Any, float], list[Action]]] = {
    TransferRequest: RankState._request,
    Abort: RankState._abort,
    Hello: RankState._hello,
}


def _check_source(room: int, src_pages: Sequence[int], capacity: int) -> None:
    """Every source page within this rank's source for that decode (min and
    max, not a walk: this is on every chunk)."""
    if src_pages and (min(src_pages) < 0 or max(src_pages) >= capacity):
        bad = [p for p in src_pages if not 0 <= p < capacity]
        raise PageError(f"source pages {bad[:8]} outside 0..{capacity - 1}", room)


def _extras(room: int, pairing: Pairing[L], dst_slot: int | None, src_slot: int | None) -> int | None:
    """Decode's extras slot a last chunk writes (None: none), once the chunk
    names a slot of ours: without one decode would be told SUCCESS with its
    extras unwritten."""
    if dst_slot is None:
        return None  # decode asked for none
    if pairing.writes_extras is None:
        raise PageError("decode asked for extras, but its pages are no engine layout", room)
    if not pairing.writes_extras:
        return None  # another prefill rank writes them
    if src_slot is None:
        raise IncompleteRoomError(
            "decode asked for its extras; the last chunk must name this rank's slot", room
        )
    if not 0 <= src_slot < pairing.extras_slots:
        raise PageError(f"extras slot {src_slot} outside this rank's {pairing.extras_slots} slots", room)
    return dst_slot


__all__ = [
    "Action",
    "AbortHook",
    "AnswerHello",
    "Bootstrap",
    "CONCLUDED",
    "ChunkEnd",
    "Connect",
    "Drop",
    "Fence",
    "GaveUp",
    "Leg",
    "LegChunk",
    "Pairing",
    "Peer",
    "RankState",
    "Requested",
    "SendPlan",
    "SenderState",
    "Verdict",
    "WriterTerms",
]
