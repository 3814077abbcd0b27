"""What goes into and comes out of :class:`~kvconn.protocol.endpoint.EndpointState`:
the identities and requests it keeps, the stimuli that are not messages (a
tick, the results of ``/proc`` probes), and the actions the runtime carries
out."""

from __future__ import annotations

import math

import attrs

from kvconn.errors import BootstrapError
from kvconn.protocol.drops import DropReason
from kvconn.protocol.hold import Quarantine, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import AbortAck, Hello, HelloAck, Message


@attrs.frozen(slots=True)
class WriterIdentity:
    """A prefill rank's process, as it announced itself (see
    :meth:`kvconn.runtime.procs.WriterIdentity.announced` for how the runtime
    fills it in)."""

    address: str
    pid_namespace: str  #: where ``pid`` means this process ("": nowhere we can check)
    pid: int
    start_time: int
    session: int  #: the rank's control session: every request names it


@attrs.define(slots=True, eq=False)
class Request:
    """One request for a room: what its ``Receiver`` reports. A room id is
    reused by later requests; each has its own, and a handle keeps its own
    after the endpoint forgot it."""

    room: int
    pages: tuple[int, ...]
    #: The rank processes asked to write it (by endpoint-wide rank id): only
    #: theirs are its acks, statuses and exit proofs, whatever process has
    #: the rank's address now.
    writers: dict[int, WriterIdentity]
    #: Its prefill instance's endpoint-wide rank ids, by the ranks' own (TP)
    #: rank: how an ack or status naming rank r is told apart.
    ids: tuple[int, ...] = ()
    #: SUCCESS (every rank reported every chunk landed) or FAILED; final.
    verdict: KVPoll | None = None
    failure: str | None = None
    aborted: bool = False
    finished: bool = False

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        if self.verdict is None:
            self.verdict = KVPoll.FAILED

    def poll(self) -> KVPoll:
        return KVPoll.TRANSFERRING if self.verdict is None else self.verdict


@attrs.define(slots=True, eq=False)
class Instance:
    """One prefill instance (its ranks' control addresses, in rank order),
    bootstrapped or being bootstrapped."""

    addresses: tuple[str, ...]
    hello: Hello
    ids: tuple[int, ...] = ()
    #: While bootstrapping: identities by the rank's own rank, refusals by address.
    answers: dict[int, WriterIdentity] = attrs.Factory(dict)
    refusals: dict[str, str] = attrs.Factory(dict)
    #: ... and its schedule (protocol/bootstrap.py): its deadline, when the
    #: unanswered ranks are Hello'd next, and how often.
    timeout_s: float = math.inf
    give_up_at: float = math.inf
    resend_at: float = 0.0
    resend_every: float = math.inf


# -- the owner fence: its action, the runtime's answers and its report (policy: owner_fence.py)
@attrs.frozen(slots=True)
class FenceAsOwner:
    """Fence the region as its owner (``kvconn.transport.owner_fence``) and
    answer :class:`OwnerFenceDone` with its new metadata, or
    :class:`OwnerFenceError`. ``rooms`` are the rooms quarantined past the
    age (what the fence is for; it proves every room of the endpoint); none
    when the fence is asked again only to make the endpoint an earlier fence
    left without one."""

    rooms: tuple[int, ...]
    pages: int


@attrs.frozen(slots=True)
class OwnerFenceDone:
    """The owner fence happened: nothing sent to the old metadata can land.
    ``metadata`` is the region's new one, or None when the old endpoint is
    gone but a new one could not be made yet (``reason`` says why: UCX
    refuses while decode's own interface is down); the endpoint then asks
    for the fence again, on a bounded schedule, until it has one."""

    metadata: bytes | None
    reason: str = ""


@attrs.frozen(slots=True)
class OwnerFenceError:
    """The owner fence did not happen (``OwnerFenceFailed`` or anything else
    raised): nothing is proven."""

    reason: str


@attrs.frozen(slots=True)
class OwnerFenced:
    """How a fence ended, for the log and the metrics: ``rooms`` and ``pages``
    released by it (none when it failed), ``failed`` in-flight rooms it
    failed, ``name`` the endpoint's name from now on (its ranks re-bootstrap
    under it)."""

    ok: bool
    rooms: int = 0
    pages: int = 0
    failed: int = 0
    name: str = ""
    reason: str = ""
    #: The region has a transport endpoint again (False: the fence held,
    #: but the new endpoint is still to be made; ``reason`` says why).
    endpoint: bool = True


# -- stimuli that are not messages ---------------------------------------------
@attrs.frozen(slots=True)
class Tick:
    """Time passed. ``gone``: the writers of :meth:`EndpointState.probes` that
    ``/proc`` proves gone; ``peers_drained``: no end of ours with a dead peer
    holds unread bytes (a dead writer's kernel still delivers what it sent);
    ``drained``: held-back acks whose closed connections drained."""

    gone: frozenset[WriterIdentity] = frozenset()
    peers_drained: bool = True
    drained: tuple[AbortAck, ...] = ()


