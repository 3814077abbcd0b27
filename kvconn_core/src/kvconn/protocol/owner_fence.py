"""When a decode endpoint fences as the page owner, and what it reports.

Pure like the rest of the core: :class:`OwnerFencePolicy` is asked at each
tick (with ``now``) whether a fence is due, and told how the runtime's fence
ended. The fence itself (``kvconn.transport.owner_fence``: the region's whole
transport endpoint destroyed, so that nothing sent to its old metadata can
land, from any writer on any host) is the runtime's; what the fence proves
and what it costs the endpoint's rooms and ranks is
:class:`~kvconn.protocol.endpoint.EndpointState`'s (its ``OwnerFenceDone``
handler).

A fence is due when a room has been quarantined (held past decode's deadline
with no proof: its writer partitioned, lost or frozen) for ``after_s``, the
backend can fence as owner, no fence is running, none was tried in the last
``min_interval_s``, and no bootstrap is in flight (a rank answering a Hello
with the old metadata while the fence runs would be connected to nothing).
It is never a timeout free: pages come back only once the runtime reports
the fence done (:class:`OwnerFenceDone`); a failed one
(:class:`OwnerFenceError`) changes nothing but the count.

A fence can hold and still leave the region without an endpoint: the old
one is gone (so nothing can land), but the transport could not make the new
one (UCX refuses while decode's own interface is down). The endpoint is then
down, whether or not any room is held: it refuses new rooms at once, with
the reason, and the policy asks for the fence again after 1, 2, 4, ... s, at
most :attr:`OwnerFencePolicy.REARM_MAX_S` apart, until a call makes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvconn.protocol.endpoint_events import (
    Action,
    FenceAsOwner,
    OwnerFenced,
    OwnerFenceDone,
    OwnerFenceError,
    RoomFailed,
    Send,
)
from kvconn.protocol.hold import Release
from kvconn.protocol.ledger import KVPoll

if TYPE_CHECKING:
    from kvconn.protocol.endpoint import EndpointState


# -- the policy -----------------------------------------------------------------
@attrs.define(slots=True)
class OwnerFencePolicy:
    """Off unless ``after_s`` is set and the backend claims ``owner_fence``."""

    after_s: float | None = None
    min_interval_s: float = 60.0
    capable: bool = False
    #: When the last fence was asked for (None: never).
    last_attempt: float | None = None
    running: bool = False
    #: Fences that ended, by outcome: the endpoint's n-th is its epoch.
    ok: int = 0
    failed: int = 0
    #: When to ask again for the endpoint a fence left the region without
    #: (None: it has one), and how many asks failed so far.
    rearm_at: float | None = None
    rearm_failures: int = 0

    REARM_FIRST_S = 1.0
    REARM_MAX_S = 10.0

    @property
    def enabled(self) -> bool:
        return self.after_s is not None and self.capable

    def due(
        self, now: float, quarantined: Sequence[tuple[int, float, int]], bootstrapping: bool
    ) -> FenceAsOwner | None:
        """A fence to carry out now, if one is due. ``quarantined``: (room,
        quarantined since, pages) of every quarantined room."""
        if self.running:
            return None
        if self.rearm_at is not None:  # no endpoint: nothing else matters
            if now < self.rearm_at:
                return None
            self.running, self.last_attempt = True, now
            return FenceAsOwner((), 0)
        if not self.enabled or bootstrapping or not quarantined:
            return None
        assert self.after_s is not None
        if self.last_attempt is not None and now < self.last_attempt + self.min_interval_s:
            return None
        old = [(room, pages) for room, since, pages in quarantined if now - since >= self.after_s]
        if not old:
            return None
        self.running, self.last_attempt = True, now
        return FenceAsOwner(tuple(sorted(room for room, _ in old)), sum(pages for _, pages in old))

    def next_due(self, oldest_quarantined_at: float | None) -> float | None:
        """The earliest instant :meth:`due` could say yes (None: no room waits)."""
        if self.running:
            return None
        if self.rearm_at is not None:
            return self.rearm_at
        if not self.enabled or oldest_quarantined_at is None:
            return None
        assert self.after_s is not None
        at = oldest_quarantined_at + self.after_s
        if self.last_attempt is not None:
            at = max(at, self.last_attempt + self.min_interval_s)
        return at

    def ended(self, ok: bool) -> None:
        self.running = False
        if ok:
            self.ok += 1
        else:
            self.failed += 1

    def endpoint_made(self, made: bool, now: float) -> None:
        """A fence that held made the region's new endpoint, or could not
        (then it is asked again, sooner the first times)."""
        if made:
            self.rearm_at, self.rearm_failures = None, 0
            return
        wait = min(self.REARM_MAX_S, self.REARM_FIRST_S * 2**self.rearm_failures)
        self.rearm_failures += 1
        self.rearm_at = now + wait


__all__ = [
    "FenceAsOwner",
    "OwnerFenceDone",
    "OwnerFenceError",
    "OwnerFencePolicy",
    "OwnerFenced",
    "owner_fenced",
]


# -- what a fence that happened proves and costs ------------------------------------
def owner_fenced(state: EndpointState, done: OwnerFenceDone, now: float) -> list[Action]:
    """Nothing sent to the old metadata can land: rooms in flight fail and,
    with the held ones, are released. A new name makes every rank connect
    anew with the new metadata (docs/multi-host.md); each is down until it
    answers the new Hello, which its channel delivers before any request.
    Without new metadata (the region has no endpoint yet) nothing is
    Hello'd: every request is refused as unavailable until a later fence
    makes the endpoint and the Hellos go out."""
    actions: list[Action] = []
    failed = 0
    for request in list(state.requests.values()):
        if request.verdict is not KVPoll.SUCCESS and not request.aborted:
            failed += 1
            actions.append(RoomFailed(request.room, "owner_fence"))
            actions += state._fail_and_abort(request, "decode fenced as the page owner", now)
    released = [a for a in state.carry(state.tracker.owner_fenced(now)) if isinstance(a, Release)]
    state.draining.clear()
    state.owner_fence.ended(ok=True)
    state.name = state.tracker.decode = f"{state._first_name}.f{state.owner_fence.ok}"
    made = done.metadata is not None
    state.owner_fence.endpoint_made(made, now)
    state.endpoint_down = None if made else (done.reason or "the transport made no new endpoint")
    for rank in sorted(state.ranks):
        state.down.setdefault(rank, "re-bootstrapping after the owner fence")
    if made:
        state.metadata = done.metadata
        for rank in sorted(state.ranks):
            actions.append(Send(state.writers[rank].address, state._hello(state._rank_of[rank][0]), rank))
        # These Hellos are a heartbeat round: the next is an interval away
        # (one skipped while there was no endpoint is not owed at once).
        state._next_heartbeat = now + state.heartbeat_interval_s
    pages = sum(len(r.pages) for r in released)
    fenced = OwnerFenced(True, len(released), pages, failed, state.name, state.endpoint_down or "", made)
    return [*actions, *released, fenced]
