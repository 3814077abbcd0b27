"""The world :mod:`explore_endpoint` explores: its rank processes, network and
clock (``World``, ``Proc``), the bounds of a world (``Limits``), and how a
world is copied and told apart from another (``_clone``, ``_key``: which of
the machine's and the world's fields make a state).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import attrs
from endpoint_world import NAME
from explore import _clone_tracker, _tracker_key

from kvconn.protocol.drain import DrainReport
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.messages import Message, TcpConnection

DT = 1.0  #: one tick of the clock: a heartbeat; two unanswered ones make a rank silent
SETTLE_S = 2 * DT  #: a decode drain waits this long after its grace for the proofs
CLOSED = (TcpConnection("127.0.0.1", 1, "127.0.0.1", 2),)


class Violation(AssertionError):
    pass


@dataclass
class Proc:
    """One rank process at an address: ``taken`` maps a request (its index)
    to "writing" (bytes may land), "draining" (stopped, but bytes it sent may
    still arrive) or "stopped"."""

    address: str
    rank: int  #: its rank in its instance
    session: int
    alive: bool = True
    undrained: bool = False  #: a fence or its exit left bytes on their way
    frozen: bool = False  #: SIGSTOPped: reads nothing, sends nothing, its writes go on
    #: Starved (load): its Python reads and sends nothing for a while, as a
    #: frozen one, but the process runs: its control link stays up.
    starved: bool = False
    #: The decode names whose Hello it took (connected with their metadata).
    peers: frozenset[str] = frozenset({NAME})
    taken: dict[int, str] = field(default_factory=dict)
    #: Its ledger, as far as decode's safety depends on it: per room (status,
    #: seq, tombstone, fenced: every ack of a fenced room names the closed
    #: connections). A tombstone (an ABORT of a room never asked for here)
    #: keeps a late request of that room from writing; a Failed room is taken
    #: anew only by a newer request once its abort was acked.
    rooms: dict[tuple[str, int], tuple[str, int, bool, bool]] = field(default_factory=dict)
    #: "" | "draining" (announced: refuses requests) | "drained" (announced done)
    drain: str = ""


@dataclass
class World:
    state: EndpointState
    procs: dict[str, list[Proc]]  #: by address; the last one is there now
    #: (channel, destination, message): each channel (a ZMQ PUSH socket to
    #: one peer) delivers in order; channels interleave freely.
    net: list[tuple[str, str, Message]] = field(default_factory=list)
    now: float = 0.0
    ticks: int = 0
    restarts: int = 0
    exits: int = 0
    aborts: int = 0
    drains: int = 0
    #: Requests by index, each room's current one, and TransferRequest seq -> request.
    requests: list[object] = field(default_factory=list)
    current: dict[int, int] = field(default_factory=dict)
    by_seq: dict[int, int] = field(default_factory=dict)
    opened: dict[int, int] = field(default_factory=dict)  #: requests made per room
    names: dict[int, str] = field(default_factory=dict)  #: the decode name each request was asked under
    freezes: int = 0
    fence_due: bool = False  #: the machine asked for an owner fence: its outcome is next
    fenced: frozenset[str] = frozenset()  #: decode names whose metadata an owner fence cut off
    fence_fails: int = 0
    #: The engine called the endpoint's drain(); its report once it came.
    decode_drain: bool = False
    drain_report: DrainReport | None = None
    #: The runtime reports control links (LinksChanged): what it last
    #: reported for each address, (session of the process connected, up).
    track_links: bool = False
    links: dict[str, tuple[int, bool]] = field(default_factory=dict)
    starves: int = 0
    trace: tuple[str, ...] = ()  #: the steps that led here (not part of the state)


@dataclass(frozen=True)
class Limits:
    rooms: tuple[tuple[int, int], ...] = ((1, 0),)  #: (room, instance index) the engine may open
    requests_per_room: int = 2  #: 2: a room id is reused once its pages are back
    ticks: int = 3
    aborts: int = 2  #: the engine's own aborts (a room it never aborts must still end)
    restarts: int = 0
    exits: int = 0
    fenced: bool = False
    transfer_timeout_s: float | None = None
    drains: int = 0  #: rank processes that drain
    freezes: int = 0
    owner_fence_after_s: float | None = None  #: None: no owner fence
    fence_fails: int = 0  #: how many owner fences may fail
    decode_drain: bool = False  #: the engine may drain the endpoint (grace DT, then SETTLE_S)
    peer_timeout_s: float = 1.5  #: longer: no rank goes down on silence within the world's ticks
    heartbeat_interval_s: float = DT  #: longer: no heartbeat within the world's ticks
    #: Each instance's processes get sessions of their own (as the runtime's
    #: random 63-bit ones are): without, two instances' rank 0 share session 1.
    distinct_sessions: bool = False
    #: The runtime reports each control link's handshakes and losses, which
    #: follow the processes (a stopped or gone one loses its link, a starved
    #: one keeps it), at any point.
    links: bool = False
    starves: int = 0  #: rank processes starved for a while (load)
    peer_hung_timeout_s: float = 10.0  #: longer than the world: load never reaches it


@dataclass
class Report:
    states: int = 0
    transitions: int = 0
    terminals: int = 0


Factory = Callable[..., EndpointState]


# -- cloning (deepcopy was most of the time) ----------------------------------------
def _clone(world: World) -> World:
    s = world.state
    new = copy.copy(s)
    requests = {id(r): attrs.evolve(r, unsent=set(r.unsent)) for r in world.requests}  # type: ignore[attr-defined,misc]
    new.tracker = _clone_tracker(s.tracker)
    new.writers = dict(s.writers)
    new.down = dict(s.down)
    new._retired = set(s._retired)
    new._heard = dict(s._heard)
    new._asked = dict(s._asked)
    new._link = dict(s._link)
    new.unconfirmed = set(s.unconfirmed)
    new._id_of_session = dict(s._id_of_session)
    new.requests = {room: requests[id(r)] for room, r in s.requests.items()}
    new._rooms_of_rank = dict(s._rooms_of_rank)
    new._held = {room: requests[id(r)] for room, r in s._held.items()}
    new._owing = dict(s._owing)
    new._in_use = set(s._in_use)
    new._deadlines = [(t, n, requests[id(r)]) for t, n, r in s._deadlines]
    new.draining = dict(s.draining)
    new.leaving = dict(s.leaving)
    new.owner_fence = attrs.evolve(s.owner_fence)
    new.drain = None if s.drain is None else attrs.evolve(s.drain)
    procs = {a: [_copy_proc(p) for p in ps] for a, ps in world.procs.items()}
    return World(
        new,
        procs,
        list(world.net),
        world.now,
        world.ticks,
        world.restarts,
        world.exits,
        world.aborts,
        world.drains,
        [requests[id(r)] for r in world.requests],
        dict(world.current),
        dict(world.by_seq),
        dict(world.opened),
        dict(world.names),
        world.freezes,
        world.fence_due,
        world.fenced,
        world.fence_fails,
        world.decode_drain,
        world.drain_report,
        world.track_links,
        dict(world.links),
        world.starves,
        world.trace,
    )


def _copy_proc(p: Proc) -> Proc:
    return Proc(
        p.address,
        p.rank,
        p.session,
        p.alive,
        p.undrained,
        p.frozen,
        p.starved,
        p.peers,
        dict(p.taken),
        dict(p.rooms),
        p.drain,
    )


# -- state keys --------------------------------------------------------------------
def _machine_key(world: World) -> tuple[object, ...]:
    s = world.state
    index = {id(r): q for q, r in enumerate(world.requests)}

    def req(r: object) -> tuple[object, ...]:
        return (index[id(r)], r.verdict, r.failure is None, r.aborted, r.finished, tuple(sorted(r.unsent)))  # type: ignore[attr-defined]

    return (
        tuple(sorted(s.writers.items())),
        tuple(sorted(s.down)),
        tuple(sorted(s._retired)),
        tuple(sorted(s._heard.items())),
        tuple(sorted(s._asked.items())),
        tuple(sorted(s._link.items())),
        tuple(sorted(s.unconfirmed)),
        s._next_heartbeat,
        s._next_exit_check,
        tuple((t, index[id(r)]) for t, _, r in s._deadlines),
        tuple(sorted(s.draining)),
        tuple(sorted(s.leaving.items())),
        tuple(sorted((room, req(r)) for room, r in s.requests.items())),
        tuple(sorted(s._in_use)),
        tuple(sorted(s._id_of_session.items())),
        _tracker_key(s.tracker),
        # when each hold began, quarantines, re-sends: two holds alike but for
        # these reach different states (one quarantines a tick sooner)
        tuple(
            (k, e.held_at, e.deadline, e.quarantined_at, e.resend_at, e.resend_every, e.exited)
            for k, e in sorted(s.tracker._rooms.items())
        ),
        tuple(sorted((t, req(r)) for t, r in enumerate(world.requests))),
        s.name,
        s.metadata,
        attrs.astuple(s.owner_fence),
        None if s.drain is None else attrs.astuple(s.drain),
    )


def _key(world: World) -> tuple[object, ...]:
    procs = tuple(
        (
            a,
            tuple(
                (
                    p.session,
                    p.alive,
                    p.undrained,
                    p.frozen,
                    p.starved,
                    tuple(sorted(p.peers)),
                    tuple(sorted(p.taken.items())),
                    tuple(sorted(p.rooms.items())),
                    p.drain,
                )
                for p in ps
            ),
        )
        for a, ps in sorted(world.procs.items())
    )
    channels: dict[str, list[str]] = {}
    for channel, _, msg in world.net:  # each channel's order matters, not their interleaving
        channels.setdefault(channel, []).append(repr(msg))
    net = tuple(sorted((c, tuple(ms)) for c, ms in channels.items()))
    return (
        _machine_key(world),
        procs,
        net,
        world.now,
        world.ticks,
        world.restarts,
        world.exits,
        world.aborts,
        world.drains,
        tuple(sorted(world.current.items())),
        tuple(sorted(world.opened.items())),
        tuple(sorted(world.names.items())),
        world.freezes,
        world.fence_due,
        tuple(sorted(world.fenced)),
        world.fence_fails,
        world.decode_drain,
        world.drain_report,
        tuple(sorted(world.links.items())),
        world.starves,
    )
