"""Exhaustive exploration of a prefill rank's requests, senders and verdicts.

A small world around one real :class:`RankState` (and its ledger): one room
id, ``decodes`` decode endpoints that each request it, abort it at any
point, and reuse the id once its pages came back (``uses`` requests each);
an engine that makes senders (one of ``decodes`` decodes, or one per
request), sends one page per chunk, fails, clears, fails the room before any
decode asked, and lets the bootstrap deadline and the tombstone TTL pass;
one transfer worker that dequeues, writes, lands or fails chunks (settled,
or unsettled or with a raising hook: then the chunk may still land, late,
until a fence the writer is proven to have runs; the fence may fail); a network
that delivers each decode's messages in order (one connection each: the
decodes' interleave in any order), replays a recorded request once at any
time, and delivers each within the tombstone TTL or never (what tombstones
rest on).

It checks, in every reachable state:

* R1: no ABORT_ACK to a decode while a write into that decode's pages can
  still land;
* R2: no chunk is written into pages decode already took back (a chunk of an
  earlier request, of a reused room id, included), and decode is told
  SUCCESS only with every page of its current request written by it;
* R3: a sender says ``settled()`` only once no chunk it queued can still be
  written or is being written (the engine then reuses its source pages).
* R4 (``drain``): a draining rank announces ``done`` (decode then takes back
  every page it holds for the rank) only once no write of it can land: none
  is being written, and none is written after (R2 then covers the pages).
* R5: a fenced ack, and a drain's announcement, name every TCP connection
  the fences closed (decode counts them only once its ends drained: bytes
  sent before a fence may still sit in its socket buffers).

R1, R2 and R4 count a chunk that may still land late (unsettled, a raising
hook) as being written until a proven fence. R3 does not: such a chunk is of
a failed room, whose pages decode holds until a proof (R1, R2), so what it
may still read from source pages the engine reused lands nowhere decode
uses (and a writer without a proven fence would otherwise keep the engine's
source pages for its whole life).
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import attrs

from kvconn.errors import KvconnError
from kvconn.protocol.drain import Announce
from kvconn.protocol.ledger import NotifyDecode, RoomKey, RoomLedger, SendAck
from kvconn.protocol.messages import Abort, RoomOutcome, TcpConnection, TransferRequest
from kvconn.protocol.rank import (
    AbortHook,
    Action,
    ChunkEnd,
    Fence,
    Pairing,
    RankState,
    SenderState,
    WriterTerms,
)

ROOM = 3
SESSION = 11
BOOTSTRAP_S = 10.0
TTL_S = 100.0
TIMES = (0.0, 50.0, 500.0)  #: now, past the bootstrap deadline, past the TTL
DECODES = ("d0", "d1")


class Violation(AssertionError):
    pass


@dataclass
class Decode:
    name: str
    use: int = 0  #: which request of the room id (its pages: pages(name, use))
    phase: str = "idle"  # idle | asked | aborting | done
    seq: int = 0
    released: set[int] = field(default_factory=set)  #: uses whose pages decode took back
    landed: set[int] = field(default_factory=set)  #: pages of the current use written


@dataclass
class Chunk:
    sender: int
    key: RoomKey
    incarnation: int | None
    page: int
    last: bool


@dataclass
class World:
    state: RankState[str]
    decodes: list[Decode]
    senders: list[SenderState] = field(default_factory=list)
    #: to the rank: (message, when sent, a replay)
    network: list[tuple[object, float, bool]] = field(default_factory=list)
    delivered: list[TransferRequest] = field(default_factory=list)
    queue: list[Chunk] = field(default_factory=list)
    writing: Chunk | None = None
    settled: set[int] = field(default_factory=set)  #: senders the engine saw settled
    time: int = 0
    replays: int = 0
    errors: int = 0
    failed_room: bool = False
    failed: set[int] = field(default_factory=set)
    cleared: set[int] = field(default_factory=set)
    npages: int = 1  #: pages of every request, one chunk each
    draining: bool = False  #: the engine told the rank to drain
    done: bool = False  #: the rank announced it drained
    #: chunks that ended unsettled or with a raising hook: they may land late
    limbo: list[Chunk] = field(default_factory=list)
    unsettled: int = 0  #: chunks that ended so
    fences: int = 0  #: Fence actions not carried out yet
    #: the TCP connections each fence closed so far
    closed: list[TcpConnection] = field(default_factory=list)

    def clone(self) -> World:
        # pickle keeps shared references (a leg's entry is the ledger's) and is
        # several times faster than deepcopy. The weak dictionary does not
        # pickle: rebuilt from the copied senders, which alone hold what it names.
        taken = self.state._taken
        del self.state._taken
        try:
            new: World = pickle.loads(pickle.dumps(self, pickle.HIGHEST_PROTOCOL))
        finally:
            self.state._taken = taken
        new.state._taken = weakref.WeakValueDictionary(
            {leg.entry.incarnation: s for s in new.senders for leg in s.legs}
        )
        return new

    def decode(self, name: str) -> Decode:
        return next(d for d in self.decodes if d.name == name)


def pages(decode: str, use: int, npages: int) -> tuple[int, ...]:
    base = 100 * DECODES.index(decode) + 10 * use
    return tuple(base + i for i in range(npages))


def _use_of(page: int) -> tuple[str, int]:
    return DECODES[page // 100], (page % 100) // 10


def key_of(w: World) -> tuple[object, ...]:
    ledger = w.state.ledger
    rooms = tuple(
        (
            k,
            e.status,
            e.outstanding,
            e.stuck,
            tuple(sorted(e.targets.items())),
            tuple(sorted(e.acked)),
            e.cleared,
            e.tombstone,
            e.expires is None,
            e.seq,
            e.dst_pages,
            e.claimed,
            e.incarnation,
        )
        for k, e in sorted(ledger._rooms.items())
    )
    senders = tuple(
        (
            tuple((leg.key.decode, leg.entry.incarnation) for leg in s.legs),
            s.verdict,
            s.cleared,
            s.gave_up,
            s.sent,
            s.last_sent,
        )
        for s in w.senders
    )
    return (
        rooms,
        senders,
        tuple(sorted((d, p.last_seq) for d, p in w.state.peers.items())),
        tuple(sorted(w.state._given_up.items())),
        tuple((d.use, d.phase, d.seq, tuple(sorted(d.released)), tuple(sorted(d.landed))) for d in w.decodes),
        tuple(repr(m) for m in w.network),
        len(w.delivered),
        tuple(repr(c) for c in w.queue),
        repr(w.writing),
        tuple(repr(c) for c in w.limbo),
        w.unsettled,
        w.fences,
        len(w.closed),
        tuple(sorted(ledger.poisoned())),
        ledger.closed_by_fences,
        tuple(sorted(w.settled)),
        w.time,
        w.replays,
        w.errors,
        w.failed_room,
        tuple(sorted(w.failed)),
        tuple(sorted(w.cleared)),
        w.draining,
        w.done,
        None if w.state.drain is None else (w.state.drain.grace_over, w.state.drain.done),
    )


def _carry_out(w: World, actions: list[Action]) -> None:
    """Deliver the rank's actions: acks and statuses reach decode at once."""
    for action in actions:
        if isinstance(action, SendAck):
            decode = w.decode(action.ack.decode)
            if _may_land(w, decode.name):
                raise Violation(f"R1: ack to {decode.name} while a write into its pages can land")
            if action.ack.fenced and not set(w.closed) <= set(action.ack.closed):
                raise Violation(f"R5: a fenced ack names {action.ack.closed}, the fences closed {w.closed}")
            if decode.phase == "aborting":
                decode.released.add(decode.use)
                decode.use += 1
                decode.phase = "idle"
                decode.landed = set()
        elif isinstance(action, NotifyDecode) and action.status.outcome is RoomOutcome.SUCCESS:
            decode = w.decode(action.decode)
            if _may_land(w, decode.name):
                raise Violation(f"R2: {decode.name} told SUCCESS while a write into its pages can land")
            if decode.phase != "asked":
                continue
            want = set(pages(decode.name, decode.use, w.npages))
            if decode.landed != want:
                raise Violation(
                    f"R2: {decode.name} told SUCCESS with pages {sorted(want - decode.landed)} unwritten"
                )
            decode.released.add(decode.use)  # finished: the pages are the engine's
            decode.use += 1
            decode.phase = "idle"
            decode.landed = set()
        elif isinstance(action, AbortHook):
            _carry_out(w, w.state.abort_hooked(action.abort, raised=False))
        elif isinstance(action, Fence):
            w.fences += 1
        elif isinstance(action, Announce) and action.done:
            if w.writing is not None or w.limbo:
                raise Violation("R4: drained announced while a write can land")
            if not set(w.closed) <= set(action.closed):
                raise Violation(f"R5: drained announced naming {action.closed}, the fences closed {w.closed}")
            w.done = True
            decode = w.decode(action.decode)
            if decode.phase in ("asked", "aborting"):
                # The drain is decode's proof: it takes the pages back.
                decode.released.add(decode.use)
                decode.use += 1
                decode.phase = "idle"
                decode.landed = set()


