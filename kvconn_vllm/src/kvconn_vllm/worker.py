"""The worker-side half: kvconn endpoints over vLLM's own KV tensors.

Prefill runs a :class:`~kvconn.runtime.prefill.PrefillRank` whose source
memory is the KV cache; a finished request's blocks are sent as one chunk
into the pages decode asks for (into every decode rank that asks, each
taking its heads, when decode runs more TP ranks than prefill). Decode runs a
:class:`~kvconn.runtime.decode.DecodeEndpoint` whose pages are the KV cache
blocks, one endpoint for every prefill instance (each request names its
instance). A decode block goes back to vLLM only through kvconn: a received
room (every rank reported every byte landed), or, for a request vLLM
aborted or a transfer that failed, ``on_release`` with its proof. Never on
a timeout: past its deadline (kvconn's per-room ``transfer_timeout_s``) a
room fails and is aborted, and its blocks stay allocated until proof.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Generator, Iterable, Mapping
from typing import Any

import attrs

from kvconn.chunk import Chunk
from kvconn.errors import KvconnError
from kvconn.hookspecs import hookimpl
from kvconn.layout import KVLayout
from kvconn.metrics import Metrics
from kvconn.metrics_relay import Reporter
from kvconn.plugins import get_backend
from kvconn.runtime.decode import DecodeEndpoint, DrainReport, Receiver, Release
from kvconn.runtime.prefill import DRAIN_REFUSED, KVPoll, PrefillRank, Sender
from kvconn.runtime.trace_export import trace_to_file
from kvconn.transport import Backend
from kvconn_vllm.conformance import check_transport
from kvconn_vllm.layout import KVGeometry, engine_memory
from kvconn_vllm.metadata import KvconnMetadata, Recv, Send
from kvconn_vllm.settings import Settings

log = logging.getLogger(__name__)

#: Rooms decode asked for before this worker heard of them (the proxy is
#: quick): remembered up to this many, oldest forgotten first.
MAX_EARLY_REQUESTS = 65536
#: A sender's states in which its room may still be sent.
_SENDABLE = (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING)
#: In an idle step, how often decode looks at its rooms (a room's status
#: arriving wakes nothing here), and how soon the engine thread looks again
#: after a write's barrier woke it (the rank accounts for the write just after).
DECODE_POLL_S = 0.0005
RECHECK_S = 0.001


@attrs.frozen
class TransferResults:
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


class _Wake:
    """An observer of the prefill rank's hooks: wakes the engine thread that
    waits out an idle step when a send kept for decode may have settled
    (a write's barrier returned; decode aborted a room). Timing only: what
    is reported is still what the rank says settled."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    @hookimpl(wrapper=True)
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Generator[None, Any, Any]:
        try:
            return (yield)
        finally:
            self.event.set()

    @hookimpl
    def on_abort_notification(self, abort: object, known: bool) -> None:
        self.event.set()


@attrs.define
class _Outgoing:
    send: Send
    #: None until decode's first request for the room: it says how many
    #: decode ranks will ask (their TP size), which the sender must know.
    sender: Sender | None
    deadline: float
    sent: bool = False
    given_up: bool = False


@attrs.define
class _Incoming:
    recv: Recv
    #: None while its prefill instance is being bootstrapped.
    receiver: Receiver | None
    #: Set once the receiver was aborted: the request ends only with on_release.
    giving_up: bool = False
    failed: bool = False


class WorkerSide:
    def __init__(
        self,
        settings: Settings,
        producer: bool,
        consumer: bool,
        geometry: KVGeometry,
        tp_size: int = 1,
        tp_rank: int = 0,
        clock: Any = time.monotonic,
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.consumer = consumer
        self.geometry = geometry
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.clock = clock
        self.backend: Backend = get_backend(settings.backend)
        if settings.config.tracing and settings.trace_file:
            trace_to_file(settings.trace_file)
        if settings.conformance:
            check_transport(settings.backend, settings.config.backend_options)
        self.buffers: list[Any] = []
        self.layout: KVLayout | None = None
        self.rank: PrefillRank | None = None
        #: Decode's one endpoint over the KV cache, for every prefill instance.
        self.decode: DecodeEndpoint | None = None
        self._lock = threading.Lock()
        # prefill
        self._outgoing: dict[int, _Outgoing] = {}
        self._early: OrderedDict[int, int] = OrderedDict()
        self._finished_reqs: set[str] = set()
        # decode
        self._incoming: dict[str, _Incoming] = {}
        self._by_room: dict[int, str] = {}
        self._released: list[Release] = []
        #: Prefill instances being bootstrapped off the engine thread, with
        #: the requests waiting on each; and the bootstraps that ended (None:
        #: ready), handed over from their threads.
        self._connecting: dict[tuple[str, ...], list[str]] = {}
        self._connected: dict[tuple[str, ...], BaseException | None] = {}
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        #: Decode blocks handed back to vLLM after an abort or failure, by proof.
        self.release_proofs: Counter[str] = Counter()
        #: What :meth:`stats` reports to vLLM's metrics (KVConnectorStats).
        self.reporter = Reporter(clock=clock)
        self._was_idle = True
        #: This step runs no request (KvconnMetadata.idle); and what wakes
        #: the engine thread waiting it out (kvconn's threads, _on_release).
        self._idle_step = False
        self._wake = threading.Event()

    # -- start-up ----------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any]) -> None:
        self.buffers, self.layout = engine_memory(kv_caches, self.geometry, self.tp_size, self.tp_rank)
        if self.producer:
            self.rank = PrefillRank(
                self.backend,
                self.tp_rank,
                config=self.settings.config,
                on_request=self._on_request,
                buffers=self.buffers,
                layout=self.layout,
            )
            if self.settings.idle_wait_s > 0:
                self.rank.pm.register(_Wake(self._wake), name="kvconn-vllm-wake")
            log.info("kvconn prefill rank %d listening at %s", self.tp_rank, self.rank.address)
        if self.consumer:
            self.decode = DecodeEndpoint(
                self.backend,
                config=self.settings.config,
                on_release=self._on_release,
                clock=self.clock,
                buffers=self.buffers,
                layout=self.layout,
            )

    @property
    def address(self) -> str:
        return "" if self.rank is None else self.rank.address

    # -- each step ---------------------------------------------------------
    def start(self, meta: KvconnMetadata) -> None:
        self._idle_step = meta.idle
        for send in meta.sends:
            self._start_send(send)
        aborted = set(meta.aborts)
        for recv in meta.recvs:
            if recv.req_id in aborted:
                # Finished before any prefill was told these blocks: free now.
                aborted.discard(recv.req_id)
                self._done_recving.add(recv.req_id)
            else:
                self._start_recv(recv)
        for req_id in aborted:
            self._abort(req_id)

    def results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        """What settled since the last step. In an idle step with transfers
        pending, waits up to ``idle_wait_s`` for one to settle first: vLLM
        would step again at once (it steps while a finished request keeps
        blocks, or one waits for its KV), a busy loop holding the GIL that
        kvconn's listener and transport threads need. The wait ends as soon
        as something settles, so no block is kept longer; a request arriving
        meanwhile waits for it (``idle_wait_s`` at most)."""
        out = self._collect(finished_req_ids)
        if out or not self._idle_step or self.settings.idle_wait_s <= 0 or not self.has_pending():
            return out
        until = time.monotonic() + self.settings.idle_wait_s
        timeout = self.settings.idle_wait_s
        while True:
            if self._incoming:
                timeout = min(timeout, DECODE_POLL_S)
            woke = self._wake.wait(timeout)
            self._wake.clear()
            out = self._collect(())
            left = until - time.monotonic()
            if out or left <= 0 or not self.has_pending():
                return out
            # A barrier wakes us just before the rank accounts for the write.
            timeout = min(left, RECHECK_S) if woke else left

    def _collect(self, finished_req_ids: Iterable[str]) -> TransferResults:
        sending = self._settled_sends(finished_req_ids) if self.rank is not None else set()
        self._poll_recvs()
        recving, failed = self._done_recving, self._failed_recving
        self._done_recving, self._failed_recving = set(), set()
        return TransferResults(frozenset(sending), frozenset(recving), frozenset(failed))

    def endpoints(self) -> list[tuple[str, Metrics]]:
        """This worker's endpoints' metrics, each by the name it has on
        ``/metrics`` (``kvconn_endpoint``): ``prefill-<tp rank>``, ``decode-<tp rank>``."""
        named = []
        if self.rank is not None:
            named.append((f"prefill-{self.tp_rank}", self.rank.metrics))
        if self.decode is not None:
            named.append((f"decode-{self.tp_rank}", self.decode.metrics))
        return named

    def stats(self) -> dict[str, Any] | None:
        """The report due for vLLM's KV connector stats, or None. vLLM asks
        after every step, and steps while a transfer is pending: the step that
        ends the last one reports at once, since an idle engine steps no more."""
        idle = not self.has_pending()
        last_step = idle and not self._was_idle
        self._was_idle = idle
        return self.reporter.take(self.endpoints(), now_due=last_step)

    def has_pending(self) -> bool:
        return bool(self._outgoing or self._incoming)

    def drain(self, grace_s: float) -> list[DrainReport]:
        """Take this worker out of service (kvconn's drain): its prefill rank
        refuses new rooms and gives those it holds ``grace_s`` to complete;
        its decode endpoint takes no new room, aborts the rooms left (at
        shutdown the engine finishes no more) and waits up to ``grace_s``
        for their proofs. Pages without proof stay held."""
        reports = []
        if self.rank is not None:
            reports.append(self.rank.drain(grace_s))
        if self.decode is not None:
            reports.append(self.decode.drain(0.0, timeout_s=grace_s))
        for report in reports:
            (log.info if report.drained else log.warning)("kvconn drain at shutdown: %s", report)
        return reports

    def close(self) -> None:
        """Drain (``drain_grace_s``), then close."""
        started = time.monotonic()
        try:
            self.drain(self.settings.drain_grace_s)
        finally:
            if self.decode is not None:
                self.decode.close()
            if self.rank is not None:
                self.rank.close()
            log.info("kvconn closed %.3f s after shutdown began", time.monotonic() - started)

    # -- prefill -----------------------------------------------------------
    def _start_send(self, send: Send) -> None:
        if self.rank is None:
            log.error("request %s: a send, but this worker runs no prefill rank", send.req_id)
            return
        outgoing = _Outgoing(send, None, self.clock() + self.settings.unrequested_timeout_s)
        with self._lock:
            self._outgoing[send.room] = outgoing
            npages = self._early.pop(send.room, None)
            if npages is not None:
                self._send(outgoing, npages)

    def _on_request(self, room: int, npages: int) -> None:
        """A decode rank asked for ``room`` (listener thread): send at once
        if the engine already finished it (and every decode rank asked),
        else remember until it does."""
        with self._lock:
            outgoing = self._outgoing.get(room)
            if outgoing is None:
                self._early[room] = npages
                while len(self._early) > MAX_EARLY_REQUESTS:
                    self._early.popitem(last=False)
                return
            self._send(outgoing, npages)

    def _send(self, outgoing: _Outgoing, npages: int) -> None:
        # with self._lock
        assert self.rank is not None
        if outgoing.sent or outgoing.given_up:
            return
        sender = outgoing.sender
        if sender is None:
            decodes = self.rank.requesting_tp(outgoing.send.room)
            if decodes is None:
                return  # the request is no longer here to take: its decode hears of it
            sender = outgoing.sender = self.rank.sender(outgoing.send.room, decodes)
        blocks, status = outgoing.send.block_ids, sender.poll()
        if status is KVPoll.BOOTSTRAPPING:
            return  # more decode ranks are to ask: the last one's request sends
        if npages > len(blocks) or status not in _SENDABLE:
            outgoing.given_up = True
            sender.fail(f"decode asked for {npages} blocks, prefill holds {len(blocks)}")
            return
        # A decode's local prefix-cache hit covers the first blocks: it asks
        # for the rest.
        try:
            sender.send(blocks[len(blocks) - npages :], last=True)
        except KvconnError as exc:
            outgoing.given_up = True
            sender.fail(f"send refused: {exc}")
            return
        outgoing.sent = True

    def _give_up(self, outgoing: _Outgoing, reason: str) -> None:
        """Nothing was written from these blocks: every decode asking from
        now on is told the room failed."""
        # with self._lock
        assert self.rank is not None
        outgoing.given_up = True
        if outgoing.sender is not None:
            outgoing.sender.fail(reason)
        else:
            self.rank.fail_room(outgoing.send.room, reason)

    def _settled_sends(self, finished_req_ids: Iterable[str]) -> set[str]:
        self._finished_reqs.update(finished_req_ids)
        now = self.clock()
        done: set[str] = set()
        with self._lock:
            for room, outgoing in list(self._outgoing.items()):
                sender = outgoing.sender
                if not outgoing.sent and not outgoing.given_up:
                    if now >= outgoing.deadline:
                        self._give_up(outgoing, "decode did not ask within unrequested_timeout_s")
                    elif sender is not None and sender.poll() is KVPoll.FAILED:
                        # kvconn gave it up (a draining rank takes no request now).
                        outgoing.given_up = True
                    elif sender is None and self.rank is not None and self.rank.draining:
                        self._give_up(outgoing, DRAIN_REFUSED)  # it refuses the request to come
                req_id = outgoing.send.req_id
                # vLLM takes a send as finished only for a request it reported finished.
                over = outgoing.sent or outgoing.given_up
                if over and req_id in self._finished_reqs and (sender is None or sender.settled()):
                    # A failed room's decode asking late is told Failed by the
                    # rank (for its tombstone TTL), cleared sender or not.
                    if sender is not None:
                        sender.clear()
                    del self._outgoing[room]
                    self._finished_reqs.discard(req_id)
                    done.add(req_id)
        return done

    # -- decode ------------------------------------------------------------
    def _start_recv(self, recv: Recv) -> None:
        if self.decode is None:
            self._cannot_receive(recv.req_id, "this worker runs no decode endpoint")
            return
        if recv.room in self._by_room:
            # Two live requests with one room (a 63-bit hash collision):
            # releases name rooms, so this one must not start.
            self._cannot_receive(
                recv.req_id, f"room {recv.room} is in use by request {self._by_room[recv.room]}"
            )
            return
        self._incoming[recv.req_id] = _Incoming(recv, None)
        self._by_room[recv.room] = recv.req_id
        if recv.prefill in self._connecting:
            self._connecting[recv.prefill].append(recv.req_id)
        elif recv.prefill in self.decode.instances():
            self._open(recv.req_id)
        else:
            # A new prefill instance: its bootstrap may take up to
            # bootstrap_timeout_s (an unreachable instance takes all of it),
            # so it runs on its own thread, never on the engine's.
            self._connecting[recv.prefill] = [recv.req_id]
            threading.Thread(
                target=self._connect, args=(self.decode, recv.prefill), name="kvconn-connect", daemon=True
            ).start()

    def _connect(self, decode: DecodeEndpoint, prefill: tuple[str, ...]) -> None:
        outcome: BaseException | None = None
        try:
            decode.connect(prefill)
        except Exception as exc:  # whatever ended it, the requests waiting on it must hear
            outcome = exc
        with self._lock:
            self._connected[prefill] = outcome

    def _take_connected(self) -> None:
        """Start the requests whose prefill instance finished bootstrapping."""
        with self._lock:
            connected, self._connected = self._connected, {}
        for prefill, outcome in connected.items():
            for req_id in self._connecting.pop(prefill, []):
                if outcome is None:
                    self._open(req_id)
                else:
                    self._forget(req_id)
                    self._cannot_receive(req_id, f"prefill {list(prefill)} did not bootstrap: {outcome}")

    def _open(self, req_id: str) -> None:
        assert self.decode is not None
        recv = self._incoming[req_id].recv
        try:
            receiver = self.decode.receiver(recv.room, recv.block_ids, prefill=recv.prefill)
        except Exception as exc:
            self._forget(req_id)
            self._cannot_receive(req_id, str(exc))
            return
        self._incoming[req_id].receiver = receiver

    def _cannot_receive(self, req_id: str, reason: str) -> None:
        # No prefill rank was told these blocks: nothing can write them.
        log.warning("request %s: kvconn cannot receive (%s); it will be recomputed", req_id, reason)
        self._done_recving.add(req_id)
        self._failed_recving.add(req_id)

    def _on_release(self, release: Release) -> None:
        # kvconn's thread (or ours, inside abort()): hand it to the engine thread.
        with self._lock:
            self._released.append(release)
        self._wake.set()

    def _abort(self, req_id: str) -> None:
        incoming = self._incoming.get(req_id)
        if incoming is None or incoming.giving_up:
            return  # reported already, or already aborting
        if incoming.receiver is None:
            # Still waiting for its instance's bootstrap: no prefill was told
            # these blocks, so they are free now.
            self._connecting[incoming.recv.prefill].remove(req_id)
            self._forget(req_id)
            self._done_recving.add(req_id)
            return
        incoming.giving_up = True
        incoming.receiver.abort()

    def _poll_recvs(self) -> None:
        self._take_connected()
        for req_id, incoming in list(self._incoming.items()):
            if incoming.giving_up or incoming.receiver is None:
                continue
            status = incoming.receiver.poll()
            if status is KVPoll.SUCCESS:
                incoming.receiver.finish()
                self._forget(req_id)
                self._done_recving.add(req_id)
                continue
            if status is not KVPoll.FAILED:
                continue
            # A writer failed it, its rank is down, or kvconn's transfer
            # deadline passed: kvconn aborted it already (abort() below is
            # for a FAILED it did not abort, and harmless otherwise).
            reason = incoming.receiver.failure() or "transfer failed"
            log.warning(
                "request %s: %s; its blocks come back with proof, then it is recomputed", req_id, reason
            )
            incoming.giving_up = True
            incoming.failed = True
            incoming.receiver.abort()
        with self._lock:
            released, self._released = self._released, []
        for release in released:
            self.release_proofs[release.proof.value] += 1
            released_req = self._by_room.get(release.room)
            if released_req is None:
                continue
            incoming = self._incoming[released_req]
            self._forget(released_req)
            self._done_recving.add(released_req)
            # A release not asked for (kvconn failed the room and had the
            # proof at once: its rank drained) is a failure too.
            if incoming.failed or not incoming.giving_up:
                self._failed_recving.add(released_req)

    def _forget(self, req_id: str) -> None:
        incoming = self._incoming.pop(req_id)
        self._by_room.pop(incoming.recv.room, None)

    # -- what tests and operators read -------------------------------------
    def held_requests(self) -> dict[str, str]:
        """Aborted or failed decode requests whose blocks await proof, with
        their hold state ("held" or "quarantined")."""
        held = {}
        for req_id, incoming in self._incoming.items():
            if incoming.giving_up and incoming.receiver is not None:
                state = incoming.receiver.state()
                held[req_id] = "released" if state is None else state.value
        return held
