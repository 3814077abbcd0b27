"""A prefill rank: transfer workers, the control listener, the sender API.

The ledger (sans-I/O) decides; this module carries out its actions and fires
the plugin hooks around them. One lock serialises every ledger call; hooks
run outside it, except that nothing here ever lets a hook decide an ack.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import numpy as np

from kvconn.buffers import Buffer
from kvconn.chunk import Chunk, SegmentTable
from kvconn.config import Config, check_deadlines
from kvconn.errors import IncompleteRoomError, PageError, RoomStateError
from kvconn.layout import KVLayout, checked_buffers
from kvconn.metrics import Metrics
from kvconn.protocol.drops import DropReason
from kvconn.protocol.ledger import (
    LIVE,
    KVPoll,
    LedgerAction,
    NotifyDecode,
    RoomEntry,
    RoomKey,
    RoomLedger,
    SendAck,
)
from kvconn.protocol.messages import (
    Abort,
    Hello,
    HelloAck,
    Message,
    RoomOutcome,
    TcpConnection,
    TransferRequest,
)
from kvconn.runtime.control import Listener, Outbox
from kvconn.runtime.dispatch import ChunkHooks, HookManager
from kvconn.runtime.layout import EngineLayout, PageLayout, peer_layout
from kvconn.runtime.procs import pid_namespace, proc_stat
from kvconn.runtime.sockets import own_connections
from kvconn.transport import Backend, Settlement, Writer, capabilities_of, register_writer

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


class _Peer:
    __slots__ = ("last_seq", "layout", "reply_to")

    def __init__(self, reply_to: str, layout: PageLayout | EngineLayout) -> None:
        self.reply_to = reply_to
        self.layout = layout
        self.last_seq = 0  #: the last request's sequence number: a fresh one is higher


class PrefillRank:
    """One prefill rank process's kvconn endpoint.

    ``backend`` writes from the rank's source memory: either the engine's
    own KV buffers (``buffers``, laid out as ``layout`` says: no copy), or
    ``source_bytes`` that kvconn allocates, holding the rank's KV shards
    (``writer.write`` fills them). Decode endpoints reach it at :attr:`address`.
    """

    def __init__(
        self,
        backend: Backend,
        rank: int,
        source_bytes: int | None = None,
        config: Config | None = None,
        observers: Iterable[object] = (),
        clock: Callable[[], float] = time.monotonic,
        on_request: Callable[[int, int], None] | None = None,
        *,
        buffers: Sequence[object] | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        """``on_request(room, npages)`` runs on the listener thread when a
        decode asks for a room (once per decode that asks: with prefill TP
        smaller than decode TP, every decode rank asks for the same room):
        an engine may start filling and sending it.

        ``buffers`` (anything :meth:`kvconn.buffers.Buffer.of` takes: the
        engine's per-layer tensors, arrays) and ``layout`` (this rank's
        :class:`~kvconn.layout.KVLayout`, ``tp_rank`` = ``rank``) go together,
        instead of ``source_bytes``."""
        engine_buffers = _source_buffers(rank, source_bytes, buffers, layout)
        self.layout = layout
        self.config = config or Config()
        self.config.apply_to_process()
        self.on_request = on_request
        self.rank = rank
        self.backend = backend
        self.source_bytes = source_bytes
        self.capabilities = capabilities_of(backend, self.config.backend_options)
        self.clock = clock
        self.metrics = Metrics("prefill")
        #: Named in every HelloAck; decode's requests carry it, so none recorded
        #: from another process at this address is taken, and every ack and
        #: status names it, so decode takes none from another process either.
        self._session = secrets.randbits(63)
        self.ledger = RoomLedger(rank, self.config.tombstone_ttl_s, self._session)
        self._lock = threading.Lock()
        pid = os.getpid()
        #: What every HelloAck announces of this process, for decode's exit proof.
        self._process = (pid_namespace(), pid, proc_stat(pid)[1])
        self._gate = FenceGate()
        self._poisoned_shown = 0
        #: The TCP connections recent fences closed: every fenced ack names
        #: them, so decode can wait for its ends to drain (runtime/sockets.py).
        self._fence_closed: deque[frozenset[TcpConnection]] = deque(maxlen=FENCES_REMEMBERED)
        self._closed_by_fences: tuple[TcpConnection, ...] = ()  # their union, as acks carry it
        self.writer: Writer
        if engine_buffers is not None:
            self.writer = register_writer(backend, engine_buffers, self.config.backend_options)
        else:
            assert source_bytes is not None  # _source_buffers checked
            self.writer = backend.open_writer(source_bytes, self.config.backend_options)
        self.pm = HookManager()
        self.pm.register(self.writer, name="transport")
        for i, observer in enumerate(observers):
            self.pm.register(observer, name=f"observer-{i}")
        self.pm.check_pending()
        self._hooks = ChunkHooks(self.pm)
        self._chunk_outcomes = self.metrics.chunks.counts  # counted under self._lock
        self._peers: dict[str, _Peer] = {}
        #: Per (decode, room): the destination pages of its current request.
        self._dst_pages: dict[RoomKey, tuple[int, ...]] = {}
        #: decode's extras slot of a room (rooms with extras only), as its pages
        self._dst_extras: dict[RoomKey, int] = {}
        #: Rooms a Sender gave up waiting for (room -> until when): a decode's
        #: request arriving later is refused, whichever decode sends it.
        self._given_up: dict[int, float] = {}
        #: Requests (ledger incarnations) a live Sender took: another Sender
        #: of the same room id takes another decode's (one Sender per
        #: request, as on_request comes). A sender dropped unused frees them.
        self._taken: weakref.WeakValueDictionary[int, Sender] = weakref.WeakValueDictionary()
        self._outbox = Outbox(self.config.auth_key, self._count_drop)
        # SimpleQueue (C): a get or put costs well under a microsecond, against
        # a few for queue.Queue's Python-level condition variables.
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(self.config.workers)]
        self._workers = [
            threading.Thread(target=self._work, args=(q,), name=f"kvconn-worker-{rank}-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        self._listener = Listener(
            f"prefill-{rank}",
            self.config.host,
            self.config.port,
            self._on_message,
            self._count_drop,
            self.config.auth_key,
            idle=self._on_idle,
        )
        self.address = self._listener.address
        for w in self._workers:
            w.start()
        self._listener.start()

    # -- engine API --------------------------------------------------------
    def sender(self, room: int, decodes: int = 1) -> Sender:
        """The engine's handle on ``room`` at this rank, written into each of
        the ``decodes`` decode endpoints that request it (prefill TP smaller
        than decode TP: every decode rank asks for the room and takes its own
        head slice of each page; each ``send()`` writes the chunk to all of
        them)."""
        return Sender(self, room, decodes)

    def requesting_tp(self, room: int) -> int | None:
        """The tensor-parallel size of a decode whose request for ``room`` is
        live here and not taken by a sender (its layout's ``tp_size``; 1 for
        a decode of equal page shards), or None while there is none.

        Room ids are per request, so every decode asking for a room here is a
        rank of one decode instance: an engine whose decode ranks each ask
        every prefill rank knows from it, on the first request, how many
        requests to wait for (``sender(room, decodes=...)``)."""
        with self._lock:
            for decode, entry in self.ledger.decodes_of(room).items():
                if entry.status in LIVE and entry.incarnation not in self._taken:
                    layout = self._peers[decode].layout
                    return layout.dst.tp_size if isinstance(layout, EngineLayout) else 1
        return None

    def close(self) -> None:
        for q in self._queues:
            q.put(_STOP)
        for w in self._workers:
            w.join(timeout=10)
        self._listener.close()
        self._outbox.close()
        self.writer.close()

    # -- control plane -----------------------------------------------------
    def _on_message(self, msg: Message) -> None:
        self.metrics.messages.labels(type(msg).__name__).inc()
        if isinstance(msg, Abort):
            self._on_abort(msg)
        elif isinstance(msg, TransferRequest):
            with self._lock:
                peer = self._peers.get(msg.decode)
                if peer is None:
                    self._count_drop(DropReason.UNKNOWN_DECODE)
                    return
                if msg.session != self._session or msg.seq <= peer.last_seq:
                    self._count_drop(DropReason.STALE_REQUEST)  # replayed, or for another process
                    return
                peer.last_seq = msg.seq
                # A room is this decode's: the same id requested by another
                # decode is another room (its own pages, counts and acks).
                key = RoomKey(msg.decode, msg.room)
                before = self.ledger.entry(key)
                if before is None and msg.room in self._given_up:
                    self.ledger.give_up(key, self.clock())  # its sender gave up: write nothing
                    before = self.ledger.entry(key)
                self.ledger.request(key, msg.seq)
                if self.ledger.entry(key) is not before:
                    # A new room, or a concluded one whose id decode reused after
                    # its pages came back: write into the pages of this request,
                    # never into the earlier pages, which decode may have handed
                    # out again.
                    self._dst_pages[key] = msg.dst_pages
                    self._dst_extras.pop(key, None)
                    if msg.extras is not None:
                        self._dst_extras[key] = msg.extras
                else:
                    self._dst_pages.setdefault(key, msg.dst_pages)
                    if msg.extras is not None:
                        self._dst_extras.setdefault(key, msg.extras)
                status = self.ledger.status(key)
                if status is KVPoll.FAILED:
                    # Failed or tombstoned here: it will write nothing, say so, or
                    # decode waits for a transfer that never comes.
                    reason = (
                        "room is failed or tombstoned at this rank (aborted, its sender gave up "
                        "waiting for this request, or its id reused too soon)"
                    )
                    failed = self.ledger.room_status(key, RoomOutcome.FAILED, reason)
                    self._outbox.send(self._peers[msg.decode].reply_to, failed)
            if self.on_request is not None:
                self.on_request(msg.room, len(msg.dst_pages))
        elif isinstance(msg, Hello):
            self._on_hello(msg)
        else:
            self._count_drop(DropReason.UNEXPECTED_TYPE)

    def _on_hello(self, msg: Hello) -> None:
        error = ""
        try:
            if msg.backend != self.backend.name:
                raise ValueError(f"decode uses backend {msg.backend!r}, this rank {self.backend.name!r}")
            check_deadlines(self.config.write_timeout_s, msg.abort_timeout_ms / 1000)
            limit = self.capabilities.max_write_timeout_s
            if limit is not None:
                check_deadlines(limit, msg.abort_timeout_ms / 1000, f"{self.backend.name}'s write timeout")
            layout = peer_layout(self.layout, msg.page_bytes, msg.num_ranks, msg.layout)
            with self._lock:
                known = self._peers.get(msg.decode)
            if known is None:
                with self._lock:
                    taken = any(peer.reply_to == msg.reply_to for peer in self._peers.values())
                if taken:
                    # Another decode listened there before: it is gone (one
                    # endpoint binds an address), and our connection to it may
                    # not have been seen to close yet.
                    self._outbox.reset(msg.reply_to)
                self.writer.connect(msg.decode, msg.metadata)
                with self._lock:
                    self._peers.setdefault(msg.decode, _Peer(msg.reply_to, layout))
            elif (known.reply_to, known.layout) != (msg.reply_to, layout):
                # A decode's name is new with every endpoint: this one is known,
                # and a Hello that changes where it listens or how its pages are
                # laid out is not its own (nor is a replay allowed to reset it).
                raise ValueError(
                    f"decode {msg.decode} is already bootstrapped with another address or layout"
                )
        except Exception as exc:
            log.warning("refusing bootstrap from %s: %s", msg.decode, exc)
            error = str(exc) or type(exc).__name__
        ack = HelloAck(self.rank, self.address, *self._process, error, self._session)
        self._outbox.send(msg.reply_to, ack)

    def _on_abort(self, msg: Abort) -> None:
        if not self._outbox.reachable(msg.reply_to):
            # No ack could ever go there: drop it whole, or the ledger would
            # keep an ack target that fails every send.
            self._count_drop(DropReason.BAD_REPLY_TO)
            return
        key = RoomKey(msg.decode, msg.room)
        with self._lock:
            known = self.ledger.abort(msg, self.clock())
        try:
            self.pm.hook.on_abort_notification(abort=msg, known=known)
        except Exception as exc:
            self._plugin_error("on_abort_notification", exc)
            with self._lock:
                self._execute(self.ledger.poison(key, "on_abort_notification raised"))
            # Nothing else would fence this room (no chunk of it need fail): fence
            # now, off the listener thread (the fence waits for running posts).
            threading.Thread(target=self._fence, name=f"kvconn-fence-{self.rank}", daemon=True).start()
        with self._lock:
            self._execute(self.ledger.try_ack(key))

    def _on_idle(self) -> float | None:
        now = self.clock()
        with self._lock:
            for key in self.ledger.expire(now):
                self._dst_pages.pop(key, None)
                self._dst_extras.pop(key, None)
            if self._given_up:
                for room in [r for r, until in self._given_up.items() if until <= now]:
                    del self._given_up[room]
        return None

    # -- transfer workers --------------------------------------------------
    def _enqueue(
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
            write = self.ledger.dequeue(key, incarnation)  # invariant D: counted here
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
                self._execute(self.ledger.skipped(key))
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
            self._execute(self.ledger.failed(_key(chunk), settlement is Settlement.FAILED_SETTLED, reason))
        if settlement is Settlement.UNSETTLED:
            self._fence()
        return False

    def _account_landed(self, chunk: Chunk, key: RoomKey) -> None:
        with self._lock:
            self._chunk_outcomes["landed"] += 1
            self._execute(self.ledger.landed(key, chunk.last))

    def _fail_chunk(self, chunk: Chunk, hook: str, exc: Exception) -> None:
        """A hook raised with the chunk counted: poison, never uncount."""
        self._plugin_error(hook, exc)
        with self._lock:
            self._chunk_outcomes["plugin_error"] += 1
            self._execute(self.ledger.failed(_key(chunk), settled=False, reason=f"{hook} raised: {exc!r}"))
        self._fence()

    def _fence(self) -> None:
        """Un-poison rooms through the writer's fence, if it has one."""
        if not self.capabilities.writer_fence:
            self._update_poisoned()
            return
        with self._gate.exclusive():
            with self._lock:
                if not self.ledger.poisoned():
                    return
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
            with self._lock:
                self._fence_closed.append(before - own_connections())
                self._closed_by_fences = tuple(sorted(frozenset().union(*self._fence_closed)))
                self._execute(self.ledger.fenced())

    # -- helpers -----------------------------------------------------------
    def _execute(self, actions: Sequence[LedgerAction]) -> None:
        """Carry out ledger actions; called with the lock held."""
        for action in actions:
            if isinstance(action, SendAck):
                if self.config.acks_enabled:
                    ack = action.ack
                    if ack.fenced and self._closed_by_fences:
                        ack = attrs.evolve(ack, closed=self._closed_by_fences)
                    if self._outbox.send(action.reply_to, ack):
                        self.metrics.acks_sent.inc()
            elif isinstance(action, NotifyDecode):
                peer = self._peers.get(action.decode)
                if peer is not None:
                    self._outbox.send(peer.reply_to, action.status)
        poisoned = self.ledger.poisoned_count()
        if poisoned != self._poisoned_shown:
            self._poisoned_shown = poisoned
            self.metrics.poisoned_rooms.set(poisoned)

    def _update_poisoned(self) -> None:
        with self._lock:
            self._poisoned_shown = self.ledger.poisoned_count()
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

    def _count_drop(self, reason: DropReason) -> None:
        self.metrics.dropped.labels(reason).inc()