def _may_land(w: World, decode: str) -> bool:
    """A write into ``decode``'s pages is being written, or may land late."""
    return any(c.key.decode == decode for c in ([w.writing] if w.writing else []) + w.limbo)


def _check_settled(w: World, i: int) -> None:
    if w.state.settled(w.senders[i]):
        if w.writing is not None and w.writing.sender == i:
            raise Violation(f"R3: sender {i} settled while its chunk is being written")
        w.settled.add(i)


def _write(w: World, chunk: Chunk, late: bool = False) -> None:
    """``chunk``'s bytes reach decode's page now (``late``: from limbo)."""
    decode, use = _use_of(chunk.page)
    if use in w.decode(decode).released:
        raise Violation(
            f"R2: chunk of sender {chunk.sender} written into page {chunk.page}, taken back by {decode}"
        )
    if chunk.sender in w.settled and not late:
        raise Violation(f"R3: sender {chunk.sender}'s chunk written after it said settled")
    if w.done:
        raise Violation(f"R4: chunk of sender {chunk.sender} written after the rank announced it drained")


def _dequeue(w: World) -> None:
    chunk = w.queue.pop(0)
    write = w.state.ledger.dequeue(chunk.key, chunk.incarnation)
    if not write:
        _carry_out(w, w.state.chunk_ended(chunk.key, ChunkEnd.SKIPPED))
        return
    _write(w, chunk)  # it starts writing now
    w.writing = chunk


