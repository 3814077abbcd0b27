"""The decode endpoint: the page owner. It bootstraps prefill ranks, asks them
for rooms, aborts rooms, and hands pages back to the engine only with proof.

An I/O shell: every decision is :class:`~kvconn.protocol.endpoint.EndpointState`'s
(and its :class:`~kvconn.protocol.hold.HoldTracker`'s). This module keeps the
threads, sockets, ``/proc`` probes, metrics and ``on_release`` calls, and
carries out what the state machine returns.

ABORT_ACKs arrive on kvconn's own listener socket and thread, never through
transport notifications (those may only progress inside an active poll).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvconn.config import Config
from kvconn.errors import (
    ArgumentError,
    BootstrapError,
    KvconnError,
    PageInUseError,
    RequestError,
    RoomInUseError,
    UnavailableError,
)
from kvconn.layout import KVLayout, checked_buffers
from kvconn.metrics import Exported, Metrics, export
from kvconn.protocol.drain import DrainingError, DrainReport
from kvconn.protocol.drops import DropReason
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import (
    Action,
    AwaitAnswers,
    Bootstrapped,
    BootstrapTick,
    ExitsProbed,
    GiveUp,
    Instance,
    LinksChanged,
    Request,
    Send,
    Tick,
)
from kvconn.protocol.endpoint_events import WriterIdentity as WriterIdentityBase
from kvconn.protocol.hold import HoldTracker, Proof, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.liveness import link_heartbeat
from kvconn.protocol.messages import AbortAck, Hello, Message, TcpConnection
from kvconn.protocol.owner_fence import OwnerFencePolicy
from kvconn.protocol.write_deadline import check_writer_deadline
from kvconn.runtime.control import Listener, Outbox
from kvconn.runtime.decode_actions import Carrier, gauge_hold_state
from kvconn.runtime.procs import WriterIdentity, pid_namespace, proven_gone
from kvconn.runtime.receiver import Receiver
from kvconn.runtime.sockets import TcpTable, dead_peer_ends
from kvconn.runtime.tracing import decode_tracer
from kvconn.transport import Backend, PageRegion, capabilities_of, owner_fence, register_region

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Called once per released room, outside kvconn's locks: the engine's
#: allocator may hand these pages out again.
ReleaseCallback = Callable[[Release], None]


#: ``kvconn_requests_refused_total``'s reason for each refusal of ``receiver()``.
_REFUSALS: tuple[tuple[type[KvconnError], str], ...] = (
    (UnavailableError, "rank_down"),
    (DrainingError, "draining"),
    (PageInUseError, "pages_in_use"),
    (RoomInUseError, "room_in_use"),
    (BootstrapError, "bootstrap"),
)

#: Regions of closed endpoints that still had pages held: kept for the life
#: of the process (see DecodeEndpoint.close).
_UNFREED_REGIONS: list[PageRegion] = []


class DecodeEndpoint:
    """One decode process's kvconn endpoint over ``num_pages`` pages: either
    the engine's own KV buffers (``buffers``, laid out as ``layout`` says: a
    :class:`~kvconn.layout.KVLayout` whose ``tp_rank`` is this decode rank's),
    or ``num_pages`` of ``page_bytes`` that kvconn allocates, each split
    evenly over the prefill ranks."""

    EXIT_CHECK_S = EndpointState.EXIT_CHECK_S
    DRAIN_CHECK_S = 0.005
    MAX_DRAINING = EndpointState.MAX_DRAINING

    def __init__(
        self,
        backend: Backend,
        num_pages: int | None = None,
        page_bytes: int | None = None,
        prefill: Sequence[str] = (),
        config: Config | None = None,
        on_release: ReleaseCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        buffers: Sequence[object] | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        engine_buffers = None
        if (buffers is None) != (layout is None):
            raise ArgumentError("buffers= and layout= go together")
        if layout is not None and buffers is not None:
            if num_pages is not None or page_bytes is not None:
                raise ArgumentError(
                    "give a decode endpoint either num_pages and page_bytes, or buffers= and layout="
                )
            engine_buffers = checked_buffers(buffers, layout)
            num_pages, page_bytes = layout.num_pages, 0
        elif num_pages is None or page_bytes is None:
            raise ArgumentError("a decode endpoint needs num_pages and page_bytes, or buffers= and layout=")
        self.layout = layout
        self.config = config or Config()
        self.config.apply_to_process()
        caps = capabilities_of(backend, self.config.backend_options)
        if caps.max_write_timeout_s is not None:
            what = f"{backend.name}'s write timeout (the longest it may take to fail a write)"
            check_writer_deadline(caps.max_write_timeout_s, self.config.abort_timeout_s, what)
        self.backend = backend
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.clock = clock
        #: Where a writer's pid can be checked here ("": nowhere; see proven_gone).
        self._pid_namespace = pid_namespace()
        #: The dead peers' ends the exit proof last waited on (logged once each).
        self._ends_waited: frozenset[TcpConnection] = frozenset()
        self.on_release = on_release
        self.name = f"decode-{uuid.uuid4().hex[:12]}"
        self.metrics = Metrics("decode")
        self.region: PageRegion
        if engine_buffers is not None:
            self.region = register_region(backend, engine_buffers, self.config.backend_options)
        else:
            self.region = backend.open_region(num_pages * page_bytes, self.config.backend_options)
        self._lock = threading.Lock()
        # Every link to a rank runs ZMTP's heartbeat, answered by the rank's
        # I/O thread: liveness tells a slow rank from a gone one by it.
        link = link_heartbeat(self.config.heartbeat_interval_s, self.config.peer_timeout_s)
        self._outbox = Outbox(
            self.config.auth_key,
            self._count_drop,
            stalled_after_s=2 * self.config.peer_timeout_s,
            heartbeat=link,
            watch=True,
        )
        #: Requests are numbered and sent under one lock: a rank takes only a
        #: request numbered above the last it took.
        self._request_lock = threading.Lock()
        #: One bootstrap at a time per instance; instances in parallel, so
        #: an unreachable one does not hold up the others.
        self._bootstrap_locks: dict[tuple[str, ...], threading.Lock] = {}
        self._bootstrapped = threading.Condition(self._lock)
        self._listener = Listener(
            self.name,
            self.config.host,
            self.config.port,
            self._on_message,
            self._count_drop,
            self.config.auth_key,
            idle=self._on_idle,
            links=self._outbox,
            on_links=self._on_links,
        )
        self.address = self._listener.address
        tracker = HoldTracker(
            self.name,
            self.address,
            self.config.abort_timeout_s,
            self.config.resend_interval_s,
            unsafe_release_at_deadline=self.config.unsafe_release_at_deadline,
        )
        self._state = EndpointState(
            self.name,
            tracker,
            num_pages=num_pages,
            num_slots=0 if layout is None else layout.num_slots,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            peer_timeout_s=self.config.peer_timeout_s,
            peer_hung_timeout_s=self.config.peer_hung_timeout_s,
            transfer_timeout_s=self.config.transfer_timeout_s,
            check_pages=self.config.check_pages,
            owner_fence=OwnerFencePolicy(
                self.config.owner_fence_after_s, self.config.owner_fence_min_interval_s, caps.owner_fence
            ),
        )
        if self.config.owner_fence_after_s is not None and not caps.owner_fence:
            log.warning("%s cannot fence as the page owner: quarantined pages wait for proof", backend.name)
        self._state.EXIT_CHECK_S, self._state.MAX_DRAINING = self.EXIT_CHECK_S, self.MAX_DRAINING
        self._tracer = decode_tracer(self.config.tracing)
        self._carrier = Carrier(
            self._state,
            self._outbox,
            self.metrics,
            self._bootstrapped,
            self._count_drop,
            owner_fence=lambda: owner_fence(self.region),
            tracer=self._tracer,
            clock=self.clock,
        )
        gauge_hold_state(self.metrics, self._state, self._lock, self.clock)
        self.metrics_server: Exported | None = None
        if self.config.metrics_port is not None:
            try:
                self.metrics_server = export(
                    self.metrics, "decode", self.config.metrics_port, self.config.host
                )
            except BaseException:
                self._listener.close()
                self._outbox.close()
                raise
        self._listener.start()
        if prefill:
            try:
                self._state.default = self._instance(prefill)
            except BaseException:
                self.close()
                raise

    @property
    def tracker(self) -> HoldTracker:
        """The hold tracker: which rooms' pages are held, and their proofs."""
        return self._state.tracker

    @property
    def ranks(self) -> frozenset[int]:
        """The ranks of the prefill instance given at construction (none if
        none was: every request then names its instance)."""
        default = self._state.default
        return frozenset(default.ids) if default is not None else frozenset()

    def session_of(self, rank: int, prefill: Sequence[str] | None = None) -> int:
        """The session of the rank process this endpoint bootstrapped with
        (rank ``rank`` of instance ``prefill``, by default the one given at
        construction): acks and statuses that name another are dropped."""
        with self._lock:
            return self._state.session_of(rank, prefill)

    def instances(self) -> list[tuple[str, ...]]:
        """The prefill instances bootstrapped so far, by their ranks' addresses."""
        with self._lock:
            return list(self._state.instances)

    def unavailable(self, prefill: Sequence[str]) -> list[str]:
        """Why prefill instance ``prefill`` could not serve a request now
        (empty: it could, or it is new here): a rank down, or one whose
        control link is lost. An engine that keeps where an instance's ranks
        listen (SGLang reads it from the instance's bootstrap server) reads
        it again on this: a restarted instance may listen elsewhere."""
        with self._lock:
            return self._state.unavailable(prefill)

    def connect(self, prefill: Sequence[str]) -> None:
        """Bootstrap prefill instance ``prefill`` now if it is new (blocking,
        within ``Config.bootstrap_timeout_s``; raises what ``receiver()``
        raises for a new instance), so that the first ``receiver()`` naming
        it does not wait: an engine calls this off its step thread. Known
        instances return at once."""
        self._instance(prefill)

    # -- engine API --------------------------------------------------------
    def receiver(
        self,
        room: int,
        pages: Sequence[int],
        ranks: frozenset[int] | None = None,
        extras_slot: int | None = None,
        prefill: Sequence[str] | None = None,
    ) -> Receiver:
        """Ask every rank (or ``ranks``) of prefill instance ``prefill`` (its
        ranks' control addresses, in rank order; by default the instance
        given at construction) to write ``room`` into ``pages``, and its
        per-room extras into slot ``extras_slot`` of the layout's extras
        (with the room's last chunk, covered by the same acks and proofs).

        An instance not seen before is bootstrapped first (Hello, re-sent
        until answered, within ``Config.bootstrap_timeout_s``: this call
        blocks meanwhile, and raises :class:`~kvconn.errors.BootstrapError`
        as the constructor does), then kept: heartbeats, restarts and exit
        proofs as for every rank. Room ids are unique per endpoint, across
        instances.

        Refused (nothing sent, nothing tracked, no page marked in use) with
        :class:`~kvconn.errors.PageError` for pages out of range or
        duplicated, :class:`~kvconn.errors.PageInUseError` (``Config.check_pages``)
        for pages still in use by another room (the engine freed them
        before ``on_release``: counted, logged as an error, alerted on),
        with :class:`~kvconn.errors.RoomInUseError` while ``room`` itself
        is still tracked, with :class:`~kvconn.errors.UnavailableError` while
        a rank it would ask is down or this endpoint has no transport
        endpoint (such a room could only fail: fail it, route it elsewhere
        or recompute it), and with :class:`~kvconn.errors.RequestError` (a
        ValueError) for no instance, unknown or no ranks, or an extras slot
        outside the layout. Every refusal is counted in
        ``kvconn_requests_refused_total{reason}``."""
        try:
            if prefill is None:
                instance = self._state.default
                if instance is None:
                    raise RequestError("no prefill instance: name its ranks' addresses (prefill=)", room)
            else:
                instance = self._instance(prefill)
        except KvconnError as exc:
            self._refused(exc)
            raise
        with self._request_lock, self._lock:
            now = self.clock()
            try:
                request, sends = self._state.open(room, pages, instance, ranks, extras_slot, now)
            except KvconnError as exc:
                self._refused(exc)
                raise
            self._tracer.opened(room, len(request.pages), sorted(request.writers), self.name)
            outgoing = self._tracer.outgoing
            unsent = [s.rank for s in sends if not self._outbox.send(s.address, outgoing(s.message))]
            releases = self._carrier.run(
                self._state.sent(request, [r for r in unsent if r is not None], now), now
            )
        self._notify(releases)
        return Receiver(self, request, self._tracer)

    #: How often drain() looks whether every page came back.
    DRAIN_POLL_S = 0.005

    def drain(self, grace_s: float, timeout_s: float | None = None) -> DrainReport:
        """Take this endpoint out of service before :meth:`close`.

        From now on ``receiver()`` raises
        :class:`~kvconn.protocol.drain.DrainingError`. The engine gets
        ``grace_s`` to finish (or abort) its rooms; those still tracked then
        are aborted (reason ``kvconn.protocol.drain.DECODE_DRAINING``), and
        their pages come back through ``on_release`` with proof, within
        ``timeout_s`` more (default: ``Config.abort_timeout_s``). A report
        with ``drained`` False says what is left: those pages stay held (and
        the region registered, see :meth:`close`), never freed on a timeout.
        When to abort and when to report are ``EndpointState``'s
        (protocol/drain.py); this only waits (in real time, whatever
        ``clock`` the endpoint's timers run on)."""
        settle_s = self.config.abort_timeout_s if timeout_s is None else timeout_s
        self.step(lambda state, now: (None, state.begin_drain(now, grace_s, settle_s, time.monotonic())))
        while (report := self.step(lambda state, now: state.drain_tick(now, time.monotonic()))) is None:
            time.sleep(self.DRAIN_POLL_S)
        return report

    def close(self) -> None:
        """Stop listening. The page region is freed only if no page is held
        or quarantined: a writer may still reach those, and memory freed
        under it could be this process's next allocation."""
        if self.metrics_server is not None:
            self.metrics_server.close()
        self._listener.close()
        self._outbox.close()
        with self._lock:
            self._tracer.close()
        held = self.held_pages()
        if held:
            log.warning("decode closed with %d pages held or quarantined: their region stays allocated", held)
            _UNFREED_REGIONS.append(self.region)
        else:
            self.region.close()

    def held_pages(self) -> int:
        with self._lock:
            return self._state.held_pages()

    # -- bootstrap ---------------------------------------------------------
    def _instance(self, addresses: Sequence[str]) -> Instance:
        """The prefill instance at ``addresses``, bootstrapped now if it is new."""
        key = tuple(addresses)
        with self._lock:
            known = self._state.instances.get(key)
            if known is not None:
                return known
            # Two engine threads meeting a new instance at once bootstrap it once.
            bootstrap_lock = self._bootstrap_locks.setdefault(key, threading.Lock())
        with bootstrap_lock:
            with self._lock:
                known = self._state.instances.get(key)
                if known is not None:
                    return known
                hello = Hello(
                    self._state.name,  # its own since the last owner fence
                    self.address,
                    self.backend.name,
                    self.page_bytes,
                    len(key),
                    round(self.config.abort_timeout_s * 1000),
                    self.region.metadata,
                    b"" if self.layout is None else self.layout.to_bytes(),
                )
                timeout_s, every_s = self.config.bootstrap_timeout_s, self.config.resend_interval_s
                instance = self._state.begin_bootstrap(
                    key, hello, time.monotonic(), timeout_s=timeout_s, resend_interval_s=every_s
                )
            try:
                self._bootstrap(instance)
            finally:
                with self._lock:
                    self._state.forget_bootstrap(instance)
        return instance

    def _bootstrap(self, instance: Instance) -> None:
        """Wait out ``instance``'s bootstrap: its Hellos, re-sends and
        deadline are ``EndpointState``'s (protocol/bootstrap.py). It blocks
        an engine call: its schedule runs in real time, whatever ``clock``
        the endpoint's timers run on."""
        with self._bootstrapped:
            while True:
                now, at = self.clock(), time.monotonic()
                actions = self._state.handle(BootstrapTick(instance, at), now)
                self._carrier.run([a for a in actions if isinstance(a, Send)], now)
                end = actions[-1]
                if isinstance(end, GiveUp):
                    raise end.error
                if isinstance(end, Bootstrapped):
                    for rank in end.instance.ids:
                        self.metrics.known_rank(rank, self._state.writers[rank].address)
                    return
                assert isinstance(end, AwaitAnswers)
                self._bootstrapped.wait(max(0.0, end.until - at))

    # -- control plane -----------------------------------------------------
    def step(self, call: Callable[[EndpointState, float], tuple[T, Sequence[Action]]]) -> T:
        """Run ``call(state, now)`` under the endpoint's lock and carry out
        the actions it returns (``on_release`` after the lock): how a
        :class:`Receiver` asks the state machine."""
        with self._lock:
            now = self.clock()
            result, actions = call(self._state, now)
            releases = self._carrier.run(actions, now)
        self._notify(releases)
        return result

    def poll(self, request: Request) -> KVPoll:
        """``request``'s status (:meth:`Receiver.poll`): not through
        :meth:`step`, as an engine polls every request every step, and
        reading a verdict carries nothing out."""
        with self._lock:
            return request.poll()

    def _on_message(self, msg: Message) -> None:
        self.metrics.count_message(type(msg))
        now = self.clock()
        with self._lock:
            actions = self._state.handle(msg, now)
            self._tracer.received(msg, actions)
            releases = self._carrier.run(actions, now)
        self._notify(releases)

    def _on_links(self, changes: list[tuple[str, bool]]) -> None:
        now = self.clock()
        with self._lock:
            releases = self._carrier.run(self._state.handle(LinksChanged(tuple(changes)), now), now)
        self._notify(releases)

    def _on_idle(self) -> float | None:
        now = self.clock()
        with self._lock:
            due = self._state.next_wakeup()
            if (due is None or now < due) and not self._state.draining:
                # Nothing is due: no /proc probe, no tick (this runs after
                # every batch of messages). An engine thread's abort or
                # request may bring a deadline forward: looked at again
                # within EXIT_CHECK_S.
                return self.EXIT_CHECK_S if due is None else min(due - now, self.EXIT_CHECK_S)
            probes = self._state.probes(now)
            drained: tuple[AbortAck, ...] = ()
            if probes.acks:
                table = TcpTable()  # one reading of /proc for every held-back ack
                drained = tuple(ack for ack in probes.acks if not table.undrained(ack.closed))
            gone = frozenset(w for w in probes.owed | probes.live if self._gone(w))
            peers_drained = self._peers_drained(gone & probes.owed)
            releases = self._carrier.run(self._state.handle(Tick(gone, peers_drained, drained), now), now)
            next_deadline = self._state.next_wakeup()
            draining = bool(self._state.draining)
        self._notify(releases)
        wait = (
            self.EXIT_CHECK_S
            if next_deadline is None
            else min(max(0.0, next_deadline - now), self.EXIT_CHECK_S)
        )
        if draining:
            wait = min(wait, self.DRAIN_CHECK_S)
        return wait

    def _check_exits(self) -> None:
        """One exit check now, outside the idle loop's schedule."""
        now = self.clock()
        with self._lock:
            gone = frozenset(w for w in self._state.owed() if self._gone(w))
            event = ExitsProbed(gone, self._peers_drained(gone))
            releases = self._carrier.run(self._state.handle(event, now), now)
        self._notify(releases)

    def _gone(self, writer: WriterIdentityBase) -> bool:
        return proven_gone(writer, self._pid_namespace)

    def _peers_drained(self, gone: frozenset[WriterIdentityBase]) -> bool:
        """No end of ours still holds bytes a dead peer sent (lock held): a
        dead writer's kernel goes on delivering what it had sent, so the
        exit of ``gone`` (writers held rooms owe a proof) proves nothing
        until then. Each new set of ends waited on is logged: pages held by
        an end that nothing here ever reads would otherwise wait unexplained."""
        if not gone:
            return True
        ends = dead_peer_ends()
        seen = frozenset(ends)
        if ends and seen != self._ends_waited:
            log.warning(
                "writer exit proven (pids %s): its rooms' pages wait for %d connection ends whose "
                "peer is gone to be read (%s)",
                ", ".join(str(w.pid) for w in sorted(gone, key=lambda w: w.pid)),
                len(ends),
                ", ".join(
                    f"{c.local_host}:{c.local_port} from {c.remote_host}:{c.remote_port}" for c in ends
                ),
            )
        self._ends_waited = seen
        return not ends

    def _notify(self, releases: list[Release]) -> None:
        if self.on_release is None:
            return
        for release in releases:
            try:
                self.on_release(release)
            except Exception:
                log.exception("on_release callback raised for room %d", release.room)

    def _refused(self, exc: KvconnError) -> None:
        """Count a request ``receiver()`` refused (asking nothing), by why."""
        reason = "invalid"
        for kind, why in _REFUSALS:
            if isinstance(exc, kind):
                reason = exc.cause if isinstance(exc, UnavailableError) else why
                break
        self.metrics.requests_refused.labels(reason).inc()
        if reason == "pages_in_use":
            # kvconn still guards them: the engine's allocator freed them early.
            log.error("the engine reused pages kvconn has not released: %s", exc)

    def _count_drop(self, reason: DropReason) -> None:
        self.metrics.dropped.labels(reason).inc()


__all__ = [
    "BootstrapError",
    "DecodeEndpoint",
    "DrainReport",
    "Proof",
    "Receiver",
    "Release",
    "WriterIdentity",
]
