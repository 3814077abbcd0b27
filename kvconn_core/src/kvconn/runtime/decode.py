"""The decode endpoint: the page owner. It bootstraps prefill ranks, asks them
for rooms, aborts rooms, and hands pages back to the engine only with proof.

ABORT_ACKs arrive on kvconn's own listener socket and thread, never through
transport notifications (those may only progress inside an active poll).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import attrs

from kvconn.config import Config
from kvconn.layout import KVLayout, checked_buffers
from kvconn.metrics import Metrics
from kvconn.protocol.hold import (
    Dropped,
    HoldAction,
    HoldState,
    HoldTracker,
    Proof,
    Quarantine,
    Release,
    SendAbort,
)
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import (
    AbortAck,
    Hello,
    HelloAck,
    Message,
    RoomOutcome,
    RoomStatus,
    TransferRequest,
)
from kvconn.runtime.control import Listener, Outbox
from kvconn.runtime.procs import pid_namespace, proc_stat
from kvconn.runtime.sockets import TcpTable, dead_peer_ends, undrained
from kvconn.transport import Backend, PageRegion, capabilities_of, register_region

log = logging.getLogger(__name__)

#: Called once per released room, outside kvconn's locks: the engine's
#: allocator may hand these pages out again.
ReleaseCallback = Callable[[Release], None]


#: Regions of closed endpoints that still had pages held: kept for the life
#: of the process (see DecodeEndpoint.close).
_UNFREED_REGIONS: list[PageRegion] = []


class BootstrapError(RuntimeError):
    pass


@attrs.frozen
class WriterIdentity:
    """A prefill rank's process, as it announced itself."""

    address: str
    pid_namespace: str  #: :func:`~kvconn.runtime.procs.pid_namespace` of the writer
    pid: int
    start_time: int
    session: int  #: the rank's control session: every request names it

    @classmethod
    def announced(cls, msg: HelloAck) -> WriterIdentity:
        """The identity a HelloAck announces, with its pid check kept only if
        this process sees that pid in ``/proc`` as announced (pid and start
        time): ``/proc`` mounted hidepid=2, or another namespace after all,
        would make a live writer's pid look free."""
        try:
            seen = proc_stat(msg.pid)[1] == msg.start_time
        except (OSError, ValueError, IndexError):
            seen = False
        namespace = msg.pid_namespace if seen else ""
        return cls(msg.address, namespace, msg.pid, msg.start_time, msg.session)

    def proven_gone(self, local_pid_namespace: str) -> bool:
        """True only when this very process certainly no longer runs: its pids
        are ours (same kernel boot, same pid namespace, and neither unknown),
        and its pid is free, reused by another process, or a zombie."""
        if not local_pid_namespace or self.pid_namespace != local_pid_namespace:
            return False  # elsewhere only a closed transport connection proves it
        try:
            state, start_time = proc_stat(self.pid)
        except FileNotFoundError:
            return True
        except (OSError, ValueError, IndexError):
            return False
        return start_time != self.start_time or state in ("Z", "X")


