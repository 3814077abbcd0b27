"""Exhaustive exploration of the protocol core's interleavings.

A small world: one room, ``ranks`` prefill ranks each writing ``chunks``
chunks into decode's pages, one abort by each of ``decodes`` decode endpoints
(two: one prefill room feeding two decodes, whose ABORTs can be pending at
once), and, at every point, the faults the brief names: a handle failing with its write settled or still in
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
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import attrs

from kvconn.protocol.hold import HoldState, HoldTracker, Release, SendAbort
from kvconn.protocol.hold import _Room as HoldRoom
from kvconn.protocol.ledger import RoomLedger, SendAck
from kvconn.protocol.ledger import _Room as LedgerRoom
from kvconn.protocol.messages import Abort, AbortAck

ROOM = 7
DECODE = "decode"
#: Decode endpoints by index; the first is DECODE.
DECODES = (DECODE, "decode-b")


class Violation(AssertionError):
    pass


@dataclass
class Rank:
    ledger: RoomLedger
    requested: set[int] = field(default_factory=set)  # the decodes whose request arrived
    next_chunk: int = 0
    phase: str = "idle"  # idle | write | posted
    landed: bool = False  # the posted chunk's bytes are in the destination
    in_flight: set[int] = field(default_factory=set)  # chunk ids that may still land
    inbox: list[Abort] = field(default_factory=list)
    cleared: bool = False
    errors: int = 0
    must_try: bool = False  # an ABORT was registered, its one try still to come


@dataclass
class Decode:
    tracker: HoldTracker
    aborted: bool = False
    ticked: bool = False
    released: bool = False


@dataclass
class World:
    ranks: list[Rank]
    decodes: list[Decode]
    acks: list[AbortAck] = field(default_factory=list)
    unsettled_errors: int = 0

    @property
    def tracker(self) -> HoldTracker:
        """The first decode's tracker (the only one in a one-decode world)."""
        return self.decodes[0].tracker

    @property
    def aborted(self) -> bool:
        return any(d.aborted for d in self.decodes)

    @property
    def released(self) -> bool:
        """Some decode handed the room's pages out again."""
        return any(d.released for d in self.decodes)

    def key(self) -> tuple[object, ...]:
        """Everything that decides the future, as a hashable value; acks in
        flight are a multiset (delivery order is explored anyway)."""
        return (
            tuple(_rank_key(r) for r in self.ranks),
            tuple((_tracker_key(d.tracker), d.aborted, d.ticked, d.released) for d in self.decodes),
            tuple(sorted(attrs.astuple(a) for a in self.acks)),
            self.unsettled_errors,
        )

    def clone(self) -> World:
        # deepcopy was most of the explorer's time; these objects are small
        # and flat, so a copy of their mutable parts is enough.
        return World(
            [_clone_rank(r) for r in self.ranks],
            [Decode(_clone_tracker(d.tracker), d.aborted, d.ticked, d.released) for d in self.decodes],
            list(self.acks),
            self.unsettled_errors,
        )


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
        )
        for k, e in sorted(rank.ledger._rooms.items())
    )
    inbox = tuple((a.room, a.generation) for a in rank.inbox)
    return (
        rooms,
        tuple(sorted(rank.requested)),
        rank.next_chunk,
        rank.phase,
        rank.landed,
        tuple(sorted(rank.in_flight)),
        inbox,
        rank.cleared,
        rank.errors,
        rank.must_try,
        getattr(rank.ledger, "mutant_state", None),
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


def _clone_rank(rank: Rank) -> Rank:
    ledger = copy.copy(rank.ledger)
    ledger._poisoned = set(rank.ledger._poisoned)
    ledger._rooms = {
        k: LedgerRoom(
            v.status,
            v.decode,
            v.outstanding,
            v.stuck,
            dict(v.targets),
            set(v.acked),
            v.cleared,
            v.fenced,
            v.expires,
            v.scheduled,
        )
        for k, v in rank.ledger._rooms.items()
    }
    ledger._touched = set(rank.ledger._touched)
    ledger._expiry = [(t, seq, k, ledger._rooms.get(k, e)) for t, seq, k, e in rank.ledger._expiry]
    return Rank(
        ledger,
        set(rank.requested),
        rank.next_chunk,
        rank.phase,
        rank.landed,
        set(rank.in_flight),
        list(rank.inbox),
        rank.cleared,
        rank.errors,
        rank.must_try,
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
    new._pages = dict(tracker._pages)
    return new


@dataclass
class Report:
    states: int = 0
    transitions: int = 0
    terminals: int = 0


LedgerFactory = Callable[[int], RoomLedger]


def initial(
    ranks: int,
    ledger_factory: LedgerFactory,
    tracker_factory: Callable[[], HoldTracker],
    decodes: int = 1,
) -> World:
    trackers = []
    for name in DECODES[:decodes]:
        tracker = tracker_factory()
        tracker.decode, tracker.reply_to = name, f"reply-{name}"
        tracker.open(ROOM, (0, 1), frozenset(range(ranks)))
        trackers.append(tracker)
    return World([Rank(ledger_factory(r)) for r in range(ranks)], [Decode(t) for t in trackers])


def default_tracker() -> HoldTracker:
    return HoldTracker(DECODE, "reply", abort_timeout=10.0)


def _ack_out(world: World, r: int, actions: list[object]) -> None:
    rank = world.ranks[r]
    for action in actions:
        if isinstance(action, SendAck):
            if rank.in_flight or rank.phase == "write":
                raise Violation(
                    f"S1: rank {r} acked generation {action.ack.generation} with a write that can land"
                )
            world.acks.append(action.ack)


def _release(world: World, d: int, actions: list[object]) -> None:
    for action in actions:
        if isinstance(action, Release):
            if any(rank.in_flight or rank.phase == "write" for rank in world.ranks):
                raise Violation(f"S2: {DECODES[d]} released its pages while a write can still land")
            world.decodes[d].released = True
        elif isinstance(action, SendAbort):
            world.ranks[action.rank].inbox.append(action.abort)


def steps(
    world: World, chunks: int, errors: int, deadline: bool = True
) -> Iterator[tuple[str, Callable[[World], None]]]:
    """Every step enabled in ``world``, each as (label, mutate-a-copy)."""
    for r, rank in enumerate(world.ranks):
        for d in range(len(world.decodes)):
            if d in rank.requested:
                continue

            def request(w: World, r: int = r, d: int = d) -> None:
                w.ranks[r].ledger.request(ROOM, DECODES[d])
                w.ranks[r].requested.add(d)

            yield f"r{r}:request{d}", request
        if rank.requested and rank.phase == "idle" and rank.next_chunk < chunks and not rank.cleared:

            def dequeue(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                write = rk.ledger.dequeue(ROOM)
                rk.phase = "write" if write else "skip"

            yield f"r{r}:dequeue", dequeue
        if rank.phase == "skip":

            def skip(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.phase, rk.next_chunk = "idle", rk.next_chunk + 1
                _ack_out(w, r, list(rk.ledger.skipped(ROOM)))

            yield f"r{r}:skip", skip
        if rank.phase == "write":

            def post(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                if hasattr(rk.ledger, "count_at_post"):  # a mutant that counts late
                    rk.ledger.count_at_post(ROOM)
                rk.phase, rk.landed = "posted", False
                rk.in_flight.add(rk.next_chunk)

            yield f"r{r}:post", post
        for chunk in sorted(rank.in_flight):

            def land(w: World, r: int = r, chunk: int = chunk) -> None:
                if w.released:
                    raise Violation(f"S2: rank {r} chunk {chunk} landed after decode released the pages")
                rk = w.ranks[r]
                rk.in_flight.discard(chunk)
                if rk.phase == "posted" and chunk == rk.next_chunk:
                    rk.landed = True

            yield f"r{r}:land{chunk}", land
        if rank.phase == "posted" and rank.landed:

            def done(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.phase, rk.next_chunk = "idle", rk.next_chunk + 1
                _ack_out(w, r, list(rk.ledger.landed(ROOM, rk.next_chunk == chunks)))

            yield f"r{r}:done", done
        if rank.phase == "posted" and sum(rk.errors for rk in world.ranks) < errors:

            def err_settled(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.in_flight.discard(rk.next_chunk)  # settled: landed or never will
                rk.phase, rk.next_chunk, rk.errors = "idle", rk.next_chunk + 1, rk.errors + 1
                _ack_out(w, r, list(rk.ledger.failed(ROOM, True, "err")))

            def err_unsettled(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.phase, rk.next_chunk, rk.errors = "idle", rk.next_chunk + 1, rk.errors + 1
                w.unsettled_errors += 1
                _ack_out(w, r, list(rk.ledger.failed(ROOM, False, "err")))

            yield f"r{r}:err_settled", err_settled
            yield f"r{r}:err_unsettled", err_unsettled
        if rank.phase == "idle" and rank.ledger.poisoned():

            def fence(w: World, r: int = r) -> None:
                rk = w.ranks[r]
                rk.in_flight.clear()  # the fence stops every byte posted before it
                _ack_out(w, r, list(rk.ledger.fenced()))

            yield f"r{r}:fence", fence
        if rank.requested and not rank.cleared and rank.phase == "idle":

            def clear(w: World, r: int = r) -> None:
                w.ranks[r].cleared = True
                w.ranks[r].ledger.clear(ROOM)

            yield f"r{r}:clear", clear
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
                _ack_out(w, r, list(rk.ledger.try_ack(ROOM)))

            yield f"r{r}:abort_try", try_after_abort
    for d, dec in enumerate(world.decodes):
        if not dec.aborted:

            def abort(w: World, d: int = d) -> None:
                w.decodes[d].aborted = True
                _release(w, d, list(w.decodes[d].tracker.abort(ROOM, now=0.0)))

            yield f"{DECODES[d]}:abort", abort
        if deadline and dec.aborted and not dec.ticked and not dec.released:

            def tick(w: World, d: int = d) -> None:
                w.decodes[d].ticked = True
                _release(w, d, list(w.decodes[d].tracker.tick(now=1e9)))

            yield f"{DECODES[d]}:deadline", tick
    for i in range(len(world.acks)):

        def deliver_ack(w: World, i: int = i) -> None:
            ack = w.acks.pop(i)
            d = DECODES.index(ack.decode)  # the ack names the decode that aborted
            _release(w, d, list(w.decodes[d].tracker.ack(ack, now=0.0)))

        yield f"decode:ack{i}", deliver_ack


def explore(
    ranks: int = 2,
    chunks: int = 2,
    errors: int = 1,  # ERRs in the whole run, each at any point
    deadline: bool = True,  # decode's deadline may pass at any point
    ledger_factory: LedgerFactory = RoomLedger,
    tracker_factory: Callable[[], HoldTracker] = default_tracker,
    decodes: int = 1,  # decode endpoints fed by the room, each aborting it at any point
) -> Report:
    """Visit every reachable state; raise :class:`Violation` on the first bad one."""
    report = Report()
    start = initial(ranks, ledger_factory, tracker_factory, decodes)
    seen = {start.key()}
    stack = [start]
    while stack:
        world = stack.pop()
        report.states += 1
        enabled = list(steps(world, chunks, errors, deadline))
        if not enabled:
            report.terminals += 1
            _check_terminal(world)
        for _label, step in enabled:
            nxt = world.clone()
            step(nxt)
            report.transitions += 1
            key = nxt.key()
            if key not in seen:
                seen.add(key)
                stack.append(nxt)
    return report


def _check_terminal(world: World) -> None:
    for name, dec in zip(DECODES, world.decodes, strict=False):
        if not dec.aborted:
            continue
        state = dec.tracker.state(ROOM)
        if state is HoldState.HELD:
            raise Violation(f"L2: {name}'s aborted room is still held with nothing left to happen")
        if not dec.released and world.unsettled_errors == 0:
            raise Violation(f"L2: {name}'s room not released although every write settled (state {state})")
