"""Exhaustive exploration of the protocol core's interleavings.

A small world: one room, ``ranks`` prefill ranks each writing ``chunks``
chunks into decode's pages, one decode abort, and, at every point, the
faults the brief names: a handle failing with its write settled or still in
flight, the engine clearing the room, the writer's fence, decode's deadline.
Every step calls the real :class:`RoomLedger` / :class:`HoldTracker`; the
explorer only plays the network, the transport and the clocks. Messages may
be reordered (acks are delivered in any order).

It checks, in every reachable state:

* S1: no ABORT_ACK leaves a rank while a write of the room by that rank can
  still land (in flight, or decided and not yet posted);
* S2: decode releases the pages only when no write can land any more, and a
  write never lands after the release.
* L2: every terminal state has the room released or quarantined (nothing
  stuck in HELD), and with no ERR left unsettled and no dropped message, the
  room is released.

With ``decodes=2`` every rank serves the same room id to two decode
endpoints (prefill TP smaller than decode TP): each rank has one worker lane
per decode over one shared ledger, and the second decode aborts at any point
too. S1 and S2 are then per decode: an ack to one decode while that decode's
write can still land, or a write landing in its released pages.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import attrs

from kvconn.protocol.hold import HoldState, HoldTracker, Release, SendAbort
from kvconn.protocol.hold import _Room as HoldRoom
from kvconn.protocol.ledger import RoomKey, RoomLedger, SendAck
from kvconn.protocol.messages import Abort, AbortAck

ROOM = 7
DECODE = "decode"
DECODE2 = "decode-2"  #: the second decode of a two-decode world


class Violation(AssertionError):
    pass


@dataclass
class Rank:
    ledger: RoomLedger
    requested: bool = False
    next_chunk: int = 0
    phase: str = "idle"  # idle | write | posted
    landed: bool = False  # the posted chunk's bytes are in the destination
    in_flight: set[int] = field(default_factory=set)  # chunk ids that may still land
    inbox: list[Abort] = field(default_factory=list)
    cleared: bool = False
    errors: int = 0
    must_try: bool = False  # an ABORT was registered, its one try still to come
    incarnation: int | None = None  # the ledger entry of the room's request, its chunks name it
    rerequested: bool = False  # decode reused the room id for a new request after the release
    decode: str = DECODE  # the decode this worker lane writes the room into
    #: explore() fills it once the lane can no longer change (it is shared
    #: by every world forked from the one that made it).
    key_cache: tuple[object, ...] | None = field(default=None, compare=False, repr=False)


@dataclass
class Side:
    """The second decode of a two-decode world (the first one's are World's own fields)."""

    tracker: HoldTracker
    aborted: bool = False
    released: bool = False

    def key(self) -> tuple[object, ...]:
        return (_tracker_key(self.tracker), self.aborted, self.released)

    def clone(self) -> Side:
        return Side(_clone_tracker(self.tracker), self.aborted, self.released)


@dataclass
class World:
    ranks: list[Rank]
    tracker: HoldTracker
    acks: list[AbortAck] = field(default_factory=list)
    aborted: bool = False
    ticked: bool = False
    released: bool = False
    unsettled_errors: int = 0
    second: Side | None = None

    tracker_key: tuple[object, ...] | None = field(default=None, compare=False, repr=False)

    def key(self) -> tuple[object, ...]:
        """Everything that decides the future, as a hashable value; acks in
        flight are a multiset (delivery order is explored anyway)."""
        if self.tracker_key is None:
            self.tracker_key = _tracker_key(self.tracker)
        return (
            tuple(_cached_rank_key(r) for r in self.ranks),
            self.tracker_key,
            tuple(sorted(attrs.astuple(a) for a in self.acks)),
            self.aborted,
            self.ticked,
            self.released,
            self.unsettled_errors,
            None if self.second is None else self.second.key(),
        )

    def clone(self, lane: int | None = None) -> World:
        """A copy for one step to change. ``lane``: the step changes only that
        lane, the lanes sharing its ledger and the acks in flight (a step
        labelled ``r<lane>:``); the copy shares everything else with this
        world, which is never changed again. None: a copy of everything."""
        # deepcopy was most of the explorer's time; these objects are small
        # and flat, so a copy of their mutable parts is enough.
        ledgers: dict[int, RoomLedger] = {}  # the lanes of a rank keep sharing its ledger
        if lane is None:
            ranks = [_clone_rank(r, ledgers) for r in self.ranks]
            tracker, tracker_key, second = _clone_tracker(self.tracker), None, self.second
            second = None if second is None else second.clone()
        else:
            ledger = self.ranks[lane].ledger
            ranks = [_clone_rank(r, ledgers) if r.ledger is ledger else r for r in self.ranks]
            tracker, tracker_key, second = self.tracker, self.tracker_key, self.second
        return World(
            ranks,
            tracker,
            list(self.acks),
            self.aborted,
            self.ticked,
            self.released,
            self.unsettled_errors,
            second,
            tracker_key,
        )


def _cached_rank_key(rank: Rank) -> tuple[object, ...]:
    if rank.key_cache is None:
        rank.key_cache = _rank_key(rank)
    return rank.key_cache


def _rank_key(rank: Rank) -> tuple[object, ...]:
    rooms = tuple(
        (
            k,
            e.status,
            e.outstanding,
            e.stuck,
            tuple(sorted(e.targets.items())),
            tuple(sorted(e.acked)),
            e.cleared,
            e.fenced,
            e.expires is None,
            e.tombstone,
            e.seq,
            e.incarnation == rank.incarnation,
        )
        for k, e in sorted(rank.ledger.entries().items())
    )
    inbox = tuple((a.room, a.generation) for a in rank.inbox)
    return (
        rooms,
        rank.requested,
        rank.next_chunk,
        rank.phase,
        rank.landed,
        tuple(sorted(rank.in_flight)),
        inbox,
        rank.cleared,
        rank.errors,
        rank.must_try,
        rank.rerequested,
        getattr(rank.ledger, "mutant_state", None),
        rank.decode,
    )


def _tracker_key(tracker: HoldTracker) -> tuple[object, ...]:
    rooms = tuple(
        (
            k,
            e.state,
            tuple(sorted(e.succeeded)),
            tuple(sorted(e.generations)),
            tuple(sorted(e.proven)),
            e.fenced,
        )
        for k, e in sorted(tracker._rooms.items())
    )
    return (rooms, tracker._generations.__reduce__()[1])


def _clone_ledger(old: RoomLedger) -> RoomLedger:
    return old.copy()


def _clone_rank(rank: Rank, ledgers: dict[int, RoomLedger] | None = None) -> Rank:
    ledgers = {} if ledgers is None else ledgers
    ledger = ledgers.get(id(rank.ledger))
    if ledger is None:
        ledger = ledgers[id(rank.ledger)] = _clone_ledger(rank.ledger)
    return Rank(
        ledger,
        rank.requested,
        rank.next_chunk,
        rank.phase,
        rank.landed,
        set(rank.in_flight),
        list(rank.inbox),
        rank.cleared,
        rank.errors,
        rank.must_try,
        rank.incarnation,
        rank.rerequested,
        rank.decode,
    )


def _clone_tracker(tracker: HoldTracker) -> HoldTracker:
    new = copy.copy(tracker)
    new._generations = copy.copy(tracker._generations)
    new._rooms = {
        k: HoldRoom(
            v.pages,
            v.ranks,
            v.state,
            set(v.succeeded),
            set(v.generations),
            set(v.proven),
            v.fenced,
            v.held_at,
            v.deadline,
            v.quarantined_at,
            v.resend_at,
            v.resend_every,
            v.exited,
        )
        for k, v in tracker._rooms.items()
    }
    new._holds = {k: new._rooms[k] for k in tracker._holds}
    new._wakeups = list(tracker._wakeups)
    new._wakeup_seq = copy.copy(tracker._wakeup_seq)
    new._pages = dict(tracker._pages)
    return new


@dataclass
class Report:
    states: int = 0
    transitions: int = 0
    terminals: int = 0
    reuses: int = 0  #: states where a rank took the reused room id as a new request


LedgerFactory = Callable[[int], RoomLedger]


def initial(
    ranks: int, ledger_factory: LedgerFactory, tracker_factory: Callable[[], HoldTracker], decodes: int = 1
) -> World:
    tracker = tracker_factory()
    tracker.open(ROOM, (0, 1), frozenset(range(ranks)))
    if decodes == 1:
        return World([Rank(ledger_factory(r)) for r in range(ranks)], tracker)
    # Every rank writes ROOM into both decodes: one lane each, over one ledger.
    second = HoldTracker(DECODE2, "reply-2", abort_timeout=10.0)
    second.open(ROOM, (0, 1), frozenset(range(ranks)))
    lanes = []
    for r in range(ranks):
        ledger = ledger_factory(r)
        lanes += [Rank(ledger), Rank(ledger, decode=DECODE2)]
    return World(lanes, tracker, second=Side(second))


def _key(rank: Rank) -> RoomKey:
    return RoomKey(rank.decode, ROOM)


def _side(world: World, decode: str) -> World | Side:
    """The decode's tracker and flags (``tracker``, ``aborted``, ``released``)."""
    if decode == DECODE:
        return world
    assert world.second is not None
    return world.second