class DecodeEndpoint:
    """One decode process's kvconn endpoint over ``num_pages`` pages: either
    the engine's own KV buffers (``buffers``, laid out as ``layout`` says: a
    :class:`~kvconn.layout.KVLayout` whose ``tp_rank`` is this decode rank's),
    or ``num_pages`` of ``page_bytes`` that kvconn allocates, each split
    evenly over the prefill ranks."""

    EXIT_CHECK_S = 0.05
    DRAIN_CHECK_S = 0.005
    MAX_DRAINING = 4096

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
            raise ValueError("buffers= and layout= go together")
        if layout is not None and buffers is not None:
            if num_pages is not None or page_bytes is not None:
                raise ValueError(
                    "give a decode endpoint either num_pages and page_bytes, or buffers= and layout="
                )
            engine_buffers = checked_buffers(buffers, layout)
            num_pages, page_bytes = layout.num_pages, 0
        elif num_pages is None or page_bytes is None:
            raise ValueError("a decode endpoint needs num_pages and page_bytes, or buffers= and layout=")
        self.layout = layout
        if not prefill:
            raise ValueError("a decode endpoint needs at least one prefill rank address")
        self.config = config or Config()
        self.config.apply_to_process()
        limit = capabilities_of(backend, self.config.backend_options).max_write_timeout_s
        if limit is not None and limit >= self.config.abort_timeout_s:
            raise ValueError(
                f"{backend.name} may take {limit} s to fail a write; abort_timeout_s "
                f"({self.config.abort_timeout_s} s) must be longer"
            )
        self.backend = backend
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.clock = clock
        #: Where a writer's pid can be checked here ("": nowhere; see proven_gone).
        self._pid_namespace = pid_namespace()
        self.on_release = on_release
        self.name = f"decode-{uuid.uuid4().hex[:12]}"
        self.metrics = Metrics("decode")
        self.region: PageRegion
        if engine_buffers is not None:
            self.region = register_region(backend, engine_buffers, self.config.backend_options)
        else:
            self.region = backend.open_region(num_pages * page_bytes, self.config.backend_options)
        self._lock = threading.Lock()
        self._outbox = Outbox(self.config.auth_key, self._count_drop)
        self._request_lock = threading.Lock()
        self._request_seq = 0
        self._writers: dict[int, WriterIdentity] = {}
        #: The ranks, fixed once bootstrap is over: a later HelloAck adds none.
        self._ranks: frozenset[int] = frozenset()
        self._refusals: dict[str, str] = {}
        self._bootstrapped = threading.Condition(self._lock)
        self._succeeded: set[int] = set()
        self._failed: dict[int, str] = {}
        self._next_exit_check = 0.0
        #: Fenced acks held back until decode's ends of the connections the
        #: fence closed have drained (see runtime/sockets.py).
        self._draining: dict[tuple[int, int, int], AbortAck] = {}
        self._addresses: frozenset[str] = frozenset()
        self._listener = Listener(
            self.name,
            self.config.host,
            self.config.port,
            self._on_message,
            self._count_drop,
            self.config.auth_key,
            idle=self._on_idle,
        )
        self.address = self._listener.address
        self.tracker = HoldTracker(
            self.name,
            self.address,
            self.config.abort_timeout_s,
            self.config.resend_interval_s,
            unsafe_release_at_deadline=self.config.unsafe_release_at_deadline,
        )
        self._gauge_hold_state()
        self._listener.start()
        try:
            self._bootstrap(list(prefill))
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> frozenset[int]:
        return self._ranks

    def session_of(self, rank: int) -> int:
        """The session of the rank process this endpoint bootstrapped with:
        acks and statuses that name another are dropped."""
        with self._lock:
            return self._writers[rank].session

    # -- engine API --------------------------------------------------------
    def receiver(
        self,
        room: int,
        pages: Sequence[int],
        ranks: frozenset[int] | None = None,
        extras_slot: int | None = None,
    ) -> Receiver:
        """Ask every rank (or ``ranks``) to write ``room`` into ``pages``, and
        its per-room extras into slot ``extras_slot`` of the layout's extras
        (with the room's last chunk, covered by the same acks and proofs)."""
        ranks = self.ranks if ranks is None else ranks
        if extras_slot is not None and not (
            self.layout is not None and 0 <= extras_slot < self.layout.num_slots
        ):
            slots = 0 if self.layout is None else self.layout.num_slots
            raise ValueError(f"extras slot {extras_slot} outside the layout's {slots} slots")
        if not ranks <= self.ranks:
            raise ValueError(f"unknown ranks {sorted(ranks - self.ranks)}")
        pages = tuple(pages)
        if any(not 0 <= p < self.num_pages for p in pages):
            raise ValueError(f"pages outside 0..{self.num_pages - 1}")
        with self._lock:
            self.tracker.open(room, pages, ranks)
            self._succeeded.discard(room)
            self._failed.pop(room, None)
        # Numbered and sent under one lock: a rank takes only a request numbered
        # above the last it took, so two engine threads' requests must not
        # overtake each other between numbering and sending.
        with self._request_lock:
            unsent = []
            for rank in sorted(ranks):
                writer = self._writers[rank]
                self._request_seq += 1
                request = TransferRequest(
                    room, self.name, pages, writer.session, self._request_seq, _slot_field(extras_slot)
                )
                if not self._outbox.send(writer.address, request):
                    unsent.append(rank)
        if unsent:
            # Nothing re-sends a request, and a room not yet aborted has no
            # deadline: say Failed now, so the engine aborts it (the ranks
            # that did get it ack as ever).
            with self._lock:
                self._failed.setdefault(room, f"request to ranks {unsent} dropped: send queue full")
        return Receiver(self, room)

    def close(self) -> None:
        """Stop listening. The page region is freed only if no page is held
        or quarantined: a writer may still reach those, and memory freed
        under it could be this process's next allocation."""
        self._listener.close()
        self._outbox.close()
        held = self.held_pages()
        if held:
            log.warning("decode closed with %d pages held or quarantined: their region stays allocated", held)
            _UNFREED_REGIONS.append(self.region)
        else:
            self.region.close()

    def held_pages(self) -> int:
        with self._lock:
            return self.tracker.pages_in(HoldState.HELD) + self.tracker.pages_in(HoldState.QUARANTINED)

    # -- bootstrap ---------------------------------------------------------
    def _bootstrap(self, addresses: list[str]) -> None:
        hello = Hello(
            self.name,
            self.address,
            self.backend.name,
            self.page_bytes,
            len(addresses),
            round(self.config.abort_timeout_s * 1000),
            self.region.metadata,
            b"" if self.layout is None else self.layout.to_bytes(),
        )
        self._addresses = frozenset(addresses)
        for address in addresses:
            self._outbox.send(address, hello)
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        with self._bootstrapped:
            while len(self._writers) + len(self._refusals) < len(addresses):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BootstrapError(
                        f"{len(self._writers)} of {len(addresses)} prefill ranks answered within "
                        f"{self.config.bootstrap_timeout_s} s"
                    )
                self._bootstrapped.wait(left)
            if self._refusals:
                raise BootstrapError("; ".join(f"{a}: {e}" for a, e in self._refusals.items()))
            if sorted(self._writers) != list(range(len(addresses))):
                raise BootstrapError(
                    f"ranks {sorted(self._writers)} answered, expected 0..{len(addresses) - 1}"
                )
            self._ranks = frozenset(self._writers)

    # -- control plane -----------------------------------------------------
    def _on_message(self, msg: Message) -> None:
        self.metrics.messages.labels(type(msg).__name__).inc()
        now = self.clock()
        with self._lock:
            if isinstance(msg, AbortAck | RoomStatus) and not self._for_us(msg):
                return
            if isinstance(msg, AbortAck):
                if msg.closed and undrained(msg.closed):
                    self._hold_back(msg)
                    actions = []
                else:
                    actions = self._ack(msg, now)
            elif isinstance(msg, RoomStatus):
                actions = []
                if msg.rank not in self.tracker.ranks_of(msg.room):
                    self._count_drop("stranger_status")
                elif msg.outcome is RoomOutcome.SUCCESS:
                    if self.tracker.succeeded(msg.room, msg.rank):
                        self._succeeded.add(msg.room)
                else:
                    self._failed.setdefault(msg.room, msg.reason)
            elif isinstance(msg, HelloAck):
                self._on_hello_ack(msg)
                return
            else:
                self._count_drop("unexpected_type")
                return
            releases = self._execute(actions)
        self._notify(releases)

    def _for_us(self, msg: AbortAck | RoomStatus) -> bool:
        """(With the lock.) Whether ``msg`` is for this endpoint, from the rank
        process it bootstrapped with. Another process at that rank's address
        (a restart) never wrote for us: its ack would skip the proof our own
        writer owes (its exit, with its connections drained). An earlier
        decode at our address had rooms of the same ids: its SUCCESS would
        hand out pages a request of ours is about to write."""
        writer = self._writers.get(msg.rank)
        if msg.decode != self.name:
            self._count_drop("other_decode")
            return False
        if writer is None or msg.session != writer.session:
            self._count_drop("other_session")
            return False
        return True

    def _on_hello_ack(self, msg: HelloAck) -> None:
        # called with the lock held
        if msg.address not in self._addresses:
            self._count_drop("stranger_hello")
            return
        if self._ranks and msg.rank not in self._ranks:
            # Bootstrap is over: a new rank id (from an address that is
            # another rank's) would make every room wait for its ack.
            self._count_drop("hello_ack_changed")
        elif msg.error:
            self._refusals[msg.address] = msg.error
        elif msg.rank in self._writers and self._writers[msg.rank].address != msg.address:
            self._refusals[msg.address] = f"rank {msg.rank} also claimed by {self._writers[msg.rank].address}"
        elif msg.rank in self._writers:
            # The first identity stays: a later one (a resent Hello's answer is
            # the same) could only make another process's exit count as this
            # writer's.
            if self._writers[msg.rank] != WriterIdentity.announced(msg):
                self._count_drop("hello_ack_changed")
        else:
            self._writers[msg.rank] = WriterIdentity.announced(msg)
        self._bootstrapped.notify_all()

    def _on_idle(self) -> float | None:
        now = self.clock()
        with self._lock:
            actions = self._drained_acks(now) + self.tracker.tick(now)
            if now >= self._next_exit_check:
                self._next_exit_check = now + self.EXIT_CHECK_S
                actions += self._check_exits(now)
            releases = self._execute(actions)
            next_deadline = self.tracker.next_deadline()
            draining = bool(self._draining)
        self._notify(releases)
        wait = None if next_deadline is None else max(0.0, next_deadline - now)
        if draining:
            wait = self.DRAIN_CHECK_S if wait is None else min(wait, self.DRAIN_CHECK_S)
        return wait

    def _ack(self, ack: AbortAck, now: float) -> list[HoldAction]:
        # called with the lock held
        held_since = self.tracker.held_since(ack.room)
        actions = self.tracker.ack(ack, now)
        if not any(isinstance(a, Dropped) for a in actions):
            self.metrics.acks_received.inc()
            if held_since is not None:
                self.metrics.ack_wait.labels(str(ack.rank)).observe(now - held_since)
        return actions

    def _hold_back(self, ack: AbortAck) -> None:
        # called with the lock held
        key = (ack.room, ack.rank, ack.generation)
        if key not in self._draining and len(self._draining) >= self.MAX_DRAINING:
            self._count_drop("drain_backlog_full")
            return
        self._draining[key] = ack

    def _drained_acks(self, now: float) -> list[HoldAction]:
        """Feed the held-back acks whose connections have drained to the tracker."""
        # called with the lock held
        if not self._draining:
            return []
        table = TcpTable()  # one reading of /proc for every held-back ack
        actions: list[HoldAction] = []
        for key, ack in list(self._draining.items()):
            if not table.undrained(ack.closed):
                del self._draining[key]
                actions += self._ack(ack, now)
        return actions

    def _check_exits(self, now: float) -> list[HoldAction]:
        rooms = self.tracker.rooms_in(HoldState.HELD) + self.tracker.rooms_in(HoldState.QUARANTINED)
        waiting = {rank for room in rooms for rank in self.tracker.ranks_of(room)}
        actions: list[HoldAction] = []
        gone = [rank for rank in sorted(waiting) if self._writers[rank].proven_gone(self._pid_namespace)]
        # A dead writer's kernel still delivers what it had sent: its exit
        # proves nothing until our ends of its connections drained.
        if gone and not dead_peer_ends():
            for rank in gone:
                actions += self.tracker.writer_exited(rank, now)
        return actions

    def _abort(self, room: int) -> None:
        with self._lock:
            releases = self._execute(self.tracker.abort(room, self.clock()))
        self._notify(releases)

    def _execute(self, actions: Sequence[HoldAction]) -> list[Release]:
        """Carry out tracker actions (lock held); releases are returned so the
        engine's callback runs outside the lock."""
        releases = []
        for action in actions:
            if isinstance(action, SendAbort):
                if self._outbox.send(self._writers[action.rank].address, action.abort):
                    self.metrics.aborts_sent.inc()
            elif isinstance(action, Release):
                releases.append(action)
                # Released rooms leave every table (a serving decode sees millions);
                # their receivers keep what they need.
                self._failed.pop(action.room, None)
                self._succeeded.discard(action.room)
                proof = action.proof.value
                self.metrics.releases.labels(proof).inc()
                self.metrics.released_pages.labels(proof).inc(len(action.pages))
                self.metrics.release_latency.labels(proof).observe(action.held_for)
                self.metrics.quarantine_seconds.inc(action.quarantined_for)
            elif isinstance(action, Quarantine):
                self.metrics.quarantines.inc()
                log.warning(
                    "room %d quarantined: %d pages held, no proof yet", action.room, len(action.pages)
                )
            elif isinstance(action, Dropped):
                self._count_drop(action.reason)
        return releases

    def _gauge_hold_state(self) -> None:
        """The hold gauges read the tracker when scraped, under the lock: kept
        up to date on every message instead, they cost a scan of the held
        rooms each time, and the quarantine's age went stale between messages."""

        def locked(read: Callable[[], float]) -> Callable[[], float]:
            def value() -> float:
                with self._lock:
                    return read()

            return value

        tracker, m = self.tracker, self.metrics
        held, quarantined = HoldState.HELD, HoldState.QUARANTINED
        m.rooms_held.set_function(
            locked(lambda: len(tracker.rooms_in(held)) + len(tracker.rooms_in(quarantined)))
        )
        m.pages_held.set_function(self.held_pages)
        m.pages_quarantined.set_function(locked(lambda: tracker.pages_in(quarantined)))
        m.quarantine_age.set_function(locked(lambda: tracker.oldest_quarantine(self.clock())))
        m.acks_draining.set_function(locked(lambda: len(self._draining)))

    def _notify(self, releases: list[Release]) -> None:
        if self.on_release is None:
            return
        for release in releases:
            try:
                self.on_release(release)
            except Exception:
                log.exception("on_release callback raised for room %d", release.room)

    def _count_drop(self, reason: str) -> None:
        self.metrics.dropped.labels(reason).inc()


