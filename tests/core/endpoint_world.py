"""A decode endpoint's state machine, bootstrapped by hand: no sockets, no
threads, no clock but the ``now`` each test passes in. Shared by the
stimulus tests and the explorer."""

from __future__ import annotations

from collections.abc import Sequence

from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import (
    Action,
    Bootstrapped,
    BootstrapTick,
    Identified,
    Identify,
    Send,
    WriterIdentity,
)
from kvconn.protocol.hold import HoldTracker
from kvconn.protocol.messages import Abort, Hello, HelloAck, TransferRequest

NAME = "decode"
HERE = "boot/pid:[1]"  #: decode's pid namespace: every writer here can be proven gone


def hello(ranks: int) -> Hello:
    return Hello(NAME, "tcp://decode", "null", 4096, ranks, 30_000, b"")


def writer(address: str, session: int) -> WriterIdentity:
    """The process at ``address`` with ``session`` (its pid follows from both)."""
    return WriterIdentity(address, HERE, 1000 + 10 * session + len(address), 1, session)


def announce(state: EndpointState, rank: int, address: str, session: int, now: float) -> list[Action]:
    """The rank at ``address`` answers a Hello as process ``session``; the
    runtime's identity check (``Identify``) is answered as it would be."""
    ack = HelloAck(rank, address, HERE, writer(address, session).pid, 1, "", session)
    actions = state.handle(ack, now)
    if actions == [Identify(ack)]:
        return state.handle(Identified(ack, writer(address, session)), now)
    return actions


def bootstrap(state: EndpointState, addresses: Sequence[str], session: int = 1, now: float = 0.0) -> None:
    instance = state.begin_bootstrap(
        tuple(addresses), hello(len(addresses)), now, timeout_s=30.0, resend_interval_s=1.0
    )
    for rank, address in enumerate(addresses):
        announce(state, rank, address, session, now)
    assert state.handle(BootstrapTick(instance), now) == [Bootstrapped(instance)]
    if state.default is None:
        state.default = instance


def endpoint(
    instances: Sequence[Sequence[str]] = (("p0",),), num_pages: int = 16, **options: object
) -> EndpointState:
    tracker = HoldTracker(NAME, "tcp://decode", abort_timeout=30.0)
    state = EndpointState(NAME, tracker, num_pages=num_pages, **options)  # type: ignore[arg-type]
    for addresses in instances:
        bootstrap(state, addresses)
    return state


def sends(actions: Sequence[object], kind: type) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and isinstance(a.message, kind)]


def aborts(actions: Sequence[object]) -> list[Abort]:
    return [s.message for s in sends(actions, Abort)]  # type: ignore[misc]


def requests(actions: Sequence[object]) -> list[TransferRequest]:
    return [s.message for s in sends(actions, TransferRequest)]  # type: ignore[misc]
