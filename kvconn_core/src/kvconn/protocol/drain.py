"""Draining an instance (scale-down, rolling upgrade), sans-I/O.

A prefill rank told to drain (:meth:`RankState.begin_drain`):

* refuses every new request at once, with a FAILED status whose reason is
  :data:`REFUSED` (decode's engine routes the request elsewhere or
  recomputes, instead of waiting for a timeout), and tells every decode it
  knows with a :class:`~kvconn.protocol.messages.RankDraining`;
* lets the rooms it holds finish for the grace period, then fails those
  still live (reason :data:`GRACE_OVER`);
* is *drained* once no room is live and no counted chunk is unsettled (every
  posted write landed, failed settled or was fenced: the ledger's own
  proof). Then it tells every decode ``done``: nothing of it can land any
  more, so decode takes back the pages of every room it still holds for that
  rank process without waiting for anything else.

A decode endpoint told to drain refuses new requests (:class:`DrainingError`),
gives its engine the grace period to finish its rooms, then aborts the rest:
their pages come back with proof, or stay held and are reported.

These are the decisions; ``runtime/`` calls them and waits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

from kvconn.errors import ArgumentError, RequestError
from kvconn.protocol.drops import DropReason
from kvconn.protocol.endpoint_events import Action, Drop, Request
from kvconn.protocol.hold import HoldState
from kvconn.protocol.ledger import LIVE, KVPoll, NotifyDecode, RoomKey
from kvconn.protocol.messages import RankDraining, RoomOutcome, TcpConnection

if TYPE_CHECKING:
    from kvconn.protocol.endpoint import EndpointState
    from kvconn.protocol.rank import Action as RankAction
    from kvconn.protocol.rank import RankState

#: Why a draining prefill rank refused a request: it wrote nothing of it.
REFUSED = "draining: this prefill rank takes no new rooms (route the request elsewhere or recompute)"
#: Why a draining rank failed a room it held: the grace period ran out first.
GRACE_OVER = "draining: the prefill rank's grace period ran out before the room completed"
#: Why decode failed a room whose rank drained before it concluded.
RANK_DRAINED = "draining: the prefill rank drained before the room concluded"
#: Why a draining decode endpoint aborted a room its engine had not finished.
DECODE_DRAINING = "draining: this decode endpoint is draining and aborted the room"
#: Every reason that means "route elsewhere or recompute", not a fault.
DRAIN_REASONS = frozenset({REFUSED, GRACE_OVER, RANK_DRAINED, DECODE_DRAINING})


class DrainingError(RequestError):
    """A request refused because an endpoint is draining: this decode
    endpoint, or every rank of the named prefill instance's process at one
    of its ranks' addresses. Nothing was sent or recorded: route the request
    to another instance, or recompute it."""


@attrs.frozen(slots=True)
class DrainReport:
    """How a drain ended: ``drained`` (nothing of the endpoint's can land
    any more / every page back), else what is left (held, never freed on a
    timeout), and how long it took."""

    drained: bool
    seconds: float
    #: Rooms not concluded (prefill: live or with unsettled chunks; decode:
    #: open, held or quarantined).
    rooms_left: int = 0
    #: Decode: pages still held or quarantined (0 at a prefill rank).
    pages_left: int = 0


@attrs.define(slots=True)
class Drain:
    """One side's drain: when its grace ends, how far it got, and when the
    wait of the caller that asked for it stops and reports what is left."""

    since: float
    grace_over_at: float
    #: The grace ran out: the rooms still live were failed (prefill), the
    #: rooms the engine left were aborted (decode).
    grace_over: bool = False
    #: Nothing of the endpoint can land any more (prefill: every decode was
    #: told ``done``; decode: every page is back).
    done: bool = False
    #: When the wait reports what is left, drained or not (inf: never).
    report_at: float = math.inf

    def report(self, now: float, rooms_left: int, pages_left: int = 0) -> DrainReport | None:
        """The report at ``now`` once the drain is done or its wait is up
        (None: wait on)."""
        if not self.done and now < self.report_at:
            return None
        return DrainReport(self.done, now - self.since, rooms_left, pages_left)


def check_grace(grace_s: float) -> None:
    """A drain's grace is at least 0 s (both sides)."""
    if grace_s < 0:
        raise ArgumentError(f"a drain's grace period is at least 0 s, got {grace_s}")


#: What a rank's wait allows beyond its grace and write deadline by default:
#: time for a write in flight, failed at its deadline, to be fenced.
SETTLE_S = 1.0


