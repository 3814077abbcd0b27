"""The decode endpoint: the page owner. It bootstraps prefill ranks, asks them
for rooms, aborts rooms, and hands pages back to the engine only with proof.

ABORT_ACKs arrive on kvconn's own listener socket and thread, never through
transport notifications (those may only progress inside an active poll).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence

import attrs

from kvconn.config import Config
from kvconn.errors import BootstrapError, PageError, RoomInUseError, RoomStateError
from kvconn.layout import KVLayout, checked_buffers
from kvconn.metrics import Metrics
from kvconn.protocol.drops import DropReason
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


@attrs.define(slots=True, eq=False)
class _Request:
    """One request for a room: what its :class:`Receiver` reports. A room id
    is reused by later requests; each has its own, and a handle keeps its
    own after the endpoint forgot it."""

    room: int
    pages: tuple[int, ...]
    #: The rank processes asked to write it (by endpoint-wide rank id): only
    #: theirs are its acks, statuses and exit proofs, whatever process has
    #: the rank's address now.
    writers: dict[int, WriterIdentity]
    #: Its prefill instance's endpoint-wide rank ids, by the ranks' own
    #: (TP) rank: how an ack or status naming rank r is told apart.
    ids: tuple[int, ...] = ()
    #: SUCCESS (every rank reported every chunk landed) or FAILED; final.
    verdict: KVPoll | None = None
    failure: str | None = None
    aborted: bool = False
    finished: bool = False

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        if self.verdict is None:
            self.verdict = KVPoll.FAILED


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


@attrs.define(slots=True, eq=False)
class _Instance:
    """One prefill instance (its ranks' control addresses, in rank order),
    bootstrapped or being bootstrapped. Its ranks get endpoint-wide ids
    (``ids[r]`` for its rank ``r``): the hold tracker and the liveness
    tables know a rank by that id, since every instance has a rank 0."""

    addresses: tuple[str, ...]
    hello: Hello
    ids: tuple[int, ...] = ()
    #: While bootstrapping: answers by the rank's own rank, refusals by address.
    answers: dict[int, WriterIdentity] = attrs.Factory(dict)
    refusals: dict[str, str] = attrs.Factory(dict)


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
        self._request_seq_heap = 0
        #: Every bootstrapped rank's process, by endpoint-wide rank id.
        self._writers: dict[int, WriterIdentity] = {}
        #: Every bootstrapped rank (ids), of every prefill instance.
        self._ranks: frozenset[int] = frozenset()
        #: Prefill instances, bootstrapped on first use and kept: by their
        #: addresses, and which instance (and rank in it) each id is.
        self._instances: dict[tuple[str, ...], _Instance] = {}
        self._default: _Instance | None = None
        self._rank_of: dict[int, tuple[_Instance, int]] = {}
        self._id_at: dict[str, int] = {}
        #: (rank, session) of every current writer -> its id: an ack for a
        #: room no longer tracked still names whose it is.
        self._id_of_session: dict[tuple[int, int], int] = {}
        #: Addresses of instances being bootstrapped now.
        self._pending: dict[str, _Instance] = {}
        #: One bootstrap at a time per instance; instances in parallel, so
        #: an unreachable one does not hold up the others.
        self._bootstrap_locks: dict[tuple[str, ...], threading.Lock] = {}
        self._bootstrapped = threading.Condition(self._lock)
        #: The current request of every room the tracker has (open or held).
        self._requests: dict[int, _Request] = {}
        #: Pages of tracked rooms, when config.check_pages (a set: its C-level
        #: isdisjoint/update cost ~15 us for 1024 pages, a Python loop ~100).
        self._in_use: set[int] = set()
        #: Liveness: when each rank's current process last answered, which
        #: ranks are down (and why), and sessions of processes replaced at a
        #: rank's address (their late answers are not a restart).
        self._heard: dict[int, float] = {}
        self._down: dict[int, str] = {}
        self._retired: set[tuple[int, int]] = set()
        self._next_heartbeat = 0.0
        #: (deadline, seq, request) of open rooms, when config.transfer_timeout_s.
        self._deadlines: list[tuple[float, int, _Request]] = []
        self._next_exit_check = 0.0
        #: Fenced acks held back until decode's ends of the connections the
        #: fence closed have drained (see runtime/sockets.py).
        self._draining: dict[tuple[int, int, int], AbortAck] = {}
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
        if prefill:
            try:
                self._default = self._instance(prefill)
            except BaseException:
                self.close()
                raise

    @property
    def ranks(self) -> frozenset[int]:
        """The ranks of the prefill instance given at construction (none if
        none was: every request then names its instance)."""
        return frozenset(self._default.ids) if self._default is not None else frozenset()

    def session_of(self, rank: int, prefill: Sequence[str] | None = None) -> int:
        """The session of the rank process this endpoint bootstrapped with
        (rank ``rank`` of instance ``prefill``, by default the one given at
        construction): acks and statuses that name another are dropped."""
        with self._lock:
            instance = self._default if prefill is None else self._instances.get(tuple(prefill))
            if instance is None:
                raise ValueError(f"no bootstrapped prefill instance {prefill}")
            return self._writers[instance.ids[rank]].session

    def instances(self) -> list[tuple[str, ...]]:
        """The prefill instances bootstrapped so far, by their ranks' addresses."""
        with self._lock:
            return list(self._instances)

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

        Refused (nothing sent, nothing tracked) with
        :class:`~kvconn.errors.PageError` for pages out of range or
        duplicated, or (``Config.check_pages``) still in use by another room,
        and with :class:`~kvconn.errors.RoomInUseError` while ``room`` itself
        is still tracked."""
        if prefill is None:
            instance = self._default
            if instance is None:
                raise ValueError(f"room {room}: no prefill instance: name its ranks' addresses (prefill=)")
        else:
            instance = self._instance(prefill)
        known = frozenset(range(len(instance.ids)))
        local = known if ranks is None else frozenset(ranks)
        if not local <= known:
            raise ValueError(f"unknown ranks {sorted(local - known)}")
        ranks = frozenset(instance.ids[r] for r in local)
        if extras_slot is not None and not (
            self.layout is not None and 0 <= extras_slot < self.layout.num_slots
        ):
            slots = 0 if self.layout is None else self.layout.num_slots
            raise ValueError(f"extras slot {extras_slot} outside the layout's {slots} slots")
        pages = tuple(pages)
        bad = [p for p in pages if not 0 <= p < self.num_pages]
        if bad:
            raise PageError(f"pages {bad[:8]} outside 0..{self.num_pages - 1}", room)
        if len(set(pages)) != len(pages):
            twice = sorted(p for p, n in Counter(pages).items() if n > 1)
            raise PageError(f"pages {twice[:8]} given more than once", room)
        with self._lock:
            state = self.tracker.state(room)
            if state is not None:
                raise RoomInUseError(f"still tracked ({state.value}): its pages are not back yet", room)
            if self.config.check_pages:
                if not self._in_use.isdisjoint(pages):
                    taken = sorted(self._in_use.intersection(pages))
                    raise PageError(
                        f"pages {taken[:8]} belong to another room not finished or released yet", room
                    )
                self._in_use.update(pages)
            self.tracker.open(room, pages, ranks)
            writers = {rank: self._writers[rank] for rank in ranks}
            request = self._requests[room] = _Request(room, pages, writers, instance.ids)
            if self.config.transfer_timeout_s is not None:
                self._request_seq_heap += 1
                due = self.clock() + self.config.transfer_timeout_s
                heapq.heappush(self._deadlines, (due, self._request_seq_heap, request))
        # Numbered and sent under one lock: a rank takes only a request numbered
        # above the last it took, so two engine threads' requests must not
        # overtake each other between numbering and sending.
        with self._request_lock:
            unsent = []
            for rank in sorted(ranks):
                writer = self._writers[rank]
                self._request_seq += 1
                message = TransferRequest(
                    room, self.name, pages, writer.session, self._request_seq, _slot_field(extras_slot)
                )
                if not self._outbox.send(writer.address, message):
                    unsent.append(rank)
        if unsent:
            # Nothing re-sends a request, and a room not yet aborted has no
            # deadline: say Failed now, so the engine aborts it (the ranks
            # that did get it ack as ever).
            with self._lock:
                request.fail(f"request to ranks {unsent} dropped: send queue full")
        with self._lock:
            down = sorted(set(ranks) & set(self._down))
            if down:
                # A rank known dead or silent would leave it TRANSFERRING:
                # fail it now, on the abort path (held until proof).
                reason = "; ".join(f"rank {r} is down: {self._down[r]}" for r in down)
                releases = self._execute(self._fail_and_abort(request, reason, self.clock()))
            else:
                releases = []
        self._notify(releases)
        return Receiver(self, request)

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
    def _instance(self, addresses: Sequence[str]) -> _Instance:
        """The prefill instance at ``addresses``, bootstrapped now if it is new."""
        key = tuple(addresses)
        with self._lock:
            known = self._instances.get(key)
        if known is not None:
            return known
        if not key:
            raise ValueError("a prefill instance needs at least one rank address")
        if len(set(key)) != len(key):
            raise ValueError(f"prefill addresses {list(key)} name one rank twice")
        # Two engine threads meeting a new instance at once bootstrap it once.
        with self._lock:
            bootstrap_lock = self._bootstrap_locks.setdefault(key, threading.Lock())
        with bootstrap_lock:
            with self._lock:
                known = self._instances.get(key)
                if known is not None:
                    return known
                taken = [a for a in key if a in self._id_at or a in self._pending]
                if taken:
                    raise ValueError(
                        f"prefill addresses {taken} are ranks of another prefill instance of this endpoint"
                    )
                hello = Hello(
                    self.name,
                    self.address,
                    self.backend.name,
                    self.page_bytes,
                    len(key),
                    round(self.config.abort_timeout_s * 1000),
                    self.region.metadata,
                    b"" if self.layout is None else self.layout.to_bytes(),
                )
                instance = _Instance(key, hello)
                for address in key:
                    self._pending[address] = instance
            try:
                self._bootstrap(instance)
            finally:
                with self._lock:
                    for address in key:
                        self._pending.pop(address, None)
        return instance

    def _bootstrap(self, instance: _Instance) -> None:
        addresses, hello = instance.addresses, instance.hello
        # Re-sent until answered: a Hello or its HelloAck can be lost (a
        # rank's connection to an earlier decode at our address, not yet seen
        # closed, takes the HelloAck with it). A rank answers a repeated
        # Hello as the first.
        every = min(self.config.resend_interval_s, self.config.bootstrap_timeout_s / 4)
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        with self._bootstrapped:
            unanswered = list(addresses)
            while unanswered:
                for address in unanswered:
                    self._outbox.send(address, hello)
                resend_at = min(deadline, time.monotonic() + every)
                while (left := resend_at - time.monotonic()) > 0 and unanswered:
                    self._bootstrapped.wait(left)
                    answered = {w.address for w in instance.answers.values()} | set(instance.refusals)
                    unanswered = [a for a in addresses if a not in answered]
                if unanswered and time.monotonic() >= deadline:
                    raise BootstrapError(
                        f"{len(addresses) - len(unanswered)} of {len(addresses)} prefill ranks answered "
                        f"within {self.config.bootstrap_timeout_s} s"
                    )
            if instance.refusals:
                raise BootstrapError("; ".join(f"{a}: {e}" for a, e in instance.refusals.items()))
            if sorted(instance.answers) != list(range(len(addresses))):
                raise BootstrapError(
                    f"ranks {sorted(instance.answers)} answered, expected 0..{len(addresses) - 1}"
                )
            # Ids follow on from the instances before: the first instance's
            # ranks keep their own numbers.
            first = max(self._ranks, default=-1) + 1
            instance.ids = tuple(range(first, first + len(addresses)))
            now = self.clock()
            for rank, writer in instance.answers.items():
                rank_id = instance.ids[rank]
                self._writers[rank_id] = writer
                self._rank_of[rank_id] = (instance, rank)
                self._id_at[writer.address] = rank_id
                self._id_of_session[rank, writer.session] = rank_id
                self._heard[rank_id] = now
            if not self._ranks:
                self._next_heartbeat = now + self.config.heartbeat_interval_s
            self._ranks |= frozenset(instance.ids)
            self._instances[addresses] = instance

    # -- control plane -----------------------------------------------------
    def _on_message(self, msg: Message) -> None:
        self.metrics.messages.labels(type(msg).__name__).inc()
        now = self.clock()
        with self._lock:
            if isinstance(msg, AbortAck | RoomStatus):
                rank_id = self._for_us(msg)
                if rank_id is None:
                    return
                # from here on a rank is known by its endpoint-wide id
                msg = attrs.evolve(msg, rank=rank_id)
            if isinstance(msg, AbortAck):
                if msg.closed and undrained(msg.closed):
                    self._hold_back(msg)
                    actions = []
                else:
                    actions = self._ack(msg, now)
            elif isinstance(msg, RoomStatus):
                actions = []
                request = self._requests.get(msg.room)
                if msg.rank not in self.tracker.ranks_of(msg.room) or request is None:
                    self._count_drop(DropReason.STRANGER_STATUS)
                elif msg.outcome is RoomOutcome.SUCCESS:
                    if self.tracker.succeeded(msg.room, msg.rank) and request.verdict is None:
                        request.verdict = KVPoll.SUCCESS
                else:
                    request.fail(msg.reason)
            elif isinstance(msg, HelloAck):
                if msg.address in self._pending:
                    self._on_hello_ack(msg)
                    return
                actions = self._on_heartbeat(msg, now)
            else:
                self._count_drop(DropReason.UNEXPECTED_TYPE)
                return
            releases = self._execute(actions)
        self._notify(releases)

    def _for_us(self, msg: AbortAck | RoomStatus) -> int | None:
        """(With the lock.) The id of the rank that sent ``msg`` if it is for
        this endpoint, from the rank process it bootstrapped with (None:
        dropped). An ack names its rank as that rank's own instance numbers
        it: the room's request says which instance. Another process at that rank's address
        (a restart) never wrote for us: its ack would skip the proof our own
        writer owes (its exit, with its connections drained). An earlier
        decode at our address had rooms of the same ids: its SUCCESS would
        hand out pages a request of ours is about to write."""
        request = self._requests.get(msg.room)
        if request is not None:
            rank_id = request.ids[msg.rank] if 0 <= msg.rank < len(request.ids) else None
            writer = request.writers.get(rank_id) if rank_id is not None else None
        else:
            rank_id = self._id_of_session.get((msg.rank, msg.session))
            writer = self._writers.get(rank_id) if rank_id is not None else None
        if msg.decode != self.name:
            self._count_drop(DropReason.OTHER_DECODE)
            return None
        if writer is None or rank_id is None or msg.session != writer.session:
            self._count_drop(DropReason.OTHER_SESSION)
            return None
        return rank_id

    def _on_hello_ack(self, msg: HelloAck) -> None:
        # called with the lock held: an answer to a bootstrap in progress
        instance = self._pending[msg.address]
        answers = instance.answers
        if msg.error:
            instance.refusals[msg.address] = msg.error
        elif msg.rank in answers and answers[msg.rank].address != msg.address:
            instance.refusals[msg.address] = f"rank {msg.rank} also claimed by {answers[msg.rank].address}"
        elif msg.rank in answers:
            # The first identity stays: a later one (a resent Hello's answer is
            # the same) could only make another process's exit count as this
            # writer's.
            if answers[msg.rank] != WriterIdentity.announced(msg):
                self._count_drop(DropReason.HELLO_ACK_CHANGED)
        else:
            answers[msg.rank] = WriterIdentity.announced(msg)
        self._bootstrapped.notify_all()

    def _on_idle(self) -> float | None:
        now = self.clock()
        with self._lock:
            actions = self._drained_acks(now) + self.tracker.tick(now)
            if now >= self._next_exit_check:
                self._next_exit_check = now + self.EXIT_CHECK_S
                actions += self._check_exits(now)
            if self._ranks and now >= self._next_heartbeat:
                self._next_heartbeat = now + self.config.heartbeat_interval_s
                actions += self._heartbeat(now)
            actions += self._expire_rooms(now)
            releases = self._execute(actions)
            next_deadline = min(
                (t for t in (self.tracker.next_deadline(), self._next_room_deadline()) if t is not None),
                default=None,
            )
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
            self._count_drop(DropReason.DRAIN_BACKLOG_FULL)
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
        """Release held rooms whose writer processes are proven gone. Each
        room's own writers: a process restarted at a rank's address proves
        nothing for the rooms the earlier one was asked to write."""
        rooms = self.tracker.rooms_in(HoldState.HELD) + self.tracker.rooms_in(HoldState.QUARANTINED)
        owed: dict[tuple[int, WriterIdentity], list[int]] = {}
        for room in rooms:
            request = self._requests.get(room)
            for rank in self.tracker.ranks_of(room):
                writer = request.writers[rank] if request is not None else self._writers[rank]
                owed.setdefault((rank, writer), []).append(room)
        actions: list[HoldAction] = []
        gone = [(key, rs) for key, rs in owed.items() if key[1].proven_gone(self._pid_namespace)]
        # A dead writer's kernel still delivers what it had sent: its exit
        # proves nothing until our ends of its connections drained.
        if gone and not dead_peer_ends():
            for (rank, _), held in gone:
                actions += self.tracker.writer_exited(rank, now, frozenset(held))
        return actions

    # -- liveness ----------------------------------------------------------
    def _heartbeat(self, now: float) -> list[HoldAction]:
        """(With the lock.) Hello every rank again (its answer proves it
        alive and names its session); a rank silent past peer_timeout_s, or
        whose process is proven gone, is down."""
        actions: list[HoldAction] = []
        for rank in sorted(self._ranks):
            writer = self._writers[rank]
            self._outbox.send(writer.address, self._rank_of[rank][0].hello)
            if rank in self._down:
                continue
            if writer.proven_gone(self._pid_namespace):
                actions += self._rank_down(rank, "exited", f"its process (pid {writer.pid}) exited", now)
            elif now - self._heard[rank] > self.config.peer_timeout_s:
                silent = f"no answer for {now - self._heard[rank]:.1f} s"
                actions += self._rank_down(rank, "silent", silent, now)
        return actions

    def _on_heartbeat(self, msg: HelloAck, now: float) -> list[HoldAction]:
        """(With the lock.) A HelloAck after bootstrap: the rank's process
        alive, or a new process at its address (re-bootstrapped: it took our
        Hello). Rooms the earlier process was asked to write keep needing
        its proof (exit with drain, or quarantine); they fail now."""
        rank = self._id_at.get(msg.address)  # the endpoint-wide id of the rank there
        if rank is None:
            self._count_drop(DropReason.STRANGER_HELLO)
            return []
        writer = self._writers[rank]
        if msg.rank != self._rank_of[rank][1]:
            self._count_drop(DropReason.HELLO_ACK_CHANGED)
            return []
        if msg.error or (rank, msg.session) in self._retired:
            self._count_drop(DropReason.HELLO_REFUSED if msg.error else DropReason.RETIRED_SESSION)
            return []
        if msg.session == writer.session:
            self._heard[rank] = now
            self._down.pop(rank, None)
            return []
        self._retired.add((rank, writer.session))
        self._writers[rank] = WriterIdentity.announced(msg)
        self._id_of_session.pop((msg.rank, writer.session), None)
        self._id_of_session[msg.rank, msg.session] = rank
        self._heard[rank] = now
        self._down.pop(rank, None)
        self.metrics.rank_restarts.inc()
        log.warning("prefill rank %d at %s restarted: re-bootstrapped", msg.rank, msg.address)
        reason = f"rank {msg.rank} restarted (a new process at {msg.address})"
        return self._fail_rooms_of(rank, writer, reason, now)

    def _rank_down(self, rank: int, cause: str, reason: str, now: float) -> list[HoldAction]:
        self._down[rank] = reason
        self.metrics.ranks_down.labels(cause).inc()
        log.warning("prefill rank %d is down: %s", rank, reason)
        return self._fail_rooms_of(rank, self._writers[rank], f"rank {rank} is down: {reason}", now)

    def _fail_rooms_of(self, rank: int, writer: WriterIdentity, reason: str, now: float) -> list[HoldAction]:
        """(With the lock.) Fail the open rooms ``writer`` was asked to write."""
        actions: list[HoldAction] = []
        for request in list(self._requests.values()):
            if request.writers.get(rank) == writer and request.verdict is None and not request.aborted:
                self.metrics.rooms_failed_by_rank.inc()
                actions += self._fail_and_abort(request, reason, now)
        return actions

    def _fail_and_abort(self, request: _Request, reason: str, now: float) -> list[HoldAction]:
        """(With the lock.) FAILED to the engine, then the abort path: the
        pages are held until proof, never freed here."""
        if self._requests.get(request.room) is not request or request.aborted or request.finished:
            return []
        request.fail(reason)
        request.aborted = True
        return self.tracker.abort(request.room, now)

    def _expire_rooms(self, now: float) -> list[HoldAction]:
        """(With the lock.) Open rooms past their transfer deadline fail."""
        actions: list[HoldAction] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self._deadlines)
            if request.verdict is None and not request.aborted:
                timeout = self.config.transfer_timeout_s
                self.metrics.room_deadlines.inc()
                actions += self._fail_and_abort(request, f"not complete within {timeout} s", now)
        return actions

    def _next_room_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def _abort(self, request: _Request) -> None:
        with self._lock:
            if request.aborted or request.finished or self._requests.get(request.room) is not request:
                return  # its pages are the engine's already, or on their way back
            request.aborted = True
            # The engine's own verdict, even over a SUCCESS that raced it: its
            # pages come back through on_release, never through finish().
            request.verdict = KVPoll.FAILED
            releases = self._execute(self.tracker.abort(request.room, self.clock()))
        self._notify(releases)

    def _finish(self, request: _Request) -> tuple[int, ...]:
        with self._lock:
            if request.finished:
                raise RoomStateError("finish() was already called: its pages are the engine's", request.room)
            if request.aborted:
                raise RoomStateError("aborted: its pages come back through on_release", request.room)
            if request.verdict is not KVPoll.SUCCESS or self._requests.get(request.room) is not request:
                raise RoomStateError(f"not completed (poll() says {self._poll(request).name})", request.room)
            pages = self.tracker.finish(request.room)
            request.finished = True
            self._forget(request.room)
            return pages

    def _poll(self, request: _Request) -> KVPoll:
        # called with the lock held
        return KVPoll.TRANSFERRING if request.verdict is None else request.verdict

    def _forget(self, room: int) -> None:
        """(With the lock.) The room left the tracker: its pages are free."""
        request = self._requests.pop(room, None)
        if request is not None and self.config.check_pages:
            self._in_use.difference_update(request.pages)

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
                self._forget(action.room)
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

    def _count_drop(self, reason: DropReason) -> None:
        self.metrics.dropped.labels(reason).inc()


def _slot_field(slot: int | None) -> int:
    return 0 if slot is None else slot + 1


class Receiver:
    """The engine's handle on one request for a room at decode (like
    SGLang's KVReceiver).

    It belongs to its own request: once the room id is reused by a newer
    request, this handle's ``abort()`` does nothing, its ``poll()`` keeps its
    own verdict and its ``finish()`` raises, never acting on the newer one.
    """

    def __init__(self, endpoint: DecodeEndpoint, request: _Request) -> None:
        self._endpoint = endpoint
        self._request = request
        self.room = request.room

    def poll(self) -> KVPoll:
        """TRANSFERRING until every rank reported every chunk landed
        (SUCCESS) or the room failed (FAILED); then that, for good, except
        that abort() makes it FAILED (for good)."""
        with self._endpoint._lock:
            return self._endpoint._poll(self._request)

    def failure(self) -> str | None:
        """Why the room failed, as a rank or this endpoint said (None: no
        reason given, or not failed)."""
        with self._endpoint._lock:
            return self._request.failure

    def abort(self) -> None:
        """Give the room up. Its pages come back through ``on_release`` once
        proven free (at once if every rank already completed). Does nothing
        once the pages are the engine's (after finish()) or already on their
        way back."""
        self._endpoint._abort(self._request)

    def finish(self) -> tuple[int, ...]:
        """Take a completed room's pages (poll() said SUCCESS). Raises
        :class:`~kvconn.errors.RoomStateError` if it is not completed, was
        aborted, or was finished already."""
        return self._endpoint._finish(self._request)

    def state(self) -> HoldState | None:
        """Where the room's pages are (None: back with the engine)."""
        ep = self._endpoint
        with ep._lock:
            if ep._requests.get(self.room) is not self._request:
                return None
            return ep.tracker.state(self.room)


__all__ = ["BootstrapError", "DecodeEndpoint", "Proof", "Receiver", "Release"]
