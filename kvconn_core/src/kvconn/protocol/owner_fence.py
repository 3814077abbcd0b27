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
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


# -- the action and its answers ---------------------------------------------------
@attrs.frozen(slots=True)
class FenceAsOwner:
    """Fence the region as its owner (``kvconn.transport.owner_fence``) and
    answer :class:`OwnerFenceDone` with its new metadata, or
    :class:`OwnerFenceError`. ``rooms`` are the rooms quarantined past the
    age (what the fence is for; it proves every room of the endpoint)."""

    rooms: tuple[int, ...]
    pages: int


@attrs.frozen(slots=True)
class OwnerFenceDone:
    """The owner fence happened: nothing sent to the old metadata can land;
    ``metadata`` is the region's new one."""

    metadata: bytes


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

    @property
    def enabled(self) -> bool:
        return self.after_s is not None and self.capable

    def due(
        self, now: float, quarantined: Sequence[tuple[int, float, int]], bootstrapping: bool
    ) -> FenceAsOwner | None:
        """A fence to carry out now, if one is due. ``quarantined``: (room,
        quarantined since, pages) of every quarantined room."""
        if not self.enabled or self.running or bootstrapping or not quarantined:
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
        if not self.enabled or self.running or oldest_quarantined_at is None:
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


__all__ = ["FenceAsOwner", "OwnerFenceDone", "OwnerFenceError", "OwnerFencePolicy", "OwnerFenced"]
