"""A prefill rank: transfer workers, the control listener, the engine's API.

An I/O shell. :class:`~kvconn.protocol.rank.RankState` decides what a
request, an abort or an engine's sender call means, and the ledger what a
chunk may do; this module carries out their actions (send, fire a plugin
hook, fence, count) and runs the threads. One lock serialises every call
into the state machines; hooks run outside it, and nothing here ever lets a
hook decide an ack.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvconn.buffers import Buffer
from kvconn.config import Config
from kvconn.errors import ArgumentError
from kvconn.layout import KVLayout, checked_buffers
from kvconn.metrics import Exported, Metrics, export
from kvconn.protocol.drain import REFUSED as DRAIN_REFUSED
from kvconn.protocol.drain import DrainReport, rank_report_after
from kvconn.protocol.ledger import FENCES_REMEMBERED, KVPoll, RoomLedger
from kvconn.protocol.messages import Abort, Message
from kvconn.protocol.rank import Peer, RankState, Verdict, WriterTerms
from kvconn.runtime.control import Listener, Outbox
from kvconn.runtime.dispatch import ChunkHooks, HookManager
from kvconn.runtime.layout import EngineLayout, PageLayout
from kvconn.runtime.procs import pid_namespace, proc_stat
from kvconn.runtime.sender import Sender
from kvconn.runtime.tracing import rank_tracer
from kvconn.runtime.transfer import _STOP, FenceGate, TransferPath
from kvconn.transport import Backend, Writer, capabilities_of, register_writer

PeerLayout = PageLayout | EngineLayout


class PrefillRank(TransferPath):
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
        self._tracer = rank_tracer(self.config.tracing, self.metrics.trace_contexts_dropped.inc)
        #: Named in every HelloAck; decode's requests carry it, so none recorded
        #: from another process at this address is taken, and every ack and
        #: status names it, so decode takes none from another process either.
        self._session = secrets.randbits(63)
        self._lock = threading.Lock()
        pid = os.getpid()
        #: What every HelloAck announces of this process, for decode's exit proof.
        self._process = (pid_namespace(), pid, proc_stat(pid)[1])
        self._gate = FenceGate()
        self._poisoned_shown = 0
        self._thread = threading.local()
        #: When each ABORT reached the handler, until its ack is sent
        #: (``kvconn_abort_ack_own_seconds``).
        self._abort_at: dict[tuple[str, int], float] = {}
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
        self._outbox = Outbox(
            self.config.auth_key, self._count_drop, stalled_after_s=2 * self.config.peer_timeout_s
        )
        #: Every decision: bootstraps, requests, senders, verdicts, chunks' ends.
        terms = WriterTerms(
            backend.name,
            self.config.write_timeout_s,
            self.capabilities.max_write_timeout_s,
            self.capabilities.writer_fence,
        )
        self.state: RankState[PeerLayout] = RankState(
            RoomLedger(rank, self.config.tombstone_ttl_s, self._session),
            self.config.room_bootstrap_timeout_s,
            self._outbox.reachable,
            terms,
        )
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
        self.metrics.rank_info.set_function(lambda: [((self.address, str(self.rank)), 1.0)])
        self.metrics_server: Exported | None = None
        if self.config.metrics_port is not None:
            try:
                self.metrics_server = export(
                    self.metrics, f"prefill-{rank}", self.config.metrics_port, self.config.host
                )
            except BaseException:
                self._listener.close()
                self._outbox.close()
                raise
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

    def fail_room(self, room: int, reason: str) -> None:
        """Fail ``room`` for every decode, before (or without) knowing how
        many will ask: each request here now is told FAILED and written
        nothing more, and so is each arriving within ``tombstone_ttl_s``.
        For an engine that gives a request up before any decode asked (a
        sender needs to know how many decodes to wait for)."""
        self.step(lambda state, now: (None, state.fail_room(room, reason, now)))

    def requesting_tp(self, room: int) -> int | None:
        """The tensor-parallel size of a decode whose request for ``room`` is
        here and not taken by a sender (its layout's ``tp_size``; 1 for a
        decode of equal page shards), or None while there is none.

        Room ids are per request, so every decode asking for a room here is a
        rank of one decode instance: an engine whose decode ranks each ask
        every prefill rank knows from it, on the first request, how many
        requests to wait for (``sender(room, decodes=...)``)."""
        with self._lock:
            return self.state.requesting_tp(room)

    @property
    def ledger(self) -> RoomLedger:
        """The rank's room ledger (read it under the rank's lock)."""
        return self.state.ledger

    @property
    def _peers(self) -> dict[str, Peer[PeerLayout]]:
        return self.state.peers

    #: How often drain() looks whether the rank drained.
    DRAIN_POLL_S = 0.005

    def drain(self, grace_s: float, timeout_s: float | None = None) -> DrainReport:
        """Take this rank out of service (scale-down, rolling upgrade).

        From now on every new request is refused at once (decode's receiver
        fails with a reason in ``kvconn.protocol.drain.DRAIN_REASONS``: route
        it elsewhere or recompute) and every decode is told. Rooms held here
        get ``grace_s`` to complete; those still live then are failed (decode
        is told). Returns once nothing of this rank can land any more (every
        posted write landed, failed settled, or was fenced), having told
        every decode so: their pages come back by proof, with no timeout.
        Waits at most ``timeout_s`` (default: ``grace_s`` plus the write
        deadline plus 1 s, time for writes in flight to fail and be fenced:
        ``kvconn.protocol.drain.rank_report_after``); a report with
        ``drained`` False says what was left. A second call keeps the grace
        and starts its own wait.

        The rank keeps answering (aborts are acked, requests refused) until
        :meth:`close`. A signal path: ``kvconn.runtime.drain_signal``."""
        # When to fail rooms and when to report are RankState's; the drain
        # runs on the clock this call waits on (as decode's does).
        report_after = rank_report_after(grace_s, self.config.write_timeout_s, timeout_s)
        self.step(lambda state, _: (None, state.begin_drain(time.monotonic(), grace_s, report_after)))
        while (report := self.step(lambda state, _: state.drain_report(time.monotonic()))) is None:
            time.sleep(self.DRAIN_POLL_S)
        return report

    @property
    def draining(self) -> bool:
        """drain() was called."""
        with self._lock:
            return self.state.drain is not None

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
        for q in self._queues:
            q.put(_STOP)
        for w in self._workers:
            w.join(timeout=10)
        self._listener.close()
        self._outbox.close()
        with self._lock:
            self._tracer.close()
        self.writer.close()

    # -- control plane -----------------------------------------------------
    def _on_message(self, msg: Message) -> None:
        # step() without its closure: this runs for every control message.
        self.metrics.count_message(type(msg))
        now = self.clock()
        if type(msg) is Abort:
            self._abort_arrived(msg, now)
        with self._lock:
            actions = self.state.handle(msg, now)
            if self._tracer.enabled:
                actions = self._tracer.request(msg, self.rank, actions)
            later = self._execute(actions)
        if later:
            self._after(later)

    def _on_idle(self) -> float | None:
        """Between messages: the core's timers, when one is due, and how long
        the listener may sleep (None: until a message; nothing is due)."""
        now = self.clock()
        with self._lock:
            due = self.state.next_wakeup()
            if due is not None and due <= now:
                later = self._execute(self.state.tick(now))
                due = self.state.next_wakeup()
            else:
                later = []
        if later:
            self._after(later)
        return None if due is None else max(0.0, due - now)


def _source_buffers(
    rank: int, source_bytes: int | None, buffers: Sequence[object] | None, layout: KVLayout | None
) -> tuple[Buffer, ...] | None:
    """The engine's source buffers, checked against the layout (None: kvconn
    allocates ``source_bytes``)."""
    if (buffers is None) != (layout is None):
        raise ArgumentError("buffers= and layout= go together")
    if (buffers is None) == (source_bytes is None):
        raise ArgumentError("give a prefill rank either source_bytes or buffers= and layout=")
    if buffers is None or layout is None:
        return None
    if layout.tp_rank != rank:
        raise ArgumentError(f"rank {rank} with a layout for tp_rank {layout.tp_rank}")
    return checked_buffers(buffers, layout)


__all__ = [
    "DRAIN_REFUSED",
    "FENCES_REMEMBERED",
    "FenceGate",
    "KVPoll",
    "PrefillRank",
    "Sender",
    "Verdict",
    "_STOP",
]
