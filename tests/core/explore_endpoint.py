"""Exhaustive exploration of a decode endpoint's state machine
(:class:`~kvconn.protocol.endpoint.EndpointState`) in small worlds.

The world: one or two prefill instances, rank processes at their addresses,
the engine opening rooms (reusing a room id once its pages came back),
aborting and finishing them, and the clock ticking. Every step calls the
real machine; the explorer plays the network (each peer's messages in order, peers
interleaved in every way), the rank
processes and the runtime's ``/proc`` probes. A rank process takes a request
naming its session, completes it, or is aborted and acks (plainly, or after
a fence whose closed connections have yet to drain); it may exit (what it
sent may still arrive until our ends drain), be frozen (it reads nothing,
writes on, and resumes, if at all, before the clock's last step), a new
process may take its address (a restart) while the earlier one still writes,
and a process may drain (protocol/drain.py): announce it to every decode name
whose Hello it took, refuse requests from then on, fail what it still writes
and announce it drained, naming the connections its fences closed. The
engine may drain the endpoint itself (``EndpointState.begin_drain``; its
wait is played at each tick: ``drain_tick``).
With the owner fence on, the runtime's fence succeeds (nothing a process was
asked under the old name can land any more) or fails, before anything else
happens; a rank process knows decode by the names whose Hello it took, and
drops a request under any other.

Checked in every reachable state:

* S: the pages of a room are released (or finished by the engine) only when
  no process that took the room's current request can still write into them.
* L: from every terminal state, once time passes and every message and
  connection drains, every aborted room whose writers all stopped is
  released (no page pinned forever once its proof exists), and no open
  request is left TRANSFERRING whose writer process is gone, replaced or
  silent (frozen for good: it answers no Hello).
  With the owner fence on (and succeeding), no room stays held at all, even
  with its writer frozen for good, and no request is left TRANSFERRING that
  no rank process took (a rank asked before it took the new name).
  Once the endpoint drained, no room is left open past its grace, and its
  report comes (drained, or what is held then).
* The decode drain's report says what is held when it comes: never
  "drained" while a page is not back (S).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from endpoint_world import HERE, NAME, writer
from explore_endpoint_world import (
    CLOSED,
    DT,
    SETTLE_S,
    Factory,
    Limits,
    Proc,
    Report,
    Violation,
    World,
    _clone,
    _key,
)

from kvconn.errors import UnavailableError
from kvconn.protocol.drain import GRACE_OVER, REFUSED, DrainingError
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import (
    Action,
    BootstrapTick,
    CheckDrain,
    FenceAsOwner,
    Identified,
    Identify,
    OwnerFenceDone,
    OwnerFenceError,
    Release,
    Send,
    Tick,
    Undrained,
)
from kvconn.protocol.hold import HoldState, HoldTracker
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import (
    Abort,
    AbortAck,
    Hello,
    HelloAck,
    Message,
    RankDraining,
    RoomOutcome,
    RoomStatus,
    TransferRequest,
)
from kvconn.protocol.owner_fence import OwnerFencePolicy


def initial(instances: Sequence[Sequence[str]], limits: Limits, factory: Factory) -> World:
    tracker = HoldTracker(NAME, "tcp://decode", abort_timeout=1.5, resend_interval=1.0)
    options: dict[str, object] = {}
    if limits.owner_fence_after_s is not None:
        options["owner_fence"] = OwnerFencePolicy(limits.owner_fence_after_s, DT, capable=True)
    state = factory(
        NAME,
        tracker,
        num_pages=4,
        heartbeat_interval_s=limits.heartbeat_interval_s,
        peer_timeout_s=limits.peer_timeout_s,
        transfer_timeout_s=limits.transfer_timeout_s,
        **options,
    )
    world = World(state, {})
    for index, addresses in enumerate(instances):
        session = 1 + 100 * index if limits.distinct_sessions else 1
        hello = Hello(NAME, "tcp://decode", "null", 0, 1, 1500, b"")
        instance = state.begin_bootstrap(tuple(addresses), hello, 0.0, timeout_s=1.0, resend_interval_s=1.0)
        for rank, address in enumerate(addresses):
            world.procs[address] = [Proc(address, rank, session)]
            ack = HelloAck(rank, address, HERE, writer(address, session).pid, 1, "", session)
            _carry(world, state.handle(ack, 0.0))
        _carry(world, state.handle(BootstrapTick(instance), 0.0))
    world.net.clear()
    return world


# -- the runtime's part: carrying out actions -------------------------------------
def _carry(world: World, actions: Sequence[Action]) -> None:
    for action in actions:
        if isinstance(action, Send):
            world.net.append((f"decode>{action.address}", action.address, action.message))
        elif isinstance(action, Identify):
            ack = action.ack
            _carry(world, world.state.handle(Identified(ack, writer(ack.address, ack.session)), world.now))
        elif isinstance(action, CheckDrain):
            drained = not _proc_of(world, action.ack.session, action.ack.rank).undrained
            _carry(world, world.state.handle(Undrained(action.ack, drained), world.now))
        elif isinstance(action, Release):
            _check_release(world, action.room, "released")
        elif isinstance(action, FenceAsOwner):
            world.fence_due = True


def _owner_fence(world: World, ok: bool, endpoint: bool = True) -> None:
    """The runtime's owner fence ends: done (the old endpoint is gone, so
    nothing any process was asked so far can land, nor any byte on its way;
    without ``endpoint`` the new one could not be made yet) or failed
    (nothing changed)."""
    world.fence_due = False
    if not ok or not endpoint:
        world.fence_fails += 1
    if not ok:
        _carry(world, world.state.handle(OwnerFenceError("refused"), world.now))
        return
    world.fenced |= {world.state.name}
    for procs in world.procs.values():
        for p in procs:
            for q, how in p.taken.items():
                if how == "writing" and p.alive and not p.frozen:
                    _write_fails(world, p, q)
            p.taken = dict.fromkeys(p.taken, "stopped")
            p.undrained = False
    _carry(world, world.state.handle(OwnerFenceDone(b"fenced" if endpoint else None), world.now))


def _write_fails(world: World, proc: Proc, q: int) -> None:
    """``proc``'s writes of request ``q`` go to metadata an owner fence cut
    off: they fail, and it says so (under the name it was asked by)."""
    key = (world.names[q], world.requests[q].room)  # type: ignore[attr-defined]
    proc.taken[q] = "stopped"
    proc.rooms[key] = ("failed", proc.rooms[key][1], False, False)
    status = RoomStatus(key[1], proc.rank, RoomOutcome.FAILED, "transport error", key[0], proc.session)
    world.net.append((_from(proc), "decode", status))


def _proc_of(world: World, session: int, rank_id: int) -> Proc:
    instance, _ = world.state._rank_of[rank_id]
    address = instance.addresses[world.state._rank_of[rank_id][1]]
    return next(p for p in world.procs[address] if p.session == session)


def _proc(world: World, address: str, session: int) -> Proc:
    return next(p for p in world.procs[address] if p.session == session)


def _check_release(world: World, room: int, how: str) -> None:
    q = world.current[room]
    for procs in world.procs.values():
        for proc in procs:
            if proc.taken.get(q) in ("writing", "draining"):
                raise Violation(
                    f"S: room {room} {how} while process {proc.address}/{proc.session} can still write it "
                    f"({proc.taken[q]})"
                )


def _tick(world: World) -> None:
    state, now = world.state, world.now
    probes = state.probes(now)
    dead = {writer(p.address, p.session) for ps in world.procs.values() for p in ps if not p.alive}
    gone = frozenset(w for w in probes.owed | probes.live if w in dead)
    peers_drained = not any(not p.alive and p.undrained for ps in world.procs.values() for p in ps)
    drained = tuple(a for a in probes.acks if not _proc_of(world, a.session, a.rank).undrained)
    _carry(world, state.handle(Tick(gone, peers_drained, drained), now))
    if world.decode_drain and world.drain_report is None:  # the engine's drain() waits
        report, actions = state.drain_tick(now)
        _carry(world, actions)
        if report is not None:
            world.drain_report = report
            left = state.held_pages() + state.tracker.pages_in(HoldState.OPEN)
            if report.drained and left:
                raise Violation(f"S: the decode drain reports drained with {left} pages not back")
            if report.pages_left != left:
                raise Violation(f"L: the decode drain reports {report} with {left} pages not back")


# -- the rank processes' part ------------------------------------------------------
def _from(proc: Proc) -> str:
    return f"{proc.address}/{proc.session}>decode"


def _deliver(world: World, address: str, msg: Message, fenced: bool = False) -> None:
    proc = world.procs[address][-1]
    if not proc.alive:
        return  # lost with the process
    if isinstance(msg, Hello):
        proc.peers |= {msg.decode}
        reply: Message = HelloAck(
            proc.rank, address, HERE, writer(address, proc.session).pid, 1, "", proc.session
        )
        world.net.append((_from(proc), "decode", reply))
    elif isinstance(msg, TransferRequest):
        if msg.session != proc.session or msg.decode not in proc.peers:
            return  # for another process of this rank, or a decode it does not know: dropped
        key = (msg.decode, msg.room)
        entry = proc.rooms.get(key)
        if proc.drain:
            # Refused: recorded Failed (nothing written), decode told.
            proc.rooms[key] = ("failed", msg.seq, False, entry[3] if entry else False)
            status = RoomStatus(msg.room, proc.rank, RoomOutcome.FAILED, REFUSED, msg.decode, proc.session)
            world.net.append((_from(proc), "decode", status))
            return
        if (
            entry is None
            or entry[0] == "success"
            or (entry[0] == "failed" and not entry[2] and entry[1] < msg.seq)
        ):
            proc.rooms[key] = ("live", msg.seq, False, False)
            q = world.by_seq[msg.seq]
            proc.taken.setdefault(q, "writing")
            if msg.decode in world.fenced and proc.taken[q] == "writing":
                _write_fails(world, proc, q)
        else:
            proc.rooms[key] = (entry[0], max(entry[1], msg.seq), entry[2], entry[3])
    elif isinstance(msg, Abort):
        key = (msg.decode, msg.room)
        for q, how in proc.taken.items():
            mine = world.requests[q].room == msg.room and world.names[q] == msg.decode  # type: ignore[attr-defined]
            if how == "writing" and mine:
                proc.taken[q] = "draining" if fenced else "stopped"
                proc.undrained = proc.undrained or fenced
        entry = proc.rooms.get(key)
        if entry is None:
            entry = ("failed", 0, True, False)  # a tombstone
        elif entry[0] == "live":
            entry = ("failed", entry[1], False, fenced)
        proc.rooms[key] = entry
        # nothing of the room can land any more (a fence's bytes once drained): ack
        closed = CLOSED if entry[3] else ()
        ack = AbortAck(msg.room, proc.rank, msg.generation, entry[3], msg.decode, proc.session, closed)
        world.net.append((_from(proc), "decode", ack))


def steps(world: World, limits: Limits, instances: int) -> Iterator[tuple[str, Callable[[World], None]]]:
    state = world.state
    if world.fence_due:  # carried out before anything else (under the endpoint's lock)
        yield "fence:ok", lambda w: _owner_fence(w, True)
        if world.fence_fails < limits.fence_fails:
            yield "fence:fail", lambda w: _owner_fence(w, False)
            yield "fence:no_endpoint", lambda w: _owner_fence(w, True, endpoint=False)
        return
    for room, inst in limits.rooms:
        if state.tracker.state(room) is None and world.opened.get(room, 0) < limits.requests_per_room:

            def open_(w: World, room: int = room, inst: int = inst) -> None:
                instance = list(w.state.instances.values())[inst]
                try:
                    request, sends = w.state.open(room, (room,), instance, None, None, w.now)
                except (DrainingError, UnavailableError):
                    w.opened[room] = w.opened.get(room, 0) + 1  # refused: route elsewhere
                    return
                w.requests.append(request)
                q = w.current[room] = len(w.requests) - 1
                w.opened[room] = w.opened.get(room, 0) + 1
                w.names[q] = w.state.name
                for send in sends:
                    w.by_seq[send.message.seq] = q  # type: ignore[union-attr]
                _carry(w, sends)
                _carry(w, w.state.sent(request, [], w.now))

            yield f"open{room}", open_
    for room, q in world.current.items():
        request = world.requests[q]
        if state.current(request) and not request.aborted and not request.finished:  # type: ignore[attr-defined]
            if world.aborts < limits.aborts:

                def abort(w: World, q: int = q) -> None:
                    w.aborts += 1
                    _carry(w, w.state.abort(w.requests[q], w.now))  # type: ignore[arg-type]

                yield f"abort{room}", abort
            if request.verdict is KVPoll.SUCCESS:  # type: ignore[attr-defined]

                def finish(w: World, q: int = q, room: int = room) -> None:
                    _check_release(w, room, "finished")
                    w.state.finish(w.requests[q])  # type: ignore[arg-type]

                yield f"finish{room}", finish
    if limits.decode_drain and not world.decode_drain:

        def decode_drain(w: World) -> None:
            w.decode_drain = True
            _carry(w, w.state.begin_drain(w.now, DT, SETTLE_S))

        yield "decode-drain", decode_drain
    if world.ticks < limits.ticks:

        def tick(w: World) -> None:
            w.ticks += 1
            w.now += DT
            _tick(w)

        yield "tick", tick
    heads: set[str] = set()
    for i, (channel, _, msg) in enumerate(world.net):
        if channel in heads:
            continue  # behind an earlier message of its channel
        heads.add(channel)
        if dest_frozen(world, world.net[i][1]):
            continue  # waits in its socket until the process resumes

        def deliver(w: World, i: int = i, fenced: bool = False) -> None:
            _, dest, msg = w.net.pop(i)
            if dest == "decode":
                _carry(w, w.state.handle(msg, w.now))
            else:
                _deliver(w, dest, msg, fenced)

        yield f"deliver{i}", deliver
        if limits.fenced and isinstance(msg, Abort):
            yield f"deliver{i}:fenced", lambda w, i=i: deliver(w, i, True)  # type: ignore[misc]
    for address, procs in world.procs.items():
        for j, proc in enumerate(procs):
            for q, how in proc.taken.items():
                entry = proc.rooms.get((world.names[q], world.requests[q].room))  # type: ignore[attr-defined]
                live = proc.alive and not proc.frozen
                if how == "writing" and live and entry is not None and entry[0] == "live":

                    def complete(w: World, address: str = address, j: int = j, q: int = q) -> None:
                        p = w.procs[address][j]
                        p.taken[q] = "stopped"
                        key = (w.names[q], w.requests[q].room)  # type: ignore[attr-defined]
                        p.rooms[key] = ("success", p.rooms[key][1], False, False)
                        status = RoomStatus(key[1], p.rank, RoomOutcome.SUCCESS, "", key[0], p.session)
                        w.net.append((_from(p), "decode", status))

                    yield f"{address}/{proc.session}:complete{q}", complete
            if proc.alive and world.exits < limits.exits:

                def exit_(w: World, address: str = address, j: int = j) -> None:
                    p = w.procs[address][j]
                    p.alive, p.undrained = False, True
                    p.taken = {q: "draining" if how == "writing" else how for q, how in p.taken.items()}
                    w.exits += 1

                yield f"{address}/{proc.session}:exit", exit_
            if proc.alive and not proc.frozen and world.freezes < limits.freezes:

                def freeze(w: World, address: str = address, j: int = j) -> None:
                    w.procs[address][j].frozen = True
                    w.freezes += 1

                yield f"{address}/{proc.session}:freeze", freeze
            if proc.frozen and world.ticks < limits.ticks:  # else frozen for good

                def resume(w: World, address: str = address, j: int = j) -> None:
                    w.procs[address][j].frozen = False

                yield f"{address}/{proc.session}:resume", resume
            if proc.undrained:

                def drain(w: World, address: str = address, j: int = j) -> None:
                    p = w.procs[address][j]
                    p.undrained = False
                    p.taken = {q: "stopped" if how == "draining" else how for q, how in p.taken.items()}

                yield f"{address}/{proc.session}:drain", drain
            awake = proc.alive and not proc.frozen  # a frozen process sends nothing
            if awake and proc.drain == "" and world.drains < limits.drains:

                def drain_begin(w: World, address: str = address, j: int = j) -> None:
                    # Told to every decode name whose Hello it took (the runtime's peers).
                    p = w.procs[address][j]
                    p.drain = "draining"
                    w.drains += 1
                    for name in sorted(p.peers):
                        w.net.append((_from(p), "decode", RankDraining(p.rank, p.session, name, False)))

                yield f"{address}/{proc.session}:drain-begin", drain_begin
            if awake and proc.drain == "draining":

                def drained(w: World, address: str = address, j: int = j) -> None:
                    # The grace ran out: what it still writes fails (its
                    # writes settle first), then it says it drained.
                    p = w.procs[address][j]
                    for q, how in list(p.taken.items()):
                        key = (w.names[q], w.requests[q].room)  # type: ignore[attr-defined]
                        if how == "writing":
                            p.taken[q] = "stopped"
                        entry = p.rooms.get(key)
                        if entry is not None and entry[0] == "live":
                            p.rooms[key] = ("failed", entry[1], False, entry[3])
                            status = RoomStatus(
                                key[1], p.rank, RoomOutcome.FAILED, GRACE_OVER, key[0], p.session
                            )
                            w.net.append((_from(p), "decode", status))
                    p.drain = "drained"
                    closed = CLOSED if any(entry[3] for entry in p.rooms.values()) else ()
                    for name in sorted(p.peers):
                        w.net.append(
                            (_from(p), "decode", RankDraining(p.rank, p.session, name, True, closed))
                        )

                yield f"{address}/{proc.session}:drained", drained
        if world.restarts < limits.restarts:

            def restart(w: World, address: str = address) -> None:
                last = w.procs[address][-1]
                w.procs[address].append(Proc(address, last.rank, last.session + 1))
                w.restarts += 1

            yield f"{address}:restart", restart


def dest_frozen(world: World, dest: str) -> bool:
    return dest != "decode" and world.procs[dest][-1].frozen


# -- liveness ----------------------------------------------------------------------
def _check_terminal(world: World, limits: Limits) -> None:
    """Let time pass and everything drain and arrive (but to a process frozen
    for good), then look at what is left."""
    w = _clone(world)
    for procs in w.procs.values():
        for p in procs:
            p.undrained = False
            p.taken = {q: "stopped" if how == "draining" else how for q, how in p.taken.items()}
    for _ in range(6):
        w.now += 10 * DT
        _tick(w)
        while True:
            if w.fence_due:
                _owner_fence(w, True)
            ready = [i for i, (_, dest, _) in enumerate(w.net) if not dest_frozen(w, dest)]
            if not ready:
                break
            _, dest, msg = w.net.pop(ready[0])
            if dest == "decode":
                _carry(w, w.state.handle(msg, w.now))
            else:
                _deliver(w, dest, msg)
    if w.decode_drain:
        still_open = w.state.tracker.rooms_in(HoldState.OPEN)
        if still_open:
            raise Violation(f"L: rooms {still_open} left open past the decode drain's grace")
        if w.drain_report is None:
            raise Violation("L: the decode drain never reports")
    for room, q in w.current.items():
        request = w.requests[q]
        # Proof can come for a writer that is the live process at its address
        # (it gets the re-sent ABORTs) or one that exited (its exit, drained);
        # an earlier process still running after a restart at its address
        # proves nothing, ever.
        writing = any(p.taken.get(q) == "writing" for ps in w.procs.values() for p in ps)
        unprovable = any(
            wr.session != w.procs[wr.address][-1].session and _proc(w, wr.address, wr.session).alive
            for wr in request.writers.values()  # type: ignore[attr-defined]
        ) or any(  # nor one frozen for good (only an owner fence, checked below, frees its rooms)
            _proc(w, wr.address, wr.session).frozen
            for wr in request.writers.values()  # type: ignore[attr-defined]
        )
        held = w.state.current(request) and w.state.tracker.state(room) in (  # type: ignore[arg-type]
            HoldState.HELD,
            HoldState.QUARANTINED,
        )
        if held and not writing and not unprovable:
            raise Violation(
                f"L: room {room} stays {w.state.tracker.state(room)} although its writers stopped"
            )
        owner_fence = limits.owner_fence_after_s is not None
        if held and owner_fence:
            raise Violation(f"L: room {room} stays {w.state.tracker.state(room)} past the owner fence")
        if owner_fence and request.verdict is None and not request.aborted and not writing:  # type: ignore[attr-defined]
            raise Violation(f"L: room {room} left TRANSFERRING, no rank process took its request")
        if request.verdict is None and not request.aborted:  # type: ignore[attr-defined]
            for rank, wr in request.writers.items():  # type: ignore[attr-defined]
                now_there = w.procs[wr.address][-1]
                if wr.session != now_there.session or not now_there.alive:
                    raise Violation(f"L: room {room} left TRANSFERRING, its rank {rank}'s process gone")
                if now_there.frozen:  # it answers no Hello: silent, so down
                    raise Violation(f"L: room {room} left TRANSFERRING, its rank {rank}'s process silent")


DEFAULT_LIMITS = Limits()


def explore(
    instances: Sequence[Sequence[str]] = (("p0",),),
    limits: Limits = DEFAULT_LIMITS,
    factory: Factory = EndpointState,
) -> Report:
    """Visit every reachable state; raise :class:`Violation` on the first bad one."""
    report = Report()
    start = initial(instances, limits, factory)
    seen = {_key(start)}
    stack = [start]
    while stack:
        world = stack.pop()
        report.states += 1
        enabled = list(steps(world, limits, len(instances)))
        if not enabled:
            report.terminals += 1
            try:
                _check_terminal(world, limits)
            except Violation as exc:
                raise Violation(f"{exc} (after {' '.join(world.trace)})") from None
        for label, step in enabled:
            nxt = _clone(world)
            nxt.trace = (*world.trace, label)
            try:
                step(nxt)
            except Violation as exc:
                raise Violation(f"{exc} (after {' '.join(nxt.trace)})") from None
            report.transitions += 1
            key = _key(nxt)
            if key not in seen:
                seen.add(key)
                stack.append(nxt)
    return report
