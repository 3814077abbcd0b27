"""A decode endpoint's view of its prefill ranks, and its requests' verdicts.

Sans-I/O like :class:`~kvconn.protocol.hold.HoldTracker`, which it wraps:
the runtime passes ``now``, feeds in what arrived or what a probe found (a
message, a :class:`Tick`, which writers ``/proc`` proves gone, which fenced
acks' connections drained) and carries out the returned actions. It decides:

* prefill instances and their ranks' endpoint-wide ids (every instance has a
  rank 0; the tracker knows a rank by its id);
* writer identities and sessions: each request remembers the rank processes
  it was sent to, and only their acks, statuses and exits count for it;
* liveness (protocol/liveness.py): any message of a rank's current process
  is hearing from it; a rank some room depends on that left a Hello
  unanswered for ``peer_timeout_s`` with its control link lost (or for
  ``peer_hung_timeout_s`` with it up), or is proven gone, is down; a new
  session at its address is a restart (re-bootstrapped); either fails the
  open rooms of the process it concerns, onto the abort path; a rank whose
  link was lost since it last spoke is asked who is there before a request
  is sent to it;
* transfer deadlines, fenced acks held back until their connections drained,
  and each request's verdict (SUCCESS once every rank reported every chunk
  landed, FAILED otherwise; final);
* the owner fence (when: :class:`~kvconn.protocol.owner_fence.OwnerFencePolicy`;
  what it proves and costs: :func:`~kvconn.protocol.owner_fence.owner_fenced`).

It never frees a page on its own account: pages leave only through the
tracker's :class:`~kvconn.protocol.hold.Release`, which names its proof.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import attrs

from kvconn.errors import (
    FinishRefusedError,
    PageError,
    PageInUseError,
    RequestError,
    RoomInUseError,
    UnavailableError,
)
from kvconn.protocol import bootstrap, drain, liveness
from kvconn.protocol.drops import DropReason
from kvconn.protocol.endpoint_events import (
    AckCounted,
    Action,
    Answered,
    BootstrapTick,
    CheckDrain,
    Drop,
    ExitsProbed,
    Identified,
    Identify,
    Instance,
    LinksChanged,
    Probes,
    RankRestarted,
    Request,
    RoomFailed,
    Send,
    Tick,
    Undrained,
    WriterIdentity,
)
from kvconn.protocol.hold import Dropped, HoldAction, HoldState, HoldTracker, Release, SendAbort
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import (
    AbortAck,
    Hello,
    HelloAck,
    RankDraining,
    RoomOutcome,
    RoomStatus,
    TransferRequest,
)
from kvconn.protocol.owner_fence import (
    OwnerFenced,
    OwnerFenceDone,
    OwnerFenceError,
    OwnerFencePolicy,
    owner_fenced,
)

_R = TypeVar("_R", AbortAck, RoomStatus)
_K = TypeVar("_K")


class EndpointState:
    """Every decision of one decode endpoint but the page holds themselves
    (``tracker``'s)."""

    EXIT_CHECK_S = 0.05
    MAX_DRAINING = 4096

    def __init__(
        self,
        name: str,
        tracker: HoldTracker,
        *,
        num_pages: int,
        num_slots: int = 0,
        heartbeat_interval_s: float = 1.0,
        peer_timeout_s: float = 10.0,
        peer_hung_timeout_s: float = 60.0,
        transfer_timeout_s: float | None = None,
        check_pages: bool = True,
        owner_fence: OwnerFencePolicy | None = None,
    ) -> None:
        self.name = self._first_name = name
        self.tracker = tracker
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.heartbeat_interval_s = heartbeat_interval_s
        self.peer_timeout_s = peer_timeout_s
        self.peer_hung_timeout_s = peer_hung_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.check_pages = check_pages
        self.default: Instance | None = None
        #: Every bootstrapped rank's current process, by endpoint-wide rank id.
        self.writers: dict[int, WriterIdentity] = {}
        self.ranks: frozenset[int] = frozenset()
        self.instances: dict[tuple[str, ...], Instance] = {}
        self._rank_of: dict[int, tuple[Instance, int]] = {}
        self._id_at: dict[str, int] = {}
        #: (rank, session) of every current writer -> its id: an ack for a
        #: room no longer tracked still names whose it is.
        self._id_of_session: dict[tuple[int, int], int] = {}
        #: Addresses of instances being bootstrapped now.
        self.pending: dict[str, Instance] = {}
        #: The current request of every room the tracker has (open or held).
        self.requests: dict[int, Request] = {}
        #: How many of those each rank was asked to write (the watched ranks:
        #: protocol/liveness.py), the held or quarantined ones, and how many
        #: held rooms each writer process owes a proof (an exit check looks
        #: those up): kept as rooms come and go, so that a heartbeat or an
        #: exit check costs O(ranks), not a walk of the rooms.
        self._rooms_of_rank: dict[int, int] = {}
        self._held: dict[int, Request] = {}
        self._owing: dict[WriterIdentity, int] = {}
        #: Pages of tracked rooms, when check_pages (a set: its C-level
        #: isdisjoint/update cost ~15 us for 1024 pages, a Python loop ~100).
        self._in_use: set[int] = set()
        self._seq = 0
        #: When each rank's current process last spoke, when a Hello to it
        #: first went unanswered (watched ranks only), which ranks are down
        #: (and why), and sessions of processes replaced at a rank's address
        #: (their late answers are not a restart).
        self._heard: dict[int, float] = {}
        self._asked: dict[int, float] = {}
        self.down: dict[int, str] = {}
        #: Each control link, by address, as the runtime last reported it
        #: (absent: never reported), and the ranks whose link was lost since
        #: their process last spoke: requests to them wait for an answer.
        self._link: dict[str, bool] = {}
        self.unconfirmed: set[int] = set()
        self._retired: set[tuple[int, int]] = set()
        self._next_heartbeat = 0.0
        self._next_exit_check = 0.0
        #: (deadline, seq, request) of open rooms, when transfer_timeout_s.
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadline_seq = 0
        #: Fenced acks held back until decode's ends of the connections the
        #: fence closed have drained.
        self.draining: dict[tuple[int, int, int], AbortAck] = {}
        #: Ranks whose process announced a drain (rank id -> its session):
        #: refused while that process is the rank's (protocol/drain.py).
        self.leaving: dict[int, int] = {}
        #: This endpoint's drain, if it drains: it takes no new request.
        self.drain: drain.DecodeDrain | None = None
        self.owner_fence = owner_fence or OwnerFencePolicy()
        #: The region's metadata since the last owner fence (None: none yet,
        #: each instance's Hello has it).
        self.metadata: bytes | None = None
        #: Why this endpoint has no transport endpoint (an owner fence held
        #: but its new endpoint could not be made yet; None: it has one).
        self.endpoint_down: str | None = None

    # -- queries -----------------------------------------------------------
    def instance(self, addresses: Sequence[str] | None) -> Instance | None:
        return self.default if addresses is None else self.instances.get(tuple(addresses))

    def session_of(self, rank: int, addresses: Sequence[str] | None = None) -> int:
        instance = self.instance(addresses)
        if instance is None:
            raise RequestError(f"no bootstrapped prefill instance {addresses}")
        if not 0 <= rank < len(instance.ids):
            raise RequestError(f"no rank {rank} in a prefill instance of {len(instance.ids)} ranks")
        return self.writers[instance.ids[rank]].session

    def current(self, request: Request) -> bool:
        """``request`` is its room's current one (not replaced, not forgotten)."""
        return self.requests.get(request.room) is request

    def hold_state(self, request: Request) -> HoldState | None:
        return self.tracker.state(request.room) if self.current(request) else None

    def held_pages(self) -> int:
        return self.tracker.pages_in(HoldState.HELD) + self.tracker.pages_in(HoldState.QUARANTINED)

    def next_wakeup(self) -> float | None:
        """The earliest instant a :class:`Tick` has something to do: a hold's
        or a transfer's deadline, the owner fence, and the exit check while
        a held room owes a proof (or a fenced ack waits for its drain) and
        the heartbeat while a rank is watched, down or asked (and the region
        has a transport endpoint: without one a tick skips it); None: nothing
        until the state changes. A tick before it changes nothing."""
        times = [self.tracker.next_deadline(), self._deadlines[0][0] if self._deadlines else None]
        if self._owing or self.draining:
            times.append(self._next_exit_check)
        if self.ranks and (self._rooms_of_rank or self.down or self._asked) and self.endpoint_down is None:
            times.append(self._next_heartbeat)  # no heartbeat without an endpoint (_on_tick)
        if self.owner_fence.enabled or self.endpoint_down is not None:
            since = min((at for _, at, _ in self.tracker.quarantined()), default=None)
            times.append(self.owner_fence.next_due(since))
        return min((t for t in times if t is not None), default=None)

    def unavailable(self, addresses: Sequence[str]) -> list[str]:
        """Why instance ``addresses`` could not serve a request now (empty:
        it could, or it is not known here): a rank down, or one whose
        control link is lost (liveness.unavailable)."""
        instance = self.instances.get(tuple(addresses))
        return [] if instance is None else liveness.unavailable(self, instance.ids)

    def watched(self) -> set[int]:
        """The ranks some tracked room was asked of: the only ones a
        heartbeat asks or judges (protocol/liveness.py)."""
        return set(self._rooms_of_rank)

    def owed(self) -> frozenset[WriterIdentity]:
        """The writers held rooms wait for (an exit check looks these up)."""
        return frozenset(self._owing)

    def probes(self, now: float) -> Probes:
        """What a :class:`Tick` at ``now`` needs looked up."""
        owed = self.owed() if now >= self._next_exit_check else frozenset()
        live: frozenset[WriterIdentity] = frozenset()
        if self.ranks and now >= self._next_heartbeat and self.endpoint_down is None:
            live = liveness.live(self)
        return Probes(tuple(self.draining.values()), owed, live)

    # -- bootstrap (protocol/bootstrap.py) -----------------------------------
    def begin_bootstrap(
        self,
        addresses: tuple[str, ...],
        hello: Hello,
        at: float,
        *,
        timeout_s: float,
        resend_interval_s: float,
    ) -> Instance:
        """Start bootstrapping the instance at ``addresses`` (``at``: on the
        clock its :class:`BootstrapTick` s will carry): feed them until one
        returns ``Bootstrapped`` or ``GiveUp`` (within ``timeout_s``);
        :meth:`forget_bootstrap` if it is left early."""
        return bootstrap.begin(self, addresses, hello, at, timeout_s, resend_interval_s)

    def unanswered(self, instance: Instance) -> list[str]:
        return bootstrap.unanswered(instance)

    def forget_bootstrap(self, instance: Instance) -> None:
        """``instance``'s bootstrap is over, kept or not: its later HelloAcks are heartbeats."""
        bootstrap.forget(self, instance)

    # -- the engine's requests -----------------------------------------------
    def open(
        self,
        room: int,
        pages: Sequence[int],
        instance: Instance,
        ranks: frozenset[int] | None,
        extras_slot: int | None,
        now: float,
    ) -> tuple[Request, list[Send]]:
        """A new request for ``room``: its TransferRequests, numbered (send
        them in this order before numbering more). Refused whole, with
        nothing recorded, by a :class:`~kvconn.errors.KvconnError`."""
        known = frozenset(range(len(instance.ids)))
        local = known if ranks is None else frozenset(ranks)
        if not local <= known:
            raise RequestError(f"unknown ranks {sorted(local - known)}", room)
        if not local:
            raise RequestError("a room needs at least one writing rank", room)
        drain.refuse_if_draining(self, instance.ids, room)
        if extras_slot is not None and not 0 <= extras_slot < self.num_slots:
            raise RequestError(f"extras slot {extras_slot} outside the layout's {self.num_slots} slots", room)
        pages = tuple(pages)
        bad = [p for p in pages if not 0 <= p < self.num_pages]
        if bad:
            raise PageError(f"pages {bad[:8]} outside 0..{self.num_pages - 1}", room)
        if len(set(pages)) != len(pages):
            twice = sorted(p for p, n in Counter(pages).items() if n > 1)
            raise PageError(f"pages {twice[:8]} given more than once", room)
        state = self.tracker.state(room)
        if state is not None:
            raise RoomInUseError(f"still tracked ({state.value}): its pages are not back yet", room)
        if self.check_pages and not self._in_use.isdisjoint(pages):
            taken = sorted(self._in_use.intersection(pages))
            raise PageInUseError(
                f"pages {taken[:8]} belong to another room not finished or released yet", room
            )
        ids = frozenset(instance.ids[r] for r in local)
        self._refuse_if_unavailable(ids, room)
        # Every refusal is behind us: from here on the request is recorded whole.
        self.tracker.open(room, pages, ids)
        if self.check_pages:
            self._in_use.update(pages)
        writers = {rank: self.writers[rank] for rank in ids}
        slot = 0 if extras_slot is None else extras_slot + 1
        request = self.requests[room] = Request(room, pages, writers, instance.ids, slot=slot)
        rooms_of_rank = self._rooms_of_rank
        for rank in ids:
            rooms_of_rank[rank] = rooms_of_rank.get(rank, 0) + 1
        if self.transfer_timeout_s is not None:
            self._deadline_seq += 1
            heapq.heappush(self._deadlines, (now + self.transfer_timeout_s, self._deadline_seq, request))
        ask = sorted(r for r in ids if r in self.unconfirmed)
        sends: list[Send] = []
        for rank in sorted(ids):
            if rank not in ask:
                message = self.transfer_request(request, writers[rank].session)
                sends.append(Send(writers[rank].address, message, rank))
        # Hellos (numbered after the requests: the runtime sends these in order)
        hellos = [a for a in liveness.ask_first(self, request, ask, now) if isinstance(a, Send)]
        return request, sends + hellos

    def transfer_request(self, request: Request, session: int) -> TransferRequest:
        """``request``'s TransferRequest for the rank process of ``session``,
        numbered: send it before numbering another."""
        self._seq += 1
        return TransferRequest(request.room, self.name, request.pages, session, self._seq, request.slot)

    def sent(self, request: Request, unsent: Sequence[int], now: float) -> list[Action]:
        """The runtime sent ``request``'s TransferRequests; those to ``unsent``
        ranks were dropped. Nothing re-sends a request, and a room not yet
        aborted has no deadline: it fails now, so the engine aborts it."""
        if unsent:
            request.fail(f"request to ranks {sorted(unsent)} dropped: send queue full")
        return []

    def _refuse_if_unavailable(self, ids: frozenset[int], room: int) -> None:
        """Nothing is asked of a rank known down, nor while this endpoint has
        no transport endpoint: such a room could only fail, and once asked its
        pages would wait for a proof from a writer decode cannot reach.
        Refused here, nothing was sent: the pages never left the engine."""
        if self.endpoint_down is not None:
            raise UnavailableError(
                f"decode has no transport endpoint since its owner fence ({self.endpoint_down}); "
                "it makes a new one on its own: retry later or recompute",
                room,
                cause="endpoint_down",
            )
        down = sorted(ids & self.down.keys()) if self.down else ()
        if down:
            reason = "; ".join(
                f"rank {self._rank_of[r][1]} ({self.writers[r].address}) is down: {self.down[r]}"
                for r in down
            )
            raise UnavailableError(f"{reason}; nothing was asked of it", room, cause="rank_down")

    def abort(self, request: Request, now: float) -> list[Action]:
        """The engine gave ``request`` up."""
        if request.aborted or request.finished or not self.current(request):
            return []  # its pages are the engine's already, or on their way back
        request.aborted = True
        # The engine's own verdict, even over a SUCCESS that raced it: its
        # pages come back through on_release, never through finish().
        request.verdict = KVPoll.FAILED
        return self._hold(request, now)

    def finish(self, request: Request) -> tuple[int, ...]:
        """The engine takes a completed request's pages."""
        if request.finished:
            raise FinishRefusedError("finish() was already called: its pages are the engine's", request.room)
        if request.aborted:
            raise FinishRefusedError("aborted: its pages come back through on_release", request.room)
        if request.verdict is not KVPoll.SUCCESS or not self.current(request):
            raise FinishRefusedError(f"not completed (poll() says {request.poll().name})", request.room)
        pages = self.tracker.finish(request.room)
        request.finished = True
        self._forget(request.room)
        return pages

    def begin_drain(
        self, now: float, grace_s: float, settle_s: float, at: float | None = None
    ) -> list[Action]:
        """Drain: refuse new requests, give the engine ``grace_s`` to finish
        its rooms (see protocol/drain.py); then :meth:`drain_tick` until it
        reports. ``at``: the time on the clock the drain's caller waits on
        (None: ``now``)."""
        return drain.begin_decode_drain(self, now, grace_s, settle_s, now if at is None else at)

    def drain_tick(
        self, now: float, at: float | None = None
    ) -> tuple[drain.DrainReport | None, list[Action]]:
        """(the drain's report, or None while it waits on; actions): aborts
        what the engine left once the grace ran out."""
        return drain.decode_drain_tick(self, now, now if at is None else at)

    # -- stimuli -------------------------------------------------------------
    def handle(self, stimulus: object, now: float) -> list[Action]:
        """Feed one stimulus in; carry out what comes back, in order. One
        dispatch by type (:data:`_HANDLERS`: a dict, as ``singledispatchmethod``
        builds a wrapper on every access, on every message)."""
        handler = _HANDLERS.get(type(stimulus))
        if handler is None:
            return [Drop(DropReason.UNEXPECTED_TYPE)]
        return handler(self, stimulus, now)

    def _on_abort_ack(self, msg: AbortAck, now: float) -> list[Action]:
        ack = self._for_us(msg)
        if isinstance(ack, DropReason):
            return [Drop(ack)]
        heard = liveness.hear(self, ack.rank, ack.session, now)
        if ack.closed:
            return [*heard, CheckDrain(ack)]
        return heard + self._ack(ack, now)

    def _on_undrained(self, event: Undrained, now: float) -> list[Action]:
        if event.drained:
            return self._ack(event.ack, now)
        key = (event.ack.room, event.ack.rank, event.ack.generation)
        if key not in self.draining and len(self.draining) >= self.MAX_DRAINING:
            return [Drop(DropReason.DRAIN_BACKLOG_FULL)]
        self.draining[key] = event.ack
        return []

    def _on_room_status(self, msg: RoomStatus, now: float) -> list[Action]:
        status = self._for_us(msg)
        if isinstance(status, DropReason):
            return [Drop(status)]
        heard = liveness.hear(self, status.rank, status.session, now)
        request = self.requests.get(status.room)
        if status.rank not in self.tracker.ranks_of(status.room) or request is None:
            return [*heard, Drop(DropReason.STRANGER_STATUS)]
        if status.outcome is RoomOutcome.SUCCESS:
            if self.tracker.succeeded(status.room, status.rank) and request.verdict is None:
                request.verdict = KVPoll.SUCCESS
        else:
            request.fail(status.reason)
        return heard

    def _on_rank_draining(self, msg: RankDraining, now: float) -> list[Action]:
        rank = self.id_of_session(msg.rank, msg.session) if msg.decode == self.name else None
        heard = liveness.hear(self, rank, msg.session, now) if rank is not None else []
        return heard + drain.rank_draining(self, msg, now)

    def _on_hello_ack(self, msg: HelloAck, now: float) -> list[Action]:
        instance = self.pending.get(msg.address)
        if instance is not None:
            if msg.error:
                instance.refusals[msg.address] = msg.error
                return [Answered(msg.address)]
            answer = instance.answers.get(msg.rank)
            if answer is not None and answer.address != msg.address:
                instance.refusals[msg.address] = f"rank {msg.rank} also claimed by {answer.address}"
                return [Answered(msg.address)]
            return [Identify(msg)]
        rank = self._id_at.get(msg.address)  # the endpoint-wide id of the rank there
        if rank is None:
            return [Drop(DropReason.STRANGER_HELLO)]
        if msg.rank != self._rank_of[rank][1]:
            return [Drop(DropReason.HELLO_ACK_CHANGED)]
        if msg.error or (rank, msg.session) in self._retired:
            reason = DropReason.HELLO_REFUSED if msg.error else DropReason.RETIRED_SESSION
            return [Drop(reason)]
        if msg.session == self.writers[rank].session:
            heard = liveness.heard_from(self, rank, now)
            if self.down.pop(rank, None) is None:
                return heard
            return heard + liveness.back_up(self, rank, now)
        return [Identify(msg)]

    def _on_identified(self, event: Identified, now: float) -> list[Action]:
        msg, writer = event.ack, event.writer
        instance = self.pending.get(msg.address)
        if instance is not None:
            known = instance.answers.get(msg.rank)
            if known is None:
                instance.answers[msg.rank] = writer
            elif known != writer:
                # The first identity stays: a later one could only make
                # another process's exit count as this writer's.
                return [Drop(DropReason.HELLO_ACK_CHANGED), Answered(msg.address)]
            return [Answered(msg.address)]
        rank = self._id_at.get(msg.address)
        if rank is None or msg.session == self.writers[rank].session:
            return []  # answered meanwhile
        # A new process at the rank's address, re-bootstrapped (it took our
        # Hello). Rooms the earlier one was asked to write keep needing its
        # proof (exit with drain, or quarantine); they fail now.
        old = self.writers[rank]
        self._retired.add((rank, old.session))
        self.writers[rank] = writer
        self._id_of_session.pop((msg.rank, old.session), None)
        self._id_of_session[msg.rank, msg.session] = rank
        self.down.pop(rank, None)
        reason = f"rank {msg.rank} restarted (a new process at {msg.address})"
        actions: list[Action] = [RankRestarted(rank, msg.rank, msg.address)]
        actions += self._fail_rooms_of(rank, old, reason, now)
        # Requests that waited to learn who answers there are the new one's.
        return actions + liveness.heard_from(self, rank, now)

    def _on_tick(self, event: Tick, now: float) -> list[Action]:
        actions: list[Action] = []
        for ack in event.drained:
            if self.draining.pop((ack.room, ack.rank, ack.generation), None) is not None:
                actions += self._ack(ack, now)
        actions += self.carry(self.tracker.tick(now))
        if now >= self._next_exit_check:
            self._next_exit_check = now + self.EXIT_CHECK_S
            actions += self._exits(event.gone, event.peers_drained, now)
        # Without a transport endpoint there is no metadata to Hello with,
        # and no room for a rank to write.
        if self.ranks and now >= self._next_heartbeat and self.endpoint_down is None:
            self._next_heartbeat = now + self.heartbeat_interval_s
            actions += liveness.heartbeat(self, event.gone, now)
        actions += self._expire(now)
        policy = self.owner_fence
        if not policy.enabled and policy.rearm_at is None:
            return actions  # no fence can be due: spare the walk of the quarantined rooms
        fence = policy.due(now, self.tracker.quarantined(), bool(self.pending))
        return actions if fence is None else [*actions, fence]

    def _on_links_changed(self, event: LinksChanged, now: float) -> list[Action]:
        return liveness.links_changed(self, event.changes, now)

    def _on_bootstrap_tick(self, event: BootstrapTick, now: float) -> list[Action]:
        return bootstrap.step(self, event.instance, now, now if event.at is None else event.at)

    def _on_exits_probed(self, event: ExitsProbed, now: float) -> list[Action]:
        return self._exits(event.gone, event.peers_drained, now)

    def _on_owner_fence_done(self, event: OwnerFenceDone, now: float) -> list[Action]:
        return owner_fenced(self, event, now)

    def _on_owner_fence_error(self, event: OwnerFenceError, now: float) -> list[Action]:
        self.owner_fence.ended(ok=False)  # nothing proven: every page stays held
        if self.endpoint_down is not None:  # asked again for the endpoint: ask later
            self.owner_fence.endpoint_made(False, now)
        return [OwnerFenced(False, name=self.name, reason=event.reason, endpoint=self.endpoint_down is None)]

    # -- internals -----------------------------------------------------------
    def _hello(self, instance: Instance) -> Hello:
        return bootstrap.hello(self, instance)

    def _for_us(self, msg: _R) -> _R | DropReason:
        """``msg`` with its rank as this endpoint's id, if it is for this
        endpoint from the rank process it asked (else why it is dropped). An ack names its rank as its own
        instance numbers it: the room's request says which instance. Another
        process at that rank's address (a restart) never wrote for us: its
        ack would skip the proof our own writer owes. An earlier decode at
        our address had rooms of the same ids: its SUCCESS would hand out
        pages a request of ours is about to write."""
        request = self.requests.get(msg.room)
        rank_id: int | None
        if request is not None:
            rank_id = request.ids[msg.rank] if 0 <= msg.rank < len(request.ids) else None
            writer = request.writers.get(rank_id) if rank_id is not None else None
        else:
            rank_id = self._id_of_session.get((msg.rank, msg.session))
            writer = self.writers.get(rank_id) if rank_id is not None else None
        if msg.decode != self.name:
            return DropReason.OTHER_DECODE
        if writer is None or rank_id is None or msg.session != writer.session:
            return DropReason.OTHER_SESSION
        # The first instance's ids are its ranks' own: no copy (on every ack and status).
        return msg if rank_id == msg.rank else attrs.evolve(msg, rank=rank_id)

    def _ack(self, ack: AbortAck, now: float) -> list[Action]:
        held_since = self.tracker.held_since(ack.room)
        actions = self.tracker.ack(ack, now)
        counted: list[Action] = []
        if not any(isinstance(a, Dropped) for a in actions):
            counted.append(AckCounted(ack.rank, None if held_since is None else now - held_since))
        return counted + self.carry(actions)

    def _exits(self, gone: frozenset[WriterIdentity], peers_drained: bool, now: float) -> list[Action]:
        return liveness.exits(self, gone, peers_drained, now)

    def _fail_rooms_of(self, rank: int, writer: WriterIdentity, reason: str, now: float) -> list[Action]:
        """Fail the open rooms ``writer`` was asked to write (not those still
        waiting to be sent to ``rank``: they were asked of nobody yet)."""
        actions: list[Action] = []
        for request in list(self.requests.values()):
            if rank in request.unsent:
                continue
            if request.writers.get(rank) == writer and request.verdict is None and not request.aborted:
                actions.append(RoomFailed(request.room, "rank"))
                actions += self._fail_and_abort(request, reason, now)
        return actions

    def id_of_session(self, rank: int, session: int) -> int | None:
        """The endpoint-wide id of the rank its instance numbers ``rank``,
        while the process of ``session`` is that rank's current one."""
        rank_id = self._id_of_session.get((rank, session))
        if rank_id is None or self.writers[rank_id].session != session:
            return None
        return rank_id

    def fail_and_abort(self, request: Request, reason: str, now: float) -> list[Action]:
        return self._fail_and_abort(request, reason, now)

    def _fail_and_abort(self, request: Request, reason: str, now: float) -> list[Action]:
        """FAILED to the engine, then the abort path: the pages are held
        until proof, never freed here."""
        if not self.current(request) or request.aborted or request.finished:
            return []
        request.fail(reason)
        request.aborted = True
        return self._hold(request, now)

    def _hold(self, request: Request, now: float) -> list[Action]:
        """The tracker holds ``request``'s pages until proof, from the ranks
        it was sent to only (one it never was can write nothing of it), or
        releases them at once if no rank owes one."""
        untold, request.unsent = frozenset(request.unsent), set()
        actions = self.tracker.abort(request.room, now, untold)
        if self.tracker.state(request.room) is HoldState.HELD and request.room not in self._held:
            self._held[request.room] = request
            owing = self._owing
            for writer in request.writers.values():
                owing[writer] = owing.get(writer, 0) + 1
        return self.carry(actions)

    def _expire(self, now: float) -> list[Action]:
        """Open rooms past their transfer deadline fail."""
        actions: list[Action] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self._deadlines)
            if request.verdict is None and not request.aborted:
                actions.append(RoomFailed(request.room, "deadline"))
                actions += self._fail_and_abort(
                    request, f"not complete within {self.transfer_timeout_s} s", now
                )
        return actions

    def carry(self, actions: Sequence[HoldAction]) -> list[Action]:
        """The tracker's actions for the runtime: an ABORT goes to its rank's
        address, and a released room leaves every table (a serving decode
        sees millions; its receivers keep what they need)."""
        out: list[Action] = []
        for action in actions:
            if isinstance(action, SendAbort):
                out.append(Send(self.writers[action.rank].address, action.abort, action.rank))
                continue
            if isinstance(action, Dropped):
                out.append(Drop(action.reason))
                continue
            if isinstance(action, Release):
                self._forget(action.room)
            out.append(action)
        return out

    def _forget(self, room: int) -> None:
        request = self.requests.pop(room, None)
        if request is None:
            return
        if self.check_pages:
            self._in_use.difference_update(request.pages)
        _uncount(self._rooms_of_rank, request.writers)
        if self._held.pop(room, None) is not None:
            _uncount(self._owing, request.writers.values())


def _uncount(counts: dict[_K, int], keys: Iterable[_K]) -> None:
    for key in keys:
        n = counts[key] - 1
        if n:
            counts[key] = n
        else:
            del counts[key]


#: EndpointState.handle's one dispatch: stimulus type -> handler.
_HANDLERS: dict[type, Callable[[EndpointState, Any, float], list[Action]]] = {
    AbortAck: EndpointState._on_abort_ack,
    Undrained: EndpointState._on_undrained,
    RoomStatus: EndpointState._on_room_status,
    RankDraining: EndpointState._on_rank_draining,
    HelloAck: EndpointState._on_hello_ack,
    Identified: EndpointState._on_identified,
    Tick: EndpointState._on_tick,
    LinksChanged: EndpointState._on_links_changed,
    BootstrapTick: EndpointState._on_bootstrap_tick,
    ExitsProbed: EndpointState._on_exits_probed,
    OwnerFenceDone: EndpointState._on_owner_fence_done,
    OwnerFenceError: EndpointState._on_owner_fence_error,
}


__all__ = ["EndpointState"]