def _key(chunk: Chunk) -> RoomKey:
    return RoomKey(chunk.peer, chunk.room)


def _with_extras(
    room: int, layout: PageLayout | EngineLayout, segments: SegmentTable, src_slot: int | None, dst_slot: int
) -> SegmentTable:
    """A last chunk's segments, and its room's extras after them."""
    if not isinstance(layout, EngineLayout):
        raise ValueError(f"room {room}: decode asked for extras, but its pages are no engine layout")
    if not layout.src.writes_extras_to(layout.dst):
        return segments
    if src_slot is None:
        raise ValueError(
            f"room {room}: decode asked for its extras; the last chunk must name this rank's slot"
        )
    extras = layout.src.extra_segments(layout.dst, src_slot, dst_slot)
    return SegmentTable(np.concatenate([segments.rows, extras.rows]))


def _source_buffers(
    rank: int, source_bytes: int | None, buffers: Sequence[object] | None, layout: KVLayout | None
) -> tuple[Buffer, ...] | None:
    """The engine's source buffers, checked against the layout (None: kvconn
    allocates ``source_bytes``)."""
    if (buffers is None) != (layout is None):
        raise ValueError("buffers= and layout= go together")
    if (buffers is None) == (source_bytes is None):
        raise ValueError("give a prefill rank either source_bytes or buffers= and layout=")
    if buffers is None or layout is None:
        return None
    if layout.tp_rank != rank:
        raise ValueError(f"rank {rank} with a layout for tp_rank {layout.tp_rank}")
    return checked_buffers(buffers, layout)