def _slot_field(slot: int | None) -> int:
    return 0 if slot is None else slot + 1


class Receiver:
    """The engine's handle on one room at decode (like SGLang's KVReceiver)."""

    def __init__(self, endpoint: DecodeEndpoint, room: int) -> None:
        self._endpoint = endpoint
        self.room = room
        self._aborted = False
        self._failure: str | None = None

    def poll(self) -> KVPoll:
        if self._aborted:
            return KVPoll.FAILED
        ep = self._endpoint
        with ep._lock:
            if self.room in ep._failed:
                return KVPoll.FAILED
            if self.room in ep._succeeded:
                return KVPoll.SUCCESS
            return KVPoll.TRANSFERRING

    def failure(self) -> str | None:
        with self._endpoint._lock:
            return self._endpoint._failed.get(self.room, self._failure)

    def abort(self) -> None:
        """Give the room up. Its pages come back through ``on_release`` once
        proven free (at once if every rank already completed)."""
        with self._endpoint._lock:
            self._failure = self._endpoint._failed.get(self.room)  # forgotten there at release
        self._aborted = True
        self._endpoint._abort(self.room)

    def finish(self) -> tuple[int, ...]:
        """Take a completed room's pages (poll() said SUCCESS)."""
        with self._endpoint._lock:
            self._endpoint._succeeded.discard(self.room)
            return self._endpoint.tracker.finish(self.room)

    def state(self) -> HoldState | None:
        with self._endpoint._lock:
            return self._endpoint.tracker.state(self.room)


__all__ = ["BootstrapError", "DecodeEndpoint", "Proof", "Receiver", "Release"]