def rank_report_after(grace_s: float, write_timeout_s: float, timeout_s: float | None = None) -> float:
    """How long a prefill rank's drain() waits for the rank to drain before
    it reports what is left: ``timeout_s``, by default the grace, then the
    write deadline, then :data:`SETTLE_S`."""
    return grace_s + write_timeout_s + SETTLE_S if timeout_s is None else timeout_s


# -- prefill ------------------------------------------------------------------
@attrs.define(slots=True)
class RankDrain(Drain):
    """A prefill rank's drain (its wait: :func:`rank_report_after`)."""


@attrs.frozen(slots=True)
class Announce:
    """Send ``RankDraining(done, closed)`` to decode ``decode``: ``closed``,
    the TCP connections the rank's fences closed (decode counts ``done``
    only with none, as it holds a fenced ack until its ends drained)."""

    decode: str
    done: bool
    closed: tuple[TcpConnection, ...] = ()


def busy(state: RankState[Any]) -> list[RoomKey]:
    """The rooms that may still be written: live, or with chunks counted and
    not settled (a poisoned room waits for its fence)."""
    return state.ledger.unsettled_keys()


def begin_rank_drain(
    state: RankState[Any], now: float, grace_s: float, report_after_s: float = math.inf
) -> list[RankAction]:
    """Start draining; the drain's :meth:`~Drain.report` gives up waiting
    ``report_after_s`` from now. A second call (an engine's drain, then its
    close) keeps the grace and what was done, and starts the wait over, as a
    new caller's."""
    check_grace(grace_s)
    if state.drain is not None:
        state.drain.since, state.drain.report_at = now, now + report_after_s
        return []
    state.drain = RankDrain(now, now + grace_s, report_at=now + report_after_s)
    closed = state.ledger.closed_by_fences
    actions: list[RankAction] = [Announce(decode, False, closed) for decode in sorted(state.peers)]
    return actions + rank_drain_tick(state, now)[1]


def rank_drain_tick(state: RankState[Any], now: float) -> tuple[bool, list[RankAction]]:
    """Fail the live rooms once the grace ran out; once nothing can be
    written any more, tell every decode. Returns (drained, actions)."""
    drain = state.drain
    if drain is None:
        return False, []
    if drain.done:
        return True, []
    actions: list[RankAction] = []
    ledger = state.ledger
    if not drain.grace_over and now >= drain.grace_over_at:
        drain.grace_over = True
        for key in busy(state):
            entry = ledger.entry(key)
            if entry is not None and entry.status in LIVE and not entry.cleared:
                actions += ledger.fail(key, GRACE_OVER, entry.incarnation)
    if busy(state):
        return False, actions
    drain.done = True
    closed = ledger.closed_by_fences
    return True, actions + [Announce(decode, True, closed) for decode in sorted(state.peers)]


def rank_drain_report(state: RankState[Any], now: float) -> tuple[DrainReport | None, list[RankAction]]:
    """:func:`rank_drain_tick`, then the drain's report once the rank
    drained or its wait is up (None: wait on, or no drain began)."""
    _, actions = rank_drain_tick(state, now)
    drain = state.drain
    return (None if drain is None else drain.report(now, len(busy(state)))), actions


def refuse_request(
    state: RankState[Any], key: RoomKey, seq: int, pages: tuple[int, ...], extras: int | None
) -> list[RankAction]:
    """A fresh request while draining: recorded Failed (a sender that takes
    it gets FAILED, nothing is ever written into its pages) and refused."""
    ledger = state.ledger
    before = ledger.entry(key)
    ledger.request(key, seq, pages, extras)
    entry = ledger.entry(key)
    assert entry is not None  # just requested
    if entry is not before and entry.status in LIVE:
        return list(ledger.fail(key, REFUSED, entry.incarnation))
    if entry.status in LIVE:
        return []  # the request the rank already had (its room may finish)
    reason = entry.reason or REFUSED
    return [NotifyDecode(key.decode, ledger.room_status(key, RoomOutcome.FAILED, reason))]


# -- decode -------------------------------------------------------------------
def refuse_if_draining(state: EndpointState, instance_ids: tuple[int, ...], room: int) -> None:
    """Raise :class:`DrainingError` if this endpoint drains, or a rank of
    the instance (its current process) announced it drains. Not a rank whose
    link was lost since: another process may answer there now (a restart
    after the drain), and it is asked first (protocol/liveness.py)."""
    if state.drain is not None:
        raise DrainingError("this decode endpoint is draining: it takes no new rooms", room)
    for rank in instance_ids:
        if rank in state.unconfirmed:
            continue
        if state.leaving.get(rank) == state.writers[rank].session:
            raise DrainingError(
                f"prefill rank {rank} ({state.writers[rank].address}) is draining: route the "
                "request to another instance or recompute it",
                room,
            )