def _lane(world: World, rank: int, decode: str) -> Rank:
    """Rank ``rank``'s worker lane for ``decode``."""
    return next(rk for rk in world.ranks if rk.ledger.rank == rank and rk.decode == decode)


def default_tracker() -> HoldTracker:
    return HoldTracker(DECODE, "reply", abort_timeout=10.0)


def _ack_out(world: World, r: int, actions: list[object]) -> None:
    for action in actions:
        if isinstance(action, SendAck):
            # the lane of the decode the ack is for: the same rank's other
            # decode's writes are into other pages
            rank = _lane(world, world.ranks[r].ledger.rank, action.ack.decode)
            if rank.in_flight or rank.phase == "write":
                raise Violation(
                    f"S1: rank {r} acked generation {action.ack.generation} to {action.ack.decode} "
                    "with a write that can land"
                )
            world.acks.append(action.ack)


def _release(world: World, actions: list[object], decode: str = DECODE) -> None:
    for action in actions:
        if isinstance(action, Release):
            if any(rank.in_flight or rank.phase == "write" for rank in world.ranks if rank.decode == decode):
                raise Violation(f"S2: {decode}'s pages released while a write can still land")
            _side(world, decode).released = True
        elif isinstance(action, SendAbort):
            _lane(world, action.rank, decode).inbox.append(action.abort)


