"""A prefill rank's chunk path: transfer workers, the fence gate, the fence.

Each worker takes a chunk, lets the ledger count and decide it (invariant
D), posts it through the plugins and waits at its DONE barrier; a chunk
that failed unsettled poisons its room until the writer's fence. The ledger
decides; this module carries out its answers. :class:`TransferPath` is a
part of :class:`~kvconn.runtime.prefill.PrefillRank`, which sets up what it
declares.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

from kvconn.chunk import Chunk, SegmentTable
from kvconn.config import Config
from kvconn.metrics import Metrics
from kvconn.protocol.drain import Announce
from kvconn.protocol.ledger import NotifyDecode, RoomKey, SendAck
from kvconn.protocol.messages import RankDraining, TcpConnection
from kvconn.protocol.rank import Action, Drop, GaveUp, RankState
from kvconn.runtime.control import Outbox
from kvconn.runtime.dispatch import ChunkHooks, HookManager
from kvconn.runtime.sockets import own_connections
from kvconn.runtime.tracing import NoTracer
from kvconn.transport import Capabilities, Settlement

log = logging.getLogger(__name__)

_STOP = object()
#: How many fences' closed connections a fenced ack names: a room fenced by
#: one fence may be acked after later ones (its ABORT came late).
FENCES_REMEMBERED = 16


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


class TransferPath:
    """The chunk path of a prefill rank (see the module doc)."""

    rank: int
    config: Config
    capabilities: Capabilities
    metrics: Metrics
    pm: HookManager
    state: RankState[Any]
    _lock: threading.Lock
    _gate: FenceGate
    _hooks: ChunkHooks
    _outbox: Outbox
    _queues: list[queue.SimpleQueue[Any]]
    _chunk_outcomes: Any
    _poisoned_shown: int
    _fence_closed: deque[frozenset[TcpConnection]]
    _closed_by_fences: tuple[TcpConnection, ...]
    _tracer: NoTracer

    # -- transfer workers --------------------------------------------------
    def enqueue(
        self, chunk: Chunk, segments: SegmentTable, incarnation: int | None = None, key: RoomKey | None = None
    ) -> None:
        """Queue ``chunk`` for the worker of its room; ``incarnation``: the
        request it belongs to (a chunk of an earlier one is skipped); ``key``:
        its room's, made once here rather than at every ledger call."""
        key = _key(chunk) if key is None else key
        self._queues[chunk.room % len(self._queues)].put((chunk, segments, incarnation, key))

    def _work(self, q: queue.SimpleQueue[Any]) -> None:
        # One chunk is in the transport at a time, as ever. But a chunk that
        # landed is accounted for (ledger, metrics) only once the next queued
        # chunk is posted, while the transport carries that one: between two
        # chunks of a room the worker only counts and posts. An ABORT_ACK
        # that waits for that accounting waits one on_post more.
        # A room's last chunk is accounted for at once: its SUCCESS waits for
        # no other room's post, and a chunk queued behind it (a second
        # Sender's) meets a concluded room at dequeue and is skipped, instead
        # of being posted while decode hears SUCCESS. With nothing queued, a
        # landed chunk is accounted for at once too.
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
            in_flight = self._post(chunk, segments, incarnation, key)
            if landed is not None:
                self._account_landed(*landed)
                landed = None
            if in_flight is not None and self._settle(chunk, *in_flight):
                if chunk.last:
                    self._account_landed(chunk, key)
                else:
                    landed = (chunk, key)

    def _transfer(self, chunk: Chunk, segments: SegmentTable, incarnation: int | None = None) -> None:
        """One chunk's whole path, accounted for at once."""
        key = _key(chunk)
        in_flight = self._post(chunk, segments, incarnation, key)
        if in_flight is not None and self._settle(chunk, *in_flight):
            self._account_landed(chunk, key)

    def _post(
        self, chunk: Chunk, segments: SegmentTable, incarnation: int | None, key: RoomKey
    ) -> tuple[ChunkHooks, object, float] | None:
        """Count the chunk, then post it: (hooks, handle, deadline) with the
        fence gate entered, or None if it was skipped or failed (accounted)."""
        hooks = self._hooks.current()
        with self._lock:
            write = self.state.ledger.dequeue(key, incarnation)  # invariant D: counted here
        try:
            if hooks.has_dequeue:
                hooks.dequeue(chunk)
            if not write and hooks.has_skip:
                hooks.skip(chunk)
        except Exception as exc:
            self._fail_chunk(chunk, "on_dequeue/on_skip", exc)
            return None
        if not write:
            with self._lock:
                self._chunk_outcomes["skipped"] += 1
                self._execute(self.state.ledger.skipped(key))
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
            self._fail_chunk(chunk, "on_post", exc)
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
        if failure is not None:
            self._fail_chunk(chunk, "on_done_barrier", failure)
            return False
        if settlement is Settlement.LANDED:
            return True
        with self._lock:
            self._chunk_outcomes[settlement.value] += 1
            reason = f"transfer {settlement.value}"
            self._execute(
                self.state.ledger.failed(_key(chunk), settlement is Settlement.FAILED_SETTLED, reason)
            )
        if settlement is Settlement.UNSETTLED:
            self._fence()
        return False

    def _account_landed(self, chunk: Chunk, key: RoomKey) -> None:
        with self._lock:
            self._chunk_outcomes["landed"] += 1
            if self._tracer.enabled:  # per chunk: not even a call when off
                self._tracer.landed(key)
            self._execute(self.state.ledger.landed(key, chunk.last))

    def _fail_chunk(self, chunk: Chunk, hook: str, exc: Exception) -> None:
        """A hook raised with the chunk counted: poison, never uncount."""
        self._plugin_error(hook, exc)
        with self._lock:
            self._chunk_outcomes["plugin_error"] += 1
            self._execute(
                self.state.ledger.failed(_key(chunk), settled=False, reason=f"{hook} raised: {exc!r}")
            )
        self._fence()

    def _fence(self) -> None:
        """Un-poison rooms through the writer's fence, if it has one."""
        if not self.capabilities.writer_fence:
            self._update_poisoned()
            return
        with self._gate.exclusive():
            with self._lock:
                rooms = self.state.ledger.poisoned()
                if not rooms:
                    return
                contexts = self._tracer.contexts(rooms)
            with self._tracer.fence(contexts, len(rooms), self.rank) as traced:
                self._fence_rooms(traced)

    def _fence_rooms(self, traced: dict[str, object]) -> None:
        """(Holding the gate.) The fence itself; ``traced`` gets its result."""
        before = own_connections()
        try:
            fenced = self.pm.hook.on_fence()
        except Exception as exc:
            self._plugin_error("on_fence", exc)
            fenced = None
        if fenced is not True:
            self.metrics.fences.labels("failed").inc()
            self._update_poisoned()
            return
        self.metrics.fences.labels("ok").inc()
        traced["result"] = "ok"
        with self._lock:
            closed = before - own_connections()
            traced["closed"] = len(closed)
            self._fence_closed.append(closed)
            self._closed_by_fences = tuple(sorted(frozenset().union(*self._fence_closed)))
            self._execute(self.state.ledger.fenced())

    def _execute(self, actions: Sequence[Action]) -> list[Action]:
        """Carry out the actions that send or count (with the lock held);
        returns those that run hooks or threads, for :meth:`_after`."""
        deferred: list[Action] = []
        for action in actions:
            if isinstance(action, SendAck):
                if self.config.acks_enabled:
                    ack = action.ack
                    if ack.fenced and self._closed_by_fences:
                        ack = attrs.evolve(ack, closed=self._closed_by_fences)
                    if self._outbox.send(action.reply_to, ack):
                        self.metrics.acks_sent.inc()
                        self._tracer.acked(ack, self.rank)
            elif isinstance(action, NotifyDecode):
                peer = self.state.peers.get(action.decode)
                if peer is not None and self._outbox.send(peer.reply_to, action.status):
                    self._tracer.notified(action.decode, action.status)
            elif isinstance(action, Announce):
                peer = self.state.peers.get(action.decode)
                if peer is not None:
                    ledger = self.state.ledger
                    closed = self._closed_by_fences
                    notice = RankDraining(ledger.rank, ledger.session, action.decode, action.done, closed)
                    self._outbox.send(peer.reply_to, notice)
            elif isinstance(action, Drop):
                self.metrics.dropped.labels(action.reason).inc()
            elif isinstance(action, GaveUp):
                self.metrics.room_bootstrap_timeouts.inc()
            else:
                deferred.append(action)
        poisoned = self.state.ledger.poisoned_count()
        if poisoned != self._poisoned_shown:
            self._poisoned_shown = poisoned
            self.metrics.poisoned_rooms.set(poisoned)
        return deferred

    def _update_poisoned(self) -> None:
        with self._lock:
            self._poisoned_shown = self.state.ledger.poisoned_count()
            self.metrics.poisoned_rooms.set(self._poisoned_shown)

    def _plugin_error(self, hook: str, exc: Exception) -> None:
        """Log and count a hook that raised; then let go of its frames."""
        log.error("kvconn plugin raised in %s: %r; failing safe", hook, exc)
        self.metrics.plugin_errors.labels(hook).inc()
        # The traceback keeps the raising hook's frames alive, and with them
        # what the hook held: an agent the fence that follows must destroy
        # (nixl's fence refuses while anything else holds its agent).
        chained: list[BaseException | None] = [exc]
        seen: set[int] = set()
        while chained:
            e = chained.pop()
            if e is not None and id(e) not in seen:
                seen.add(id(e))
                e.__traceback__ = None
                chained += [e.__cause__, e.__context__]


def _key(chunk: Chunk) -> RoomKey:
    return RoomKey(chunk.peer, chunk.room)