@attrs.define(slots=True, eq=False)
class _Leg:
    """One decode's request for a sender's room: its ledger entry, as the
    sender first saw it live."""

    key: RoomKey
    entry: RoomEntry


class Sender:
    """The engine's handle on one room at this rank (like SGLang's KVSender).

    It writes the room into ``decodes`` decode endpoints (1 unless prefill
    TP is smaller than decode TP: then each decode rank requests the room
    and takes its own head slice of every page). It takes the first
    ``decodes`` live requests for the room id that arrive, one per decode
    endpoint, that no other sender took (so one sender per decode's request,
    made as ``on_request`` reports each, works too), and each :meth:`send` queues the chunk to every one of them,
    into that decode's own pages. Until all ``decodes`` requests came,
    :meth:`poll` says BOOTSTRAPPING and :meth:`send` raises.

    Each decode's room is its own at this rank: its counts, acks, fences and
    status. One decode's abort fails only its room: the others still
    complete, and :meth:`statuses` says how each ended; :meth:`poll` sums
    them up (FAILED if any failed, SUCCESS once all succeeded).

    Decode may reuse a room id once the room concluded. A sender belongs to
    the requests it first saw (their ledger incarnations): its late
    ``clear()`` or ``fail()`` leaves a later request for the same id alone,
    and it sends nothing into one. Once it has seen its requests conclude,
    or was cleared, :meth:`poll` keeps that verdict.
    """

    def __init__(self, rank: PrefillRank, room: int, decodes: int = 1) -> None:
        if decodes < 1:
            raise ValueError(f"room {room}: a sender writes into at least one decode, got decodes={decodes}")
        self._rank = rank
        self.room = room
        self.decodes = decodes
        self._sent = 0
        self._index = 0
        self._last_sent = False
        #: The requests this sender writes, once it saw them live.
        self._legs: list[_Leg] = []
        self._verdict: KVPoll | None = None
        self._cleared = False
        self._gave_up = False
        timeout = rank.config.room_bootstrap_timeout_s
        #: When this sender stops waiting for decode's request (None: never).
        self._bootstrap_deadline = None if timeout is None else rank.clock() + timeout

    def poll(self) -> KVPoll:
        with self._rank._lock:
            return self._poll_locked()

    def statuses(self) -> dict[str, KVPoll]:
        """Each decode endpoint's room, by decode name, as this sender saw it
        (only the requests it took)."""
        with self._rank._lock:
            self._poll_locked()
            return {leg.key.decode: self._leg_status(leg) for leg in self._legs}

    def _bind_locked(self) -> None:
        """Take live requests for the room, oldest first, up to ``decodes``:
        a concluded room may be an earlier request's, not yet cleared."""
        if len(self._legs) >= self.decodes:
            return
        taken = self._rank._taken
        live = sorted(
            (entry.incarnation, decode, entry)
            for decode, entry in self._rank.ledger.decodes_of(self.room).items()
            if entry.incarnation not in taken and entry.status in LIVE
        )
        for _, decode, entry in live[: self.decodes - len(self._legs)]:
            self._legs.append(_Leg(RoomKey(decode, self.room), entry))
            taken[entry.incarnation] = self

    def _leg_status(self, leg: _Leg) -> KVPoll:
        status = leg.entry.status
        if leg.entry is not self._rank.ledger.entry(leg.key) and status < KVPoll.SUCCESS:
            status = KVPoll.FAILED  # forgotten unconcluded: nothing of it is written any more
        return status

    def _poll_locked(self) -> KVPoll:
        if self._verdict is not None:
            return self._verdict
        self._bind_locked()
        statuses = [self._leg_status(leg) for leg in self._legs]
        if KVPoll.FAILED in statuses:
            self._verdict = KVPoll.FAILED
            return self._verdict
        if len(self._legs) < self.decodes:
            deadline = self._bootstrap_deadline
            if deadline is not None and self._rank.clock() >= deadline:
                self._give_up()
                return KVPoll.FAILED
            return KVPoll.BOOTSTRAPPING
        if all(s is KVPoll.SUCCESS for s in statuses):
            self._verdict = KVPoll.SUCCESS
            return self._verdict
        if any(s >= KVPoll.TRANSFERRING for s in statuses):
            return KVPoll.TRANSFERRING
        return KVPoll.WAITING_FOR_INPUT

    def _give_up(self) -> None:
        """(With the lock.) Stop waiting for decodes' requests: a request
        arriving later writes nothing (decode is told FAILED), and the
        requests already taken fail."""
        rank = self._rank
        rank._given_up[self.room] = rank.clock() + rank.config.tombstone_ttl_s
        rank.metrics.room_bootstrap_timeouts.inc()
        for leg in self._legs:
            reason = "the prefill engine gave up waiting for every decode's request"
            rank._execute(rank.ledger.fail(leg.key, reason, leg.entry.incarnation))
        self._verdict = KVPoll.FAILED
        self._gave_up = True

    def send(self, src_pages: Sequence[int], last: bool = False, extras_slot: int | None = None) -> None:
        """Queue the next ``len(src_pages)`` pages of the room for writing,
        into every decode the sender writes.

        ``extras_slot``: with the last chunk, this rank's slot of the room's
        per-room extras (its layout's ``extras``), written into the slot
        decode asked for along with the pages. Required then if decode asked
        for extras and this rank writes them (see ``KVLayout.extra_segments``).

        ``last``: this is the room's final chunk, and it must complete the
        room's destination pages. Once it lands, decode is told Success and
        may hand the pages out again, so no chunk may follow it: this
        sender, or any sender of the room while it is Success, raises
        :class:`~kvconn.errors.RoomStateError` (a room id decode reuses
        starts over with its request). A refused send queues nothing.
        """
        if self._last_sent:
            raise RoomStateError("its last chunk was sent, no chunk may follow it", self.room)
        rank = self._rank
        with rank._lock:
            polled = self._poll_locked()
            legs = [
                (
                    leg,
                    rank.ledger.entry(leg.key),
                    rank._dst_pages.get(leg.key),
                    rank._dst_extras.get(leg.key),
                )
                for leg in self._legs
            ]
            # A room that is complete here, and not this sender's: its pages
            # are decode's again, whoever sent it.
            complete = len(legs) < self.decodes and any(
                entry.status is KVPoll.SUCCESS for entry in rank.ledger.decodes_of(self.room).values()
            )
        for leg, current, _, _ in legs:
            if current is not leg.entry:
                raise RoomStateError(
                    "its request is over (the room was cleared, or requested again since this sender began)",
                    self.room,
                )
        if self._cleared:
            raise RoomStateError(f"this sender was cleared ({polled.name})", self.room)
        if self._gave_up:
            raise RoomStateError("this sender gave up waiting for decode's request", self.room)
        if complete:
            raise RoomStateError("complete at this rank: no chunk may follow its last", self.room)
        if len(legs) < self.decodes or any(dst is None for _, _, dst, _ in legs):
            raise RoomStateError(
                f"not bootstrapped yet ({len(legs)} of {self.decodes} decodes requested it; "
                f"poll() says {polled.name})",
                self.room,
            )
        if any(leg.entry.status is KVPoll.SUCCESS for leg, _, _, _ in legs):
            # Its last chunk landed and decode was told: the pages are decode's again.
            raise RoomStateError("complete at this rank: no chunk may follow its last", self.room)
        work = []
        for leg, _, dst_all, dst_extras in legs:
            assert dst_all is not None  # checked above
            work.append(self._lowered(leg.key, src_pages, last, extras_slot, dst_all, dst_extras))
        self._sent += len(src_pages)
        self._index += 1
        self._last_sent = last
        for (chunk, segments), (leg, _, _, _) in zip(work, legs, strict=True):
            rank._enqueue(chunk, segments, leg.entry.incarnation, leg.key)

    def _lowered(
        self,
        key: RoomKey,
        src_pages: Sequence[int],
        last: bool,
        extras_slot: int | None,
        dst_all: tuple[int, ...],
        dst_extras: int | None,
    ) -> tuple[Chunk, SegmentTable]:
        """The next chunk for ``key``'s decode, checked and lowered (raises
        before anything is queued)."""
        rank = self._rank
        dst = dst_all[self._sent : self._sent + len(src_pages)]
        left = len(dst_all) - self._sent
        if len(dst) != len(src_pages):
            raise PageError(f"{left} pages left, got {len(src_pages)}", self.room)
        if last and len(src_pages) != left:
            raise IncompleteRoomError(
                f"a last chunk of {len(src_pages)} pages leaves {left - len(src_pages)} of the "
                f"room's {len(dst_all)} destination pages unwritten",
                self.room,
            )
        layout = rank._peers[key.decode].layout
        if isinstance(layout, EngineLayout):
            capacity = layout.src.num_pages
        else:
            assert rank.source_bytes is not None  # a rank without a layout allocated its source
            capacity = rank.source_bytes // layout.shard
        bad = [p for p in src_pages if not 0 <= p < capacity]
        if bad:
            raise PageError(f"source pages {bad[:8]} outside 0..{capacity - 1}", self.room)
        chunk = Chunk(self.room, self._index, last, rank.rank, key.decode, tuple(src_pages), tuple(dst))
        # Lowered here, on the engine's thread, while the worker writes the
        # previous chunk (1024 scattered pages: ~0.08 ms).
        segments = layout.segments(rank.rank, chunk.src_pages, chunk.dst_pages)
        if last and dst_extras is not None:
            segments = _with_extras(self.room, layout, segments, extras_slot, dst_extras)
        return chunk, segments

    def settled(self) -> bool:
        """The room is Success or Failed and no chunk of it is being written
        any more, at any of its decodes: its source pages may be reused."""
        rank = self._rank
        with rank._lock:
            self._bind_locked()
            return all(
                self._leg_status(leg) in (KVPoll.SUCCESS, KVPoll.FAILED)
                and leg.entry.outstanding == leg.entry.stuck
                for leg in self._legs
            )

    def fail(self, reason: str) -> None:
        """Prefill-initiated failure: tell every decode, write nothing more.
        A decode whose request has not come yet is told FAILED when it does."""
        rank = self._rank
        with rank._lock:
            self._bind_locked()
            for leg in self._legs:
                rank._execute(rank.ledger.fail(leg.key, reason, leg.entry.incarnation))
            if len(self._legs) < self.decodes:
                rank._given_up[self.room] = rank.clock() + rank.config.tombstone_ttl_s
                self._verdict = KVPoll.FAILED
            self._poll_locked()

    def clear(self) -> None:
        """The engine is done with the room (success or not). A room still
        live fails, and its decode is told: its queued chunks will not be
        written. Afterwards :meth:`poll` says Success or Failed for good."""
        rank, ledger = self._rank, self._rank.ledger
        with rank._lock:
            if self._cleared:
                return
            self._cleared = True
            self._bind_locked()
            if not self._legs:
                # A sender that never saw a request live clears whatever the
                # room has now (as it always did), and only that.
                present = sorted(
                    (entry.incarnation, decode, entry)
                    for decode, entry in ledger.decodes_of(self.room).items()
                )
                self._legs = [_Leg(RoomKey(d, self.room), e) for _, d, e in present[: self.decodes]]
                if not self._legs:
                    self._verdict = KVPoll.FAILED  # nothing requested: nothing will be sent
                    return
            for leg in self._legs:
                rank._execute(ledger.clear(leg.key, leg.entry.incarnation))
                if ledger.status(leg.key) is None:
                    rank._dst_pages.pop(leg.key, None)
                    rank._dst_extras.pop(leg.key, None)
            verdict = self._poll_locked()
            self._verdict = verdict if verdict >= KVPoll.SUCCESS else KVPoll.FAILED