def rank_draining(state: EndpointState, msg: RankDraining, now: float) -> list[Action]:
    """A prefill rank process announced its drain, or that it drained."""
    if msg.decode != state.name:
        return [Drop(DropReason.OTHER_DECODE)]
    rank = state.id_of_session(msg.rank, msg.session)
    if rank is None:
        return [Drop(DropReason.OTHER_SESSION)]
    writer = state.writers[rank]
    state.leaving[rank] = msg.session
    if not msg.done or msg.closed:
        # Bytes sent on connections a fence closed may still be in our
        # socket buffers: the per-room acks (held back until drained) or the
        # writer's exit prove those rooms, not this message.
        return []
    actions: list[Action] = []
    for request in list(state.requests.values()):
        if request.writers.get(rank) != writer or request.finished:
            continue
        if request.verdict is KVPoll.SUCCESS and not request.aborted:
            continue  # complete: the engine takes its pages with finish()
        # Nothing more of this rank will come: FAILED (if it was not), onto
        # the abort path, and proven at once below for this rank.
        actions += state.fail_and_abort(request, RANK_DRAINED, now)
    held = frozenset(
        room
        for room in state.tracker.rooms_in(HoldState.HELD) + state.tracker.rooms_in(HoldState.QUARANTINED)
        if _asked(state.requests.get(room), rank, writer)
    )
    if held:
        actions += state.carry(state.tracker.writer_exited(rank, now, held, drained=True))
    return actions


def _asked(request: Request | None, rank: int, writer: object) -> bool:
    return request is not None and request.writers.get(rank) == writer


@attrs.define(slots=True)
class DecodeDrain(Drain):
    """A decode endpoint's drain: after the grace, its wait gives the
    rooms it aborted ``settle_s`` to come back by proof."""

    settle_s: float = 0.0


def begin_decode_drain(
    state: EndpointState, now: float, grace_s: float, settle_s: float, at: float
) -> list[Action]:
    """Refuse new requests from now on; abort what the engine has not
    finished ``grace_s`` from ``at``, and report ``settle_s`` after that
    (``at``: the clock the drain's caller waits on; ``now``: the endpoint's,
    for the holds). A second call (the endpoint refuses requests already)
    starts the wait over, as a new caller's."""
    check_grace(grace_s)
    state.drain = DecodeDrain(at, at + grace_s, settle_s=settle_s)
    return decode_drain_tick(state, now, at)[1]


def decode_drain_tick(state: EndpointState, now: float, at: float) -> tuple[DrainReport | None, list[Action]]:
    """Abort the rooms the engine left once the grace ran out (unless every
    page is back by then); report once every page is back or the settle
    time after the grace is up. Returns (the report or None, actions)."""
    drain = state.drain
    if drain is None:
        return None, []
    actions: list[Action] = []
    rooms, pages = decode_left(state)
    if rooms and not drain.grace_over and at >= drain.grace_over_at:
        drain.grace_over = True
        drain.report_at = at + drain.settle_s
        actions = abort_unfinished(state, now)
        rooms, pages = decode_left(state)
    drain.done = rooms == 0
    return drain.report(at, rooms, pages), actions


def abort_unfinished(state: EndpointState, now: float) -> list[Action]:
    """The grace ran out: abort every room the engine has not finished
    (its pages come back through the proofs, or stay held)."""
    actions: list[Action] = []
    for request in list(state.requests.values()):
        if request.finished or request.aborted or not state.current(request):
            continue
        request.fail(DECODE_DRAINING)
        actions += state.abort(request, now)
    return actions


def decode_left(state: EndpointState) -> tuple[int, int]:
    """(rooms, pages) this endpoint still tracks: open, held or quarantined."""
    tracker = state.tracker
    rooms = sum(len(tracker.rooms_in(s)) for s in HoldState)
    pages = sum(tracker.pages_in(s) for s in HoldState)
    return rooms, pages


__all__ = [
    "Announce",
    "DECODE_DRAINING",
    "DRAIN_REASONS",
    "DecodeDrain",
    "Drain",
    "DrainReport",
    "DrainingError",
    "GRACE_OVER",
    "RANK_DRAINED",
    "REFUSED",
    "RankDrain",
    "SETTLE_S",
    "abort_unfinished",
    "begin_decode_drain",
    "begin_rank_drain",
    "busy",
    "check_grace",
    "decode_drain_tick",
    "decode_left",
    "rank_report_after",
    "rank_draining",
    "rank_drain_report",
    "rank_drain_tick",
    "refuse_if_draining",
    "refuse_request",
]
