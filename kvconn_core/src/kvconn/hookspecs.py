"""Hook specifications: the points of the protocol a plugin may act at.

Every hook is called by the core's prefill transfer worker or control
listener, never by a plugin. The core does its own bookkeeping (the
dequeue-time count, the status check, Failed before an ack target, the ack
itself) *around* these calls, so no plugin can send an ack, skip the count or
reorder it. A hook that raises makes the core fail safe: the room is marked
Failed and poisoned (no ack until a fence or the writer's proven exit), and
decode keeps its pages.

Two kinds of plugin implement them:

* the **transport** (one per endpoint, a :class:`kvconn.transport.Writer`):
  it answers the ``firstresult`` hooks ``on_post``, ``on_done_barrier`` and
  ``on_fence``;
* **observers** (metrics, tracing): they implement the notification hooks, or
  wrap any hook with ``@hookimpl(wrapper=True)`` to time it. An observer must
  not return a value from a ``firstresult`` hook.
"""

from __future__ import annotations

from collections.abc import Sequence

import pluggy

from kvconn.chunk import Chunk, Segment
from kvconn.protocol.messages import Abort
from kvconn.transport import Settlement

PROJECT = "kvconn"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def on_dequeue(chunk: Chunk) -> None:
    """A worker took ``chunk`` off its queue and counted it.

    The core counts the chunk as outstanding in the same step as it reads the
    room's status (invariant D), then calls this hook for every chunk, written
    or skipped. Raising poisons the room. Transports rarely need it; observers
    count it. Return value: ignored.
    """


@hookspec
def on_skip(chunk: Chunk) -> None:
    """The core decided not to write ``chunk``: its room is Failed, cleared or
    unknown here.

    Called before the core uncounts the chunk and tries to ack the room.
    Nothing of this chunk may be written. Return value: ignored.
    """


@hookspec(firstresult=True)
def on_post(chunk: Chunk, segments: Sequence[Segment]) -> object | None:
    """Post the writes of ``chunk`` to its peer (``chunk.peer``).

    ``segments`` are byte ranges in the writer's source and the peer's region.
    The core passes a :class:`~kvconn.chunk.SegmentTable`: a transport that
    takes arrays reads ``SegmentTable.of(segments).rows`` (``(n, 3)`` int64:
    src, dst, nbytes) instead of building a request per Segment object;
    ``of`` returns a table unchanged and builds one from any other sequence.
    The transport returns an opaque token that the core hands back, once, to
    ``on_done_barrier``. It must not wait for the data to land. The token may
    be a plain record (an event and an error field, as tcpdemo's); it must
    not be a library object that keeps transport resources alive by being
    referenced (a NIXL transfer handle pins its agent, and a fence that
    destroys the agent then does nothing): keep such handles in the writer
    under a key and return the key.
    Raising means "some writes may have been posted": the core poisons the
    room. The transport answers; observers return ``None``.
    """


@hookspec(firstresult=True)
def on_done_barrier(chunk: Chunk, posted: object, deadline: float) -> Settlement | None:
    """Wait until the writes behind ``posted`` settle, or ``deadline`` passes.

    ``deadline`` is a ``time.monotonic()`` instant, fixed before ``on_post``
    (``write_timeout_s`` covers post and write) and shorter than decode's
    abort deadline by configuration; it may already have passed (a writer
    frozen inside ``on_post``). Return:

    * ``Settlement.LANDED`` only when every byte is in the destination;
    * ``Settlement.FAILED_SETTLED`` when a handle failed *and* every sibling
      handle is settled, so nothing more can land;
    * ``Settlement.UNSETTLED`` when anything may still be in flight (a failed
      handle with live siblings, the deadline reached). Releasing or dropping
      a handle is not cancellation.

    A chunk that landed only after ``deadline`` (its writer was frozen in
    between) is ``UNSETTLED``, not ``LANDED``.

    The core uncounts the chunk for the first two, and poisons the room and
    fences for the third. A token is asked about once: after ``UNSETTLED``
    and the fence that follows, the core never hands it back, so the writer
    may forget everything posted before the fence. The transport answers;
    observers may wrap it.
    """


@hookspec
def on_abort_notification(abort: Abort, known: bool) -> None:
    """An ABORT for ``abort.room`` arrived from a page owner.

    Called after the core marked the room Failed (or left a tombstone when it
    was not ``known``) and registered the ack target, and before it tries to
    ack. The transport may start tearing down the room's transfers early; it
    can neither send nor delay the ack. Return value: ignored.

    Runs on the rank's listener thread, concurrently with ``on_post`` and
    ``on_done_barrier`` on the workers (a fence does not wait for it either):
    state it shares with them needs a lock. Raising poisons the room and
    starts a fence.
    """


@hookspec(firstresult=True)
def on_fence() -> bool | None:
    """Make every write posted so far unable to land, then reconnect.

    Called by the core only while no worker is inside ``on_post`` or
    ``on_done_barrier``, when rooms are poisoned: every token posted before
    it has had its barrier and is never handed back. ``connect`` is not
    called again: the writer must be able to write to every peer it knew. Return ``True`` once
    the transport has proven quiescence (e.g. destroyed its agent or engine)
    and can write again; the core then acks the poisoned rooms. A transport
    that cannot fence does not implement it (``None``): rooms stay poisoned.
    ``False`` (or raising) says it tried and could not prove quiescence this
    time (say, its engine is still referenced elsewhere): the rooms stay
    poisoned, the fence counts as failed, and a later one may try again.

    "Unable to land" is about the writer: bytes already sent on a TCP
    connection still arrive. The core lists this process's TCP connections
    before and after the call, names the ones that closed in its fenced
    acks, and decode waits for its ends of them to drain. So a fence should
    close the connections its writes travelled on, not leave them open.
    """
