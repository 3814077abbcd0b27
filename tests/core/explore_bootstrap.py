"""Exhaustive exploration of a decode endpoint's bootstrap of a prefill
instance (protocol/bootstrap.py, through the real
:class:`~kvconn.protocol.endpoint.EndpointState`) in small worlds.

The world: an instance of a few ranks, each up (it answers every Hello it
reads), silent (unreachable, or of another wire version or key: it answers
nothing) or refusing (its HelloAck says why). The explorer plays the
network, which delivers each Hello and HelloAck or loses it (at most
``losses`` in all), and the runtime's waiter, which feeds ``BootstrapTick``
when an answer woke it or when the wait it was told ran out. A message sent
is delivered or lost before the next re-send is due: the waiter's wait runs
out only once nothing is in flight (else an endlessly slow network makes any
bootstrap fail, and nothing can be said).

Checked in every reachable state:

* the waiter never waits past the deadline, and the bootstrap is over once
  its deadline came (it never hangs);
* it is kept if and only if every rank is up (fewer messages are lost than
  the Hellos sent within the deadline); it gives up if a rank refused, or
  once the deadline came with a rank silent, never before the deadline
  while no rank refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from endpoint_world import HERE, hello, writer

from kvconn.protocol import bootstrap
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import (
    Action,
    AwaitAnswers,
    Bootstrapped,
    BootstrapTick,
    GiveUp,
    Identified,
    Identify,
    Instance,
    Send,
)
from kvconn.protocol.hold import HoldTracker
from kvconn.protocol.messages import HelloAck, Message

TIMEOUT_S = 2.0
RESEND_S = 0.5  #: 4 Hellos within the deadline


class Violation(AssertionError):
    pass


@dataclass(frozen=True)
class Limits:
    ranks: tuple[str, ...] = ("up", "up")  #: each rank: "up" | "silent" | "refusing"
    losses: int = 1


@dataclass
class World:
    state: EndpointState
    instance: Instance
    start: float
    now: float = 0.0
    #: (address, message): to a rank, or from one ("decode" is the destination).
    net: list[tuple[str, Message]] = field(default_factory=list)
    losses: int = 0
    until: float | None = None  #: the waiter waits until then (None: it is running)
    woken: bool = False  #: an answer woke the waiter
    over: Action | None = None  #: Bootstrapped or GiveUp
    trace: tuple[str, ...] = ()


def initial(limits: Limits, factory: Callable[..., EndpointState]) -> World:
    assert limits.losses < bootstrap.MIN_HELLOS  # else losing every Hello to a rank fails it rightly
    state = factory("decode", HoldTracker("decode", "tcp://decode", 30.0), num_pages=4)
    addresses = tuple(f"p{i}" for i in range(len(limits.ranks)))
    start = 100.0
    instance = state.begin_bootstrap(
        addresses, hello(len(addresses)), start, timeout_s=TIMEOUT_S, resend_interval_s=RESEND_S
    )
    world = World(state, instance, start, start)
    _wake(world)
    return world


def _carry(world: World, actions: list[Action]) -> None:
    for action in actions:
        if isinstance(action, Send):
            world.net.append((action.address, action.message))
        elif isinstance(action, Identify):
            ack = action.ack
            _carry(world, world.state.handle(Identified(ack, writer(ack.address, ack.session)), world.now))
        elif isinstance(action, AwaitAnswers):
            if action.until > world.start + TIMEOUT_S:
                raise Violation(f"the waiter waits until {action.until}, past the deadline")
            world.until = action.until
        elif isinstance(action, Bootstrapped | GiveUp):
            world.over = action
        elif type(action).__name__ == "Answered":
            world.woken = True


def _wake(world: World) -> None:
    """The waiter runs: one BootstrapTick at ``now``."""
    world.until, world.woken = None, False
    _carry(world, world.state.handle(BootstrapTick(world.instance), world.now))


def _rank_reads(world: World, address: str, limits: Limits) -> None:
    rank = int(address[1:])
    how = limits.ranks[rank]
    if how == "silent":
        return
    error = "layouts do not fit" if how == "refusing" else ""
    world.net.append(("decode", HelloAck(rank, address, HERE, writer(address, 1).pid, 1, error, 1)))


def steps(world: World, limits: Limits) -> Iterator[tuple[str, Callable[[World], None]]]:
    if world.over is not None:
        return
    if world.woken:
        yield "wake:answer", _wake
        return
    for i, (dest, _) in enumerate(world.net):

        def deliver(w: World, i: int = i) -> None:
            dest, msg = w.net.pop(i)
            if dest == "decode":
                _carry(w, w.state.handle(msg, w.now))
            else:
                _rank_reads(w, dest, limits)

        yield f"deliver{i}", deliver
        if world.losses < limits.losses:

            def lose(w: World, i: int = i) -> None:
                w.net.pop(i)
                w.losses += 1

            yield f"lose{i}", lose
    if not world.net and world.until is not None:

        def timeout(w: World) -> None:
            assert w.until is not None
            w.now = w.until
            _wake(w)

        yield "wake:timeout", timeout


def _check(world: World, limits: Limits) -> None:
    deadline = world.start + TIMEOUT_S
    if world.over is None:
        if world.now >= deadline:
            raise Violation(f"the bootstrap is not over at its deadline ({world.now})")
        return
    kept = isinstance(world.over, Bootstrapped)
    if kept != all(how == "up" for how in limits.ranks):
        raise Violation(f"the bootstrap ended {world.over} with ranks {limits.ranks}, {world.losses} lost")
    if not kept and "refusing" not in limits.ranks and world.now < deadline:
        raise Violation(f"gave up at {world.now}, before the deadline, no rank refused")


@dataclass
class Report:
    states: int = 0
    transitions: int = 0
    terminals: int = 0


def _key(world: World) -> tuple[object, ...]:
    inst = world.instance
    return (
        world.now,
        tuple(sorted((d, repr(m)) for d, m in world.net)),
        world.losses,
        world.until,
        world.woken,
        repr(world.over),
        tuple(sorted(inst.answers)),
        tuple(sorted(inst.refusals)),
        inst.resend_at,
        tuple(sorted(world.state.instances)),
    )


def _clone(world: World, limits: Limits, factory: Callable[..., EndpointState]) -> World:
    """Replay ``world``'s trace on a fresh machine (the state is small, the
    traces short: simpler than copying the machine)."""
    new = initial(limits, factory)
    for label in world.trace:
        dict(steps(new, limits))[label](new)
        new.trace = (*new.trace, label)
    return new


def explore(limits: Limits = Limits(), factory: Callable[..., EndpointState] = EndpointState) -> Report:
    """Visit every reachable state; raise :class:`Violation` on the first bad one."""
    report = Report()
    start = initial(limits, factory)
    seen = {_key(start)}
    stack = [start]
    while stack:
        world = stack.pop()
        report.states += 1
        try:
            _check(world, limits)
        except Violation as exc:
            raise Violation(f"{exc} (after {' '.join(world.trace)})") from None
        enabled = [label for label, _ in steps(world, limits)]
        if not enabled:
            report.terminals += 1
            if world.over is None:
                raise Violation(f"the bootstrap hangs (after {' '.join(world.trace)})")
        for label in enabled:
            nxt = _clone(world, limits, factory)
            try:
                dict(steps(nxt, limits))[label](nxt)
            except Violation as exc:
                raise Violation(f"{exc} (after {' '.join((*world.trace, label))})") from None
            nxt.trace = (*world.trace, label)
            report.transitions += 1
            key = _key(nxt)
            if key not in seen:
                seen.add(key)
                stack.append(nxt)
    return report