def steps(w: World, cfg: Config) -> Iterator[tuple[str, Callable[[World], None]]]:
    for d in w.decodes:
        if d.phase == "idle" and d.use < cfg.uses:

            def request(w: World, name: str = d.name) -> None:
                dd = w.decode(name)
                dd.seq += 1
                dd.phase = "asked"
                request = TransferRequest(ROOM, name, pages(name, dd.use, cfg.npages), SESSION, dd.seq)
                w.network.append((request, TIMES[w.time], False))

            yield f"{d.name}:request", request
        if d.phase == "asked":

            def abort(w: World, name: str = d.name) -> None:
                w.decode(name).phase = "aborting"
                abort = Abort(ROOM, 1 + w.decode(name).use, name, f"tcp://{name}")
                w.network.append((abort, TIMES[w.time], False))

            yield f"{d.name}:abort", abort
    heads: set[str] = set()
    for m, (msg, _, replayed) in enumerate(w.network):
        # A decode's messages reach the rank in order (one connection); a
        # replay, injected by whoever recorded the frame, at any time.
        if not replayed:
            origin = msg.decode  # type: ignore[attr-defined]
            if origin in heads:
                continue
            heads.add(origin)

        def deliver(w: World, m: int = m) -> None:
            msg, _, _ = w.network.pop(m)
            if isinstance(msg, TransferRequest):
                w.delivered.append(msg)
            _carry_out(w, w.state.handle(msg, TIMES[w.time]))

        yield f"deliver:{type(w.network[m][0]).__name__}", deliver
    if w.replays < cfg.replays:
        for m in range(len(w.delivered)):

            def replay(w: World, m: int = m) -> None:
                w.replays += 1
                w.network.append((w.delivered[m], TIMES[w.time], True))

            yield f"replay:{m}", replay
    if len(w.senders) < cfg.senders:

        def make(w: World) -> None:
            w.senders.append(w.state.open_sender(ROOM, cfg.fan_out, TIMES[w.time]))

        yield "engine:sender", make
    for i, s in enumerate(w.senders):
        if not s.last_sent:
            for early in (False, True) if cfg.npages > 1 else (False,):

                def send(w: World, i: int = i, early: bool = early) -> None:
                    s = w.senders[i]
                    status, actions = w.state.poll(s, TIMES[w.time])
                    _carry_out(w, actions)
                    try:
                        # early: an engine's last chunk that leaves pages unwritten
                        plan = w.state.plan_send(s, range(1), early or s.sent + 1 == cfg.npages, status)
                    except KvconnError:
                        return  # refused: queues nothing
                    w.state.commit_send(s, plan)
                    for leg in plan.legs:
                        w.queue.append(Chunk(i, leg.key, leg.incarnation, leg.dst_pages[0], plan.last))

                yield f"s{i}:send{'-last' * early}", send
        if i not in w.failed and cfg.fail:

            def fail(w: World, i: int = i) -> None:
                w.failed.add(i)
                _carry_out(w, w.state.fail(w.senders[i], "engine", TIMES[w.time]))

            yield f"s{i}:fail", fail
        if i not in w.cleared:

            def clear(w: World, i: int = i) -> None:
                w.cleared.add(i)
                _carry_out(w, w.state.clear(w.senders[i], TIMES[w.time]))

            yield f"s{i}:clear", clear
        if i not in w.settled:

            def settle(w: World, i: int = i) -> None:
                _, actions = w.state.poll(w.senders[i], TIMES[w.time])
                _carry_out(w, actions)
                _check_settled(w, i)

            yield f"s{i}:settled?", settle
    if cfg.fail_room and not w.failed_room:

        def fail_room(w: World) -> None:
            w.failed_room = True
            _carry_out(w, w.state.fail_room(ROOM, "engine", TIMES[w.time]))

        yield "engine:fail_room", fail_room
    if cfg.drain and not w.draining:

        def drain(w: World) -> None:
            w.draining = True
            # The grace runs out at the next tick.
            _carry_out(w, w.state.begin_drain(TIMES[w.time], 1.0))

        yield "engine:drain", drain
    if w.draining and not w.done:

        def drain_tick(w: World) -> None:
            _carry_out(w, w.state.drain_tick(TIMES[w.time])[1])

        yield "engine:drain_tick", drain_tick
    if w.time + 1 < len(TIMES):

        def tick(w: World) -> None:
            w.time += 1
            # The assumption tombstones rest on: a message is delivered
            # within their TTL, or never.
            w.network = [m for m in w.network if m[1] + TTL_S > TIMES[w.time]]
            _carry_out(w, w.state.tick(TIMES[w.time]))

        yield "tick", tick
    if w.writing is None and w.queue:
        yield "worker:dequeue", _dequeue
    if w.writing is not None:

        def land(w: World) -> None:
            chunk, w.writing = w.writing, None
            assert chunk is not None
            decode, _ = _use_of(chunk.page)
            w.decode(decode).landed.add(chunk.page)
            _carry_out(w, w.state.chunk_ended(chunk.key, ChunkEnd.LANDED, chunk.last))

        yield "worker:land", land
        if w.errors < cfg.errors:

            def err(w: World) -> None:
                chunk, w.writing = w.writing, None
                assert chunk is not None
                w.errors += 1
                _carry_out(w, w.state.chunk_ended(chunk.key, ChunkEnd.FAILED_SETTLED))

            yield "worker:err", err
        if w.unsettled < cfg.unsettled:
            for end in (ChunkEnd.UNSETTLED, ChunkEnd.PLUGIN_ERROR):

                def lost(w: World, end: ChunkEnd = end) -> None:
                    chunk, w.writing = w.writing, None
                    assert chunk is not None
                    w.unsettled += 1
                    w.limbo.append(chunk)  # some of its bytes may still land
                    _carry_out(w, w.state.chunk_ended(chunk.key, end, reason=end.value))

                yield f"worker:{end.value}", lost
    for i in range(len(w.limbo)):

        def late(w: World, i: int = i) -> None:
            _write(w, w.limbo.pop(i), late=True)  # a late byte lands

        yield f"limbo:land{i}", late
    if w.fences:
        for ok in (True, False) if cfg.fence_fails else (True,):

            def fence(w: World, ok: bool = ok) -> None:
                w.fences -= 1
                if not w.state.fence_begins():
                    return  # nothing to fence: the writer's hook is not called
                closed: frozenset[TcpConnection] = frozenset()
                if ok:
                    closed = frozenset({TcpConnection("127.0.0.1", 40000 + len(w.closed), "127.0.0.1", 6000)})
                    w.closed += closed
                    if cfg.writer_fence:
                        w.limbo = []  # proven: nothing posted before it can land
                    # else the hook said True, but proves nothing: late bytes may come
                _carry_out(w, w.state.fence_ended(ok, closed))

            yield f"writer:fence{'-ok' if ok else '-fails'}", fence


