"""A prefill rank's chunk path: transfer workers and the fence gate.

Each worker takes a chunk, lets the ledger count and decide it (invariant
D), posts it through the plugins, waits at its DONE barrier and reports how
the chunk ended to :meth:`RankState.chunk_ended`, which decides what that
means (a chunk that may still land poisons its room until a fence) and
returns the actions this module carries out (a :class:`Fence` among them:
the worker runs it before its next chunk). :class:`TransferPath` is a part
of :class:`~kvconn.runtime.prefill.PrefillRank`, which sets up what it
declares.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvconn.chunk import Chunk, SegmentTable
from kvconn.protocol.ledger import RoomKey
from kvconn.protocol.rank import ChunkEnd, LegChunk, SendPlan
from kvconn.runtime.dispatch import ChunkHooks
from kvconn.runtime.rank_actions import RankActions
from kvconn.runtime.sender import lower
from kvconn.transport import Settlement

_STOP = object()
#: A Sender's planned chunk, as queued: its index, last, source and
#: destination pages, the pair's layout, decode's extras slot and this rank's.
Planned = tuple[int, bool, tuple[int, ...], tuple[int, ...], Any, int | None, int | None]
_LANDED = ChunkEnd.LANDED  # on every chunk: a module global, not an enum lookup


class FenceGate:
    """Workers share it while posting and waiting; a fence takes it alone, so
    the transport is never torn down under a running post or barrier.
    (Plain enter/leave calls, not a context manager: this is on every chunk.)"""

    def __init__(self) -> None:
        # enter/leave take the lock itself: Condition.__enter__ is one more
        # Python call on every chunk. (A plain Lock: the default RLock is slower.)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._fencing = False

    def enter(self) -> None:
        with self._lock:
            while self._fencing:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._fencing and not self._active:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._fencing:
                self._cond.wait()
            self._fencing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._fencing = False
                self._cond.notify_all()


class TransferPath(RankActions):
    """The chunk path of a prefill rank (see the module doc)."""

    _gate: FenceGate
    _queues: list[queue.SimpleQueue[Any]]
    _chunk_outcomes: Any

    # -- transfer workers --------------------------------------------------
    def enqueue(
        self, chunk: Chunk, segments: SegmentTable, incarnation: int | None = None, key: RoomKey | None = None
    ) -> None:
        """Queue ``chunk`` for the worker of its room; ``incarnation``: the
        request it belongs to (a chunk of an earlier one is skipped); ``key``:
        its room's, made once here rather than at every ledger call."""
        key = _key(chunk) if key is None else key
        self._queues[chunk.room % len(self._queues)].put((chunk, segments, incarnation, key))

    def enqueue_planned(self, plan: SendPlan, leg: LegChunk, src_pages: tuple[int, ...]) -> None:
        """Queue one leg of a committed send (:class:`~kvconn.runtime.sender.Sender`):
        its worker makes the chunk and lowers it once the ledger said it is
        written (a skipped chunk is never lowered), off the engine's thread."""
        key = leg.key
        planned = (
            plan.chunk_index,
            plan.last,
            src_pages,
            leg.dst_pages,
            leg.layout,
            leg.extras,
            plan.extras_slot,
        )
        self._queues[key.room % len(self._queues)].put((None, planned, leg.incarnation, key))

    def _work(self, q: queue.SimpleQueue[Any]) -> None:
        # One chunk is in the transport at a time, as ever. But a chunk that
        # landed is accounted for (ledger, metrics) only once the next queued
        # chunk is posted, while the transport carries that one: between two
        # chunks of a room the worker only counts and posts. An ABORT_ACK
        # that waits for that accounting waits one on_post more.
        # A room's last chunk is accounted for at once: its SUCCESS waits for
        # no other room's post, and a chunk queued behind it (a second
        # Sender's) meets a concluded room at dequeue and is skipped, instead
        # of being posted while decode hears SUCCESS. So is a chunk of a room
        # that failed meanwhile (an ABORT came): its ack waits for it. With
        # nothing queued, a landed chunk is accounted for at once too.
        self._thread.worker = True
        landed: tuple[Chunk, RoomKey] | None = None
        while True:
            if landed is None:
                item = q.get()
            else:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    self._account_landed(*landed)
                    landed = None
                    continue
            if item is _STOP:
                if landed is not None:
                    self._account_landed(*landed)
                return
            chunk, segments, incarnation, key = item
            if chunk is None:  # planned by a Sender: made here, lowered in _post
                chunk = self._planned(key, segments)
            in_flight = self._post(chunk, segments, incarnation, key)
            if landed is not None:
                self._account_landed(*landed)
                landed = None
            if in_flight is not None and self._settle(chunk, *in_flight):
                if chunk.last or self.state.ledger.is_failed(key):
                    # A failed room (decode aborted it) waits for this
                    # chunk's accounting to be acked: nothing is gained by
                    # posting its next chunk first, which would be skipped.
                    self._account_landed(chunk, key)
                else:
                    landed = (chunk, key)

    def _transfer(self, chunk: Chunk, segments: SegmentTable, incarnation: int | None = None) -> None:
        """One chunk's whole path, accounted for at once (on the caller's thread)."""
        self._thread.worker = True
        key = _key(chunk)
        in_flight = self._post(chunk, segments, incarnation, key)
        if in_flight is not None and self._settle(chunk, *in_flight):
            self._account_landed(chunk, key)

    def _planned(self, key: RoomKey, planned: Planned) -> Chunk:
        index, last, src_pages, dst_pages = planned[:4]
        return Chunk(key.room, index, last, self.rank, key.decode, src_pages, dst_pages)

    def _post(
        self, chunk: Chunk, segments: SegmentTable | Planned, incarnation: int | None, key: RoomKey
    ) -> tuple[ChunkHooks, object, float] | None:
        """Count the chunk, then post it: (hooks, handle, deadline) with the
        fence gate entered, or None if it was skipped or failed (accounted).
        A planned chunk (``segments`` its plan) is lowered once it is to be
        written."""
        hooks = self._hooks.current()
        with self._lock:
            write = self.state.ledger.dequeue(key, incarnation)  # invariant D: counted here
        try:
            if hooks.has_dequeue:
                hooks.dequeue(chunk)
            if not write and hooks.has_skip:
                hooks.skip(chunk)
        except Exception as exc:
            self._fail_chunk(key, "on_dequeue/on_skip", exc)
            return None
        if not write:
            self._ended(key, ChunkEnd.SKIPPED)
            return None
        if isinstance(segments, tuple):
            try:
                segments = lower(self.rank, chunk, *segments[4:])
            except Exception as exc:  # nothing posted: nothing of it can land
                self._ended(key, ChunkEnd.FAILED_SETTLED, f"lowering its pages failed: {exc!r}")
                return None
        self._gate.enter()
        # The deadline covers post and write: a writer frozen inside on_post
        # finds it passed and must not report the chunk landed on a guess.
        # It starts past the gate: a fence holds the gate until every running
        # barrier is over, and a chunk waiting there must not spend its own
        # budget on another peer's trouble.
        deadline = time.monotonic() + self.config.write_timeout_s
        try:
            posted = hooks.post(chunk, segments)
            if posted is None:
                raise RuntimeError("no transport answered on_post")
        except Exception as exc:
            # The gate is left first: _fail_chunk fences, and a fence waits for
            # every shared holder (this worker included).
            self._gate.leave()
            self._fail_chunk(key, "on_post", exc)
            return None
        return hooks, posted, deadline

    def _settle(self, chunk: Chunk, hooks: ChunkHooks, posted: object, deadline: float) -> bool:
        """Wait at the DONE barrier and leave the gate. True if the chunk
        landed (the caller accounts for it); otherwise accounted here."""
        failure: Exception | None = None
        try:
            settlement = hooks.done_barrier(chunk, posted, deadline)
            if not isinstance(settlement, Settlement):
                raise RuntimeError(f"on_done_barrier answered {settlement!r}")
        except Exception as exc:
            failure = exc
        finally:
            self._gate.leave()
            self._thread.settled_at = self.clock()
        if failure is not None:
            self._fail_chunk(_key(chunk), "on_done_barrier", failure)
            return False
        if settlement is Settlement.LANDED:
            return True
        self._ended(_key(chunk), _ENDS[settlement])
        return False

    def _account_landed(self, chunk: Chunk, key: RoomKey) -> None:
        with self._lock:
            self._chunk_outcomes["landed"] += 1
            if self._tracer.enabled:  # per chunk: not even a call when off
                self._tracer.landed(key)
            later = self._execute(self.state.chunk_ended(key, _LANDED, chunk.last))
        if later:
            self._after(later)

    def _ended(self, key: RoomKey, end: ChunkEnd, reason: str = "") -> None:
        """Tell the core how a chunk that did not land ended; carry out its answer."""
        with self._lock:
            self._chunk_outcomes[end.value] += 1
            later = self._execute(self.state.chunk_ended(key, end, reason=reason))
        self._after(later)

    def _fail_chunk(self, key: RoomKey, hook: str, exc: Exception) -> None:
        """A hook raised with the chunk counted."""
        self._plugin_error(hook, exc)
        self._ended(key, ChunkEnd.PLUGIN_ERROR, f"{hook} raised: {exc!r}")


#: How a DONE barrier's answer ends a chunk that did not land.
_ENDS = {Settlement.FAILED_SETTLED: ChunkEnd.FAILED_SETTLED, Settlement.UNSETTLED: ChunkEnd.UNSETTLED}


def _key(chunk: Chunk) -> RoomKey:
    return RoomKey(chunk.peer, chunk.room)


__all__ = ["FenceGate", "TransferPath"]
