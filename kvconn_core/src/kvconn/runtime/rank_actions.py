"""How a prefill rank runs its state machine and carries out its actions.

:class:`RankActions` is a part of :class:`~kvconn.runtime.prefill.PrefillRank`
(which sets up what it declares). :meth:`RankActions.step` runs one stimulus
of :class:`~kvconn.protocol.rank.RankState` under the rank's lock and
carries out what it returns, dispatched by type in one place
(:meth:`RankActions._carry`): sends and counts at once, under the lock; the
engine's callback, plugin hooks, the writer's connect and the fence after
it. Nothing here decides anything.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvconn.config import Config
from kvconn.errors import KvconnError
from kvconn.layout import KVLayout
from kvconn.metrics import Metrics
from kvconn.protocol.drain import Announce
from kvconn.protocol.drops import DropReason
from kvconn.protocol.ledger import NotifyDecode, SendAck
from kvconn.protocol.messages import Abort, HelloAck, RankDraining
from kvconn.protocol.rank import (
    AbortHook,
    Action,
    AnswerHello,
    Bootstrap,
    Connect,
    Drop,
    Fence,
    GaveUp,
    RankState,
    Requested,
    SenderState,
    SendPlan,
)
from kvconn.runtime.control import Outbox
from kvconn.runtime.dispatch import ChunkHooks, HookManager
from kvconn.runtime.layout import pairing
from kvconn.runtime.sockets import fenced_connections, own_connections
from kvconn.runtime.tracing import NoTracer
from kvconn.transport import Writer

log = logging.getLogger("kvconn.runtime.prefill")

T = TypeVar("T")
#: What runs after the lock is let go (a hook, a callback, a thread's start).
Later = list[Callable[[], None]]
#: ABORTs whose arrival is remembered until their ack (the oldest dropped beyond).
_ABORTS_TIMED = 65536


class RankActions:
    """Runs stimuli and carries out actions for a prefill rank (see the module doc)."""

    rank: int
    address: str
    config: Config
    metrics: Metrics
    pm: HookManager
    _hooks: ChunkHooks
    writer: Writer
    layout: KVLayout | None
    source_bytes: int | None
    state: RankState[Any]
    clock: Callable[[], float]
    on_request: Callable[[int, int], None] | None
    _lock: threading.Lock
    _gate: Any  # transfer.FenceGate
    _outbox: Outbox
    _tracer: NoTracer
    _process: tuple[str, int, int]
    _poisoned_shown: int
    #: ``worker`` is set on a transfer worker's thread (it fences itself);
    #: ``settled_at``, when its last transport call (barrier, fence) ended.
    _thread: threading.local
    _abort_at: dict[tuple[str, int], float]

    def step(self, call: Callable[[RankState[Any], float], tuple[T, Sequence[Action]]]) -> T:
        """Run ``call(state, now)`` under the rank's lock and carry out the
        actions it returns: how a :class:`Sender` asks the state machine."""
        with self._lock:
            result, actions = call(self.state, self.clock())
            later = self._execute(actions)
        self._after(later)
        return result

    def commit_send(
        self, s: SenderState, src_pages: tuple[int, ...], last: bool, extras_slot: int | None
    ) -> SendPlan:
        """A sender's next chunk polled, planned and committed in one lock
        section (this is on every send): the plan to queue, or the refusal
        raised, having committed nothing."""
        with self._lock:
            plan, actions = self.state.plan_next(s, src_pages, last, self.clock(), extras_slot)
            if not isinstance(plan, KvconnError):
                self.state.commit_send(s, plan)
            later = self._execute(actions) if actions else None
        if later:
            self._after(later)
        if isinstance(plan, KvconnError):
            raise plan
        return plan

    def carry_out(self, actions: Sequence[Action]) -> None:
        """Carry out ``actions`` (with the rank's lock held, as :meth:`step` does)."""
        self._after(self._execute(actions))

    def _execute(self, actions: Sequence[Action]) -> Later:
        """(With the lock held.) Carry out what sends or counts; returns what
        must run once the lock is let go, for :meth:`_after`."""
        later: Later = []
        if actions:  # on every chunk: most carry none
            carry = self._carry
            for action in actions:
                carry(action, later)
        poisoned = self.state.ledger.poisoned_count()
        if poisoned != self._poisoned_shown:
            self._poisoned_shown = poisoned
            self.metrics.poisoned_rooms.set(poisoned)
        return later

    @staticmethod
    def _after(later: Later) -> None:
        for run in later:
            run()

    # -- the one dispatch ------------------------------------------------------
    def _carry(self, action: Action, later: Later) -> None:
        """Carry out one action: by its type, in one place (:data:`_CARRY`, a
        dict: ``singledispatchmethod`` builds a wrapper on every access, and
        this runs for every action of every message and chunk)."""
        carry = _CARRY.get(type(action))
        if carry is None:
            raise TypeError(f"no way to carry out {action!r}")
        carry(self, action, later)

    def _send_ack(self, action: SendAck, later: Later) -> None:
        if not self.config.acks_enabled:
            return
        ack = action.ack
        sending = self._tracer.now()  # before the send: decode may take it at once
        if self._outbox.send(action.reply_to, ack):
            self.metrics.acks_sent.inc()
            self._tracer.acked(ack, self.rank, sending)
            arrived = self._abort_at.pop((ack.decode, ack.room), None)
            if arrived is not None:
                # From the later of the ABORT's arrival and the end of this
                # thread's last transport call (a worker's barrier, a fence):
                # the wait for the chunk in flight is the transport's.
                since = max(arrived, getattr(self._thread, "settled_at", arrived))
                self.metrics.abort_own.observe(max(0.0, self.clock() - since))

    def _abort_arrived(self, abort: Abort, now: float) -> None:
        """An ABORT reached the handler at ``now`` (for kvconn_abort_ack_own_seconds)."""
        if not self.config.acks_enabled:
            return
        pending = self._abort_at
        if len(pending) >= _ABORTS_TIMED:  # acks that never come (a quarantine) leave entries
            del pending[next(iter(pending))]
        pending.setdefault((abort.decode, abort.room), now)

    def _notify_decode(self, action: NotifyDecode, later: Later) -> None:
        peer = self.state.peers.get(action.decode)
        sending = self._tracer.now()
        if peer is not None and self._outbox.send(peer.reply_to, action.status):
            self._tracer.notified(action.decode, action.status, sending)

    def _announce(self, action: Announce, later: Later) -> None:
        peer = self.state.peers.get(action.decode)
        if peer is not None:
            ledger = self.state.ledger
            notice = RankDraining(ledger.rank, ledger.session, action.decode, action.done, action.closed)
            self._outbox.send(peer.reply_to, notice)

    def _answer_hello(self, action: AnswerHello, later: Later) -> None:
        if action.error:
            log.warning("refusing bootstrap from %s: %s", action.hello.decode, action.error)
        session = self.state.ledger.session
        ack = HelloAck(self.rank, self.address, *self._process, action.error, session)
        self._outbox.send(action.hello.reply_to, ack)

    def _drop(self, action: Drop, later: Later) -> None:
        self._count_drop(action.reason)

    def _gave_up(self, action: GaveUp, later: Later) -> None:
        self.metrics.room_bootstrap_timeouts.inc()

    def _requested(self, action: Requested, later: Later) -> None:
        if self.on_request is not None:
            later.append(functools.partial(self.on_request, action.room, action.npages))

    def _bootstrap(self, action: Bootstrap, later: Later) -> None:
        later.append(functools.partial(self._pair, action))

    def _connect_later(self, action: Connect, later: Later) -> None:
        later.append(functools.partial(self._connect, action))

    def _abort_hook_or_ack(self, action: AbortHook, later: Later) -> None:
        if self._hooks.current().has_abort:
            later.append(functools.partial(self._abort_hook, action))
            return
        # No plugin implements on_abort_notification (nor watches hook
        # calls): calling it would do nothing, so the room is acked in this
        # same lock section, as if the hook had run, instead of in a second
        # step after it (one lock section and one wake-up less on every abort).
        for follow in self.state.abort_hooked(action.abort, raised=False):
            self._carry(follow, later)

    def _fence_action(self, action: Fence, later: Later) -> None:
        if getattr(self._thread, "worker", False):
            later.append(self._fence)  # a worker fences before it takes its next chunk
        else:
            # Off the listener's thread: the fence waits for running posts.
            thread = threading.Thread(target=self._fence, name=f"kvconn-fence-{self.rank}", daemon=True)
            later.append(thread.start)

    # -- what runs after the lock ------------------------------------------------
    def _pair(self, action: Bootstrap) -> None:
        found = pairing(self.layout, self.source_bytes, action.hello)
        self.step(lambda state, now: (None, state.bootstrap(action.hello, found)))

    def _connect(self, action: Connect) -> None:
        error = ""
        try:
            if action.reset:
                # Our connection to the decode that listened there may not
                # have been seen to close yet.
                self._outbox.reset(action.hello.reply_to)
            self.writer.connect(action.hello.decode, action.hello.metadata)
        except Exception as exc:
            error = str(exc) or type(exc).__name__
        self.step(lambda state, now: (None, state.connected(action, error)))

    def _abort_hook(self, action: AbortHook) -> None:
        raised = False
        try:
            self.pm.hook.on_abort_notification(abort=action.abort, known=action.known)
        except Exception as exc:
            self._plugin_error("on_abort_notification", exc)
            raised = True
        self.step(lambda state, now: (None, state.abort_hooked(action.abort, raised)))

    def _fence(self) -> None:
        """The writer's fence, once no worker is inside a post or barrier:
        the machine settles the rooms it proves, if any are poisoned still."""
        with self._gate.exclusive():
            with self._lock:
                rooms = self.state.fence_begins()
                if not rooms:
                    return
                contexts = self._tracer.contexts(rooms)
            with self._tracer.fence(contexts, len(rooms), self.rank) as traced:
                before = own_connections()
                try:
                    ok = self.pm.hook.on_fence() is True
                except Exception as exc:
                    self._plugin_error("on_fence", exc)
                    ok = False
                self.metrics.fences.labels("ok" if ok else "failed").inc()
                closed = fenced_connections(before) if ok else frozenset()
                if ok:
                    traced["result"] = "ok"
                    traced["closed"] = len(closed)
            # the fence's spans end before its acks go out (decode may release at once)
            self._thread.settled_at = self.clock()
            with self._lock:
                later = self._execute(self.state.fence_ended(ok, closed))
        self._after(later)

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


#: RankActions._carry's one dispatch: action type -> how it is carried out.
_CARRY: dict[type, Callable[[RankActions, Any, Later], None]] = {
    SendAck: RankActions._send_ack,
    NotifyDecode: RankActions._notify_decode,
    Announce: RankActions._announce,
    AnswerHello: RankActions._answer_hello,
    Drop: RankActions._drop,
    GaveUp: RankActions._gave_up,
    Requested: RankActions._requested,
    Bootstrap: RankActions._bootstrap,
    Connect: RankActions._connect_later,
    AbortHook: RankActions._abort_hook_or_ack,
    Fence: RankActions._fence_action,
}