@attrs.frozen(slots=True)
class ExitsProbed:
    """An exit check outside the tick's schedule: these writers are proven
    gone, and (``peers_drained``) nothing they sent can still arrive."""

    gone: frozenset[WriterIdentity]
    peers_drained: bool


@attrs.frozen(slots=True)
class Identified:
    """The answer to :class:`Identify`: the writer ``ack`` announces, as the
    runtime could check it."""

    ack: HelloAck
    writer: WriterIdentity


@attrs.frozen(slots=True)
class Undrained:
    """The answer to :class:`CheckDrain`: decode's ends of ``ack.closed`` have
    not drained (``drained`` False), or have."""

    ack: AbortAck
    drained: bool


@attrs.frozen(slots=True)
class BootstrapTick:
    """The waiter of ``instance``'s bootstrap woke: an answer came, or the
    wait :class:`AwaitAnswers` asked for ran out. ``at``: the time on the
    waiter's clock, which the bootstrap's schedule runs on (None: the
    endpoint's ``now``; the runtime's waiter blocks an engine call, so it
    waits in real time whatever clock the endpoint's timers run on)."""

    instance: Instance
    at: float | None = None


Stimulus = (
    Message | Tick | ExitsProbed | Identified | Undrained | OwnerFenceDone | OwnerFenceError | BootstrapTick
)


# -- actions -----------------------------------------------------------------
@attrs.frozen(slots=True)
class Send:
    """Send ``message`` to ``address`` (for endpoint-wide rank ``rank``, if any)."""

    address: str
    message: Message
    rank: int | None = None


@attrs.frozen(slots=True)
class Drop:
    """A frame that proves nothing, counted under ``reason`` and ignored."""

    reason: DropReason


@attrs.frozen(slots=True)
class Identify:
    """Check the process ``ack`` announces (``/proc``) and answer :class:`Identified`."""

    ack: HelloAck


@attrs.frozen(slots=True)
class CheckDrain:
    """Check whether decode's ends of ``ack.closed`` drained; answer :class:`Undrained`."""

    ack: AbortAck


@attrs.frozen(slots=True)
class AckCounted:
    """An ack proved ``rank``, ``waited`` s after its room's hold (None: not held)."""

    rank: int
    waited: float | None


@attrs.frozen(slots=True)
class RankDown:
    rank: int
    cause: str  #: "exited" | "silent": the metric label
    reason: str


@attrs.frozen(slots=True)
class RankRestarted:
    rank: int
    local_rank: int
    address: str


@attrs.frozen(slots=True)
class RoomFailed:
    """An open room failed by this endpoint (not by a rank's status)."""

    room: int
    cause: str  #: "rank" (its writer down or restarted) | "deadline" | "owner_fence"


@attrs.frozen(slots=True)
class Answered:
    """A bootstrap in progress got an answer: wake its waiter."""

    address: str


@attrs.frozen(slots=True)
class AwaitAnswers:
    """A bootstrap's waiter waits until ``until`` (or an :class:`Answered`),
    then feeds :class:`BootstrapTick` again."""

    until: float


@attrs.frozen(slots=True)
class Bootstrapped:
    """A bootstrap is over: ``instance`` is kept, its ranks have endpoint-wide ids."""

    instance: Instance


@attrs.frozen(slots=True)
class GiveUp:
    """A bootstrap is over and its instance is not kept: the engine's call
    that asked for it raises ``error``."""

    error: BootstrapError


Action = (
    Send
    | Drop
    | Identify
    | CheckDrain
    | AckCounted
    | RankDown
    | RankRestarted
    | RoomFailed
    | Answered
    | AwaitAnswers
    | Bootstrapped
    | GiveUp
    | Release
    | Quarantine
    | FenceAsOwner
    | OwnerFenced
)


@attrs.frozen(slots=True)
class Probes:
    """What the runtime should look up before the next :class:`Tick`."""

    acks: tuple[AbortAck, ...]  #: held-back acks: have their connections drained?
    owed: frozenset[WriterIdentity]  #: writers that held rooms wait for: gone?
    live: frozenset[WriterIdentity]  #: current writers of ranks up, at a heartbeat: gone?


__all__ = [
    "AckCounted",
    "Action",
    "Answered",
    "AwaitAnswers",
    "BootstrapTick",
    "Bootstrapped",
    "CheckDrain",
    "Drop",
    "ExitsProbed",
    "FenceAsOwner",
    "GiveUp",
    "Identified",
    "Identify",
    "Instance",
    "OwnerFenceDone",
    "OwnerFenceError",
    "OwnerFenced",
    "Probes",
    "Quarantine",
    "RankDown",
    "RankRestarted",
    "Release",
    "Request",
    "RoomFailed",
    "Send",
    "Stimulus",
    "Tick",
    "Undrained",
    "WriterIdentity",
]