@attrs.frozen
class Config:
    decodes: int = 1
    fan_out: int = 1  #: decodes per sender
    uses: int = 2
    npages: int = 1
    senders: int = 2
    replays: int = 1
    errors: int = 1
    fail: bool = True
    fail_room: bool = True
    drain: bool = False
    unsettled: int = 0  #: chunks that may end unsettled or with a raising hook
    writer_fence: bool = True  #: the writer's fence is proven (else its True proves nothing)
    fence_fails: bool = False  #: a fence may fail


@attrs.frozen
class Report:
    states: int
    transitions: int
    terminals: int
    reuses: int  #: terminal states where a decode's second request succeeded or was aborted


StateFactory = Callable[[Config], RankState[str]]


def reachable(address: str) -> bool:
    return True


def terms(cfg: Config) -> WriterTerms:
    return WriterTerms("null", 1.0, writer_fence=cfg.writer_fence)


def default_state(cfg: Config) -> RankState[str]:
    return RankState(RoomLedger(0, TTL_S, SESSION), BOOTSTRAP_S, reachable, terms(cfg))


def initial(cfg: Config, factory: StateFactory = default_state) -> World:
    state = factory(cfg)
    for name in DECODES[: cfg.decodes]:
        state.add_peer(name, f"tcp://{name}", Pairing("layout", source_pages=1000))
    return World(state, [Decode(name) for name in DECODES[: cfg.decodes]], npages=cfg.npages)


def explore(cfg: Config, factory: StateFactory = default_state, limit: int = 2_000_000) -> Report:
    """Depth-first over every interleaving; raises Violation with the path."""
    start = initial(cfg, factory)
    seen = {key_of(start)}
    stack: list[tuple[World, tuple[str, ...]]] = [(start, ())]
    transitions = terminals = reuses = 0
    while stack:
        world, path = stack.pop()
        here = key_of(world)
        moved = False
        for label, step in steps(world, cfg):
            nxt = world.clone()
            try:
                step(nxt)
            except Violation as exc:
                raise Violation(f"{exc}\n  after: {' '.join((*path, label))}") from None
            transitions += 1
            k = key_of(nxt)
            moved = moved or k != here
            if k not in seen:
                seen.add(k)
                if len(seen) > limit:
                    raise RuntimeError(f"more than {limit} states: make the world smaller")
                stack.append((nxt, (*path, label)))
        if not moved:
            terminals += 1
            reuses += any(1 in d.released for d in world.decodes)
    return Report(len(seen), transitions, terminals, reuses)