def steps(
    world: World, chunks: int, errors: int, deadline: bool = True, reuse: bool = True
) -> Iterator[tuple[str, Callable[[World], None]]]:
    """Every step enabled in ``world``, each as (label, mutate-a-copy). A
    step labelled ``r<i>:`` changes nothing but lane ``i``, the lanes sharing
    its ledger, the acks in flight and the world's counters (the explorer
    copies only those for it); a ``decode`` step may change anything."""
    for r, rank in enumerate(world.ranks):
        if not rank.requested:

            def request(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.ledger.request(_key(rk), 1)
                rk.requested = True
                rk.incarnation = rk.ledger.incarnation(_key(rk))

            yield f"r{r}:request", request
        if rank.requested and rank.phase == "idle" and rank.next_chunk < chunks and not rank.cleared:

            def dequeue(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                write = rk.ledger.dequeue(_key(rk), rk.incarnation)
                rk.phase = "write" if write else "skip"

            yield f"r{r}:dequeue", dequeue
        if rank.phase == "skip":

            def skip(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.phase, rk.next_chunk = "idle", rk.next_chunk + 1
                _ack_out(w, r, list(rk.ledger.skipped(_key(rk))))

            yield f"r{r}:skip", skip
        if rank.phase == "write":

            def post(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                if hasattr(rk.ledger, "count_at_post"):  # a mutant that counts late
                    rk.ledger.count_at_post(_key(rk))
                rk.phase, rk.landed = "posted", False
                rk.in_flight.add(rk.next_chunk)

            yield f"r{r}:post", post
        for chunk in sorted(rank.in_flight):

            def land(w: World, r: int = r, chunk: int = chunk) -> None:
                rk = w.ranks[r]
                if _side(w, rk.decode).released:
                    raise Violation(f"S2: rank {r} chunk {chunk} landed after decode released the pages")
                rk.in_flight.discard(chunk)
                if rk.phase == "posted" and chunk == rk.next_chunk:
                    rk.landed = True

            yield f"r{r}:land{chunk}", land
        if rank.phase == "posted" and rank.landed:

            def done(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.phase, rk.next_chunk = "idle", rk.next_chunk + 1
                _ack_out(w, r, list(rk.ledger.landed(_key(rk), rk.next_chunk == chunks)))

            yield f"r{r}:done", done
        if rank.phase == "posted" and sum(rk.errors for rk in world.ranks) < errors:

            def err_settled(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.in_flight.discard(rk.next_chunk)  # settled: landed or never will
                rk.phase, rk.next_chunk, rk.errors = "idle", rk.next_chunk + 1, rk.errors + 1
                _ack_out(w, r, list(rk.ledger.failed(_key(rk), True, "err")))

            def err_unsettled(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.phase, rk.next_chunk, rk.errors = "idle", rk.next_chunk + 1, rk.errors + 1
                w.unsettled_errors += 1
                _ack_out(w, r, list(rk.ledger.failed(_key(rk), False, "err")))

            yield f"r{r}:err_settled", err_settled
            yield f"r{r}:err_unsettled", err_unsettled
        # The fence is the rank's (one writer for every decode): it waits
        # until none of its lanes is posting, and stops all of them.
        lanes = [rk for rk in world.ranks if rk.ledger is rank.ledger]
        if rank is lanes[0] and all(rk.phase == "idle" for rk in lanes) and rank.ledger.poisoned():

            def fence(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                for lane in w.ranks:
                    if lane.ledger is rk.ledger:
                        lane.in_flight.clear()  # the fence stops every byte posted before it
                _ack_out(w, r, list(rk.ledger.fenced()))

            yield f"r{r}:fence", fence
        if rank.requested and not rank.cleared and rank.phase == "idle":

            def clear(w: World, r: int = r) -> None:
                w.ranks[r].cleared = True
                _ack_out(w, r, list(w.ranks[r].ledger.clear(_key(w.ranks[r]))))

            yield f"r{r}:clear", clear
        if reuse and _side(world, rank.decode).released and rank.requested and not rank.rerequested:

            def request_again(w: World, r: int = r) -> None:
                # Decode has its pages back and reuses the id: the rank may take
                # it as a new request, and the old request's chunks (still
                # queued here) must then write nothing.
                rk = w.ranks[r]
                rk.ledger.request(_key(rk), 2)
                rk.rerequested = True

            yield f"r{r}:request_again", request_again
        if rank.inbox:

            def deliver_abort(w: World, r: int = r) -> None:
                # The runtime takes its lock twice: abort(), the hook, try_ack().
                rk = w.ranks[r]
                rk.ledger.abort(rk.inbox.pop(0), now=0.0)
                rk.must_try = True

            yield f"r{r}:abort", deliver_abort
        if rank.must_try:

            def try_after_abort(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.must_try = False
                _ack_out(w, r, list(rk.ledger.try_ack(_key(rk))))

            yield f"r{r}:abort_try", try_after_abort
    if not world.aborted:

        def abort(w: World) -> None:
            w.aborted = True
            _release(w, list(w.tracker.abort(ROOM, now=0.0)))

        yield "decode:abort", abort
    if deadline and world.aborted and not world.ticked and not world.released:

        def tick(w: World) -> None:
            w.ticked = True
            _release(w, list(w.tracker.tick(now=1e9)))

        yield "decode:deadline", tick
    if world.second is not None and not world.second.aborted:

        def abort_second(w: World) -> None:
            assert w.second is not None
            w.second.aborted = True
            _release(w, list(w.second.tracker.abort(ROOM, now=0.0)), DECODE2)

        yield "decode2:abort", abort_second
    for i in range(len(world.acks)):

        def deliver_ack(w: World, i: int = i) -> None:
            ack = w.acks.pop(i)
            _release(w, list(_side(w, ack.decode).tracker.ack(ack, now=0.0)), ack.decode)

        yield f"decode:ack{i}", deliver_ack


def explore(
    ranks: int = 2,
    chunks: int = 2,
    errors: int = 1,  # ERRs in the whole run, each at any point
    deadline: bool = True,  # decode's deadline may pass at any point
    reuse: bool = True,  # decode may reuse the room id once released
    ledger_factory: LedgerFactory = RoomLedger,
    tracker_factory: Callable[[], HoldTracker] = default_tracker,
    decodes: int = 1,  # 2: every rank serves the room to two decodes
) -> Report:
    """Visit every reachable state; raise :class:`Violation` on the first bad one."""
    report = Report()
    start = initial(ranks, ledger_factory, tracker_factory, decodes)
    seen = {start.key()}
    stack = [start]
    while stack:
        world = stack.pop()
        report.states += 1
        enabled = list(steps(world, chunks, errors, deadline, reuse))
        if not enabled:
            report.terminals += 1
            _check_terminal(world)
        for label, step in enabled:
            nxt = world.clone(_lane_of(label))
            step(nxt)
            report.transitions += 1
            key = nxt.key()
            if key not in seen:
                seen.add(key)
                stack.append(nxt)
                report.reuses += any(
                    rk.rerequested and rk.ledger.incarnation(_key(rk)) not in (None, rk.incarnation)
                    for rk in nxt.ranks
                )
    return report


def _lane_of(label: str) -> int | None:
    """The lane a step labelled ``r<lane>:...`` changes (see :func:`steps`);
    None for decode's steps, which may change any lane (an ABORT sent)."""
    return int(label[1 : label.index(":")]) if label.startswith("r") else None


def _check_terminal(world: World) -> None:
    if world.second is not None and world.second.aborted:
        state = world.second.tracker.state(ROOM)
        if state is HoldState.HELD:
            raise Violation(f"L2: {DECODE2}'s aborted room is still held with nothing left to happen")
        if not world.second.released and world.unsettled_errors == 0:
            raise Violation(f"L2: {DECODE2}'s room not released although every write settled (state {state})")
    if not world.aborted:
        return
    state = world.tracker.state(ROOM)
    if state is HoldState.HELD:
        raise Violation("L2: an aborted room is still held with nothing left to happen")
    if not world.released and world.unsettled_errors == 0:
        raise Violation(f"L2: room not released although every write settled (state {state})")
