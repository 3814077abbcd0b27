"""What kvconn raises at an engine that misuses a room, and why.

Every error names the room (when there is one) and the problem. Each class
also derives from the builtin an engine would have caught before this module
existed (``RuntimeError`` for a call in the wrong state, ``ValueError`` for
bad input), so code written against either keeps working.

A refused call changes nothing: no page is handed out, no request is sent,
no hold is dropped.
"""

from __future__ import annotations


class KvconnError(Exception):
    """Base of every error kvconn raises on the engine's account."""

    def __init__(self, message: str, room: int | None = None) -> None:
        super().__init__(f"room {room}: {message}" if room is not None else message)
        self.room = room


class RoomStateError(KvconnError, RuntimeError, ValueError):
    """The room (or this handle on it) is not in a state that allows the call:
    not bootstrapped yet, already finished, its request replaced by a newer
    one, its last chunk already sent. (Also a ValueError: what some of these
    calls raised before, ``Receiver.finish()`` of a room not completed.)"""


class RoomInUseError(RoomStateError, ValueError):
    """A new request for a room id this endpoint still tracks (open, held or
    quarantined): the id is free again once its pages came back. (Also a
    ValueError: what this call raised before.)"""


class PageError(KvconnError, ValueError):
    """Pages that cannot be used as given: out of range, duplicated, or
    belonging to another room whose pages are not back yet."""


class PageInUseError(PageError):
    """Pages kvconn still guards for another room (open, held or
    quarantined): the engine's allocator handed them out before kvconn's
    ``on_release``, so a late write of that room could land in them. Counted
    (``kvconn_requests_refused_total{reason="pages_in_use"}``) and alerted on:
    it is a bug in the engine's integration, not a fault of the network."""


class IncompleteRoomError(KvconnError, ValueError):
    """A last chunk that leaves destination pages of the room unwritten:
    decode would be told Success with stale pages."""


class BootstrapError(KvconnError, RuntimeError):
    """A prefill rank did not answer, or refused, decode's bootstrap."""


# -- decode-side misuse (issue 31) --------------------------------------------
class RequestError(KvconnError, ValueError):
    """A request decode cannot make as given: no prefill instance named, no
    ranks or unknown ones, an extras slot outside the layout, addresses that
    name a rank twice or a rank of another instance. (Also a ValueError: what
    these calls raised before.)"""


class UnavailableError(RequestError):
    """decode cannot ask for the room now, and asked nothing: a rank it names
    is down (silent, exited, restarted, or re-bootstrapping after an owner
    fence), or this endpoint has no transport endpoint since its owner fence
    (it makes a new one on its own, with bounded retries). No page was taken:
    route the request to another instance, recompute it, or retry later.
    ``cause``: ``"rank_down"`` or ``"endpoint_down"``."""

    def __init__(self, message: str, room: int | None = None, cause: str = "rank_down") -> None:
        super().__init__(message, room)
        self.cause = cause


class FinishRefusedError(RoomStateError):
    """``finish()`` of a room whose pages are not the engine's to take: not
    completed, aborted, or finished already. (Also a ValueError: what
    ``Receiver.finish()`` and ``HoldTracker.finish()`` raised before.)"""


class ArgumentError(KvconnError, ValueError):
    """Arguments kvconn cannot take as given: an endpoint's ``buffers=``
    without ``layout=``, both forms of a region at once or neither (a prefill
    rank's ``source_bytes`` and ``buffers=``/``layout=``), a sender for no
    decode, a negative drain grace. (Also a ValueError: what these calls
    raised before.)"""


class ArgumentTypeError(KvconnError, TypeError):
    """An object kvconn cannot use as given: memory that is not contiguous,
    read-only, or on a device it cannot register. (Also a TypeError: what
    these calls raised before.)"""


class DeadlineError(ArgumentError):
    """A writer's deadline (``write_timeout_s``, or the transport's own
    longest wait for a write) not shorter than decode's ``abort_timeout_s``:
    a live writer could land after decode quarantined its pages. (Also a
    ValueError: what this check raised before.)"""


__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BootstrapError",
    "DeadlineError",
    "FinishRefusedError",
    "IncompleteRoomError",
    "KvconnError",
    "PageError",
    "PageInUseError",
    "RequestError",
    "RoomInUseError",
    "RoomStateError",
    "UnavailableError",
]
