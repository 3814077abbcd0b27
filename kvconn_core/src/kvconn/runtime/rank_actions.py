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
from kvconn.layout import KVLayout
from kvconn.metrics import Metrics
from kvconn.protocol.drain import Announce
from kvconn.protocol.drops import DropReason
from kvconn.protocol.ledger import NotifyDecode, SendAck
from kvconn.protocol.messages import HelloAck, RankDraining
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
)
from kvconn.runtime.control import Outbox
from kvconn.runtime.dispatch import HookManager
from kvconn.runtime.layout import pairing
from kvconn.runtime.sockets import own_connections
from kvconn.runtime.tracing import NoTracer
from kvconn.transport import Writer

log = logging.getLogger("kvconn.runtime.prefill")

T = TypeVar("T")
#: What runs after the lock is let go (a hook, a callback, a thread's start).
Later = list[Callable[[], None]]


class RankActions:
    """Runs stimuli and carries out actions for a prefill rank (see the module doc)."""

    rank: int
    address: str
    config: Config
    metrics: Metrics
    pm: HookManager
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
    #: ``worker`` is set on a transfer worker's thread (it fences itself).
    _thread: threading.local

    def step(self, call: Callable[[RankState[Any], float], tuple[T, Sequence[Action]]]) -> T:
        """Run ``call(state, now)`` under the rank's lock and carry out the
        actions it returns: how a :class:`Sender` asks the state machine."""
        with self._lock:
            result, actions = call(self.state, self.clock())
            later = self._execute(actions)
        self._after(later)
        return result

    def commit(self, call: Callable[[RankState[Any]], Sequence[Action]]) -> None:
        """:meth:`step` for a stimulus that needs no clock (a send's commit,
        on every chunk)."""
        with self._lock:
            later = self._execute(call(self.state))
        self._after(later)

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
    @functools.singledispatchmethod
    def _carry(self, action: object, later: Later) -> None:
        raise TypeError(f"no way to carry out {action!r}")

    @_carry.register
    def _(self, action: SendAck, later: Later) -> None:
        if not self.config.acks_enabled:
            return
        sending = self._tracer.now()  # before the send: decode may take it at once
        if self._outbox.send(action.reply_to, action.ack):
            self.metrics.acks_sent.inc()
            self._tracer.acked(action.ack, self.rank, sending)

    @_carry.register
    def _(self, action: NotifyDecode, later: Later) -> None:
        peer = self.state.peers.get(action.decode)
        sending = self._tracer.now()
        if peer is not None and self._outbox.send(peer.reply_to, action.status):
            self._tracer.notified(action.decode, action.status, sending)

    @_carry.register
    def _(self, action: Announce, later: Later) -> None:
        peer = self.state.peers.get(action.decode)
        if peer is not None:
            ledger = self.state.ledger
            notice = RankDraining(ledger.rank, ledger.session, action.decode, action.done, action.closed)
            self._outbox.send(peer.reply_to, notice)

    @_carry.register
    def _(self, action: AnswerHello, later: Later) -> None:
        if action.error:
            log.warning("refusing bootstrap from %s: %s", action.hello.decode, action.error)
        session = self.state.ledger.session
        ack = HelloAck(self.rank, self.address, *self._process, action.error, session)
        self._outbox.send(action.hello.reply_to, ack)

    @_carry.register
    def _(self, action: Drop, later: Later) -> None:
        self._count_drop(action.reason)

    @_carry.register
    def _(self, action: GaveUp, later: Later) -> None:
        self.metrics.room_bootstrap_timeouts.inc()

    @_carry.register
    def _(self, action: Requested, later: Later) -> None:
        if self.on_request is not None:
            later.append(functools.partial(self.on_request, action.room, action.npages))

    @_carry.register
    def _(self, action: Bootstrap, later: Later) -> None:
        later.append(functools.partial(self._pair, action))

    @_carry.register
    def _(self, action: Connect, later: Later) -> None:
        later.append(functools.partial(self._connect, action))

    @_carry.register
    def _(self, action: AbortHook, later: Later) -> None:
        later.append(functools.partial(self._abort_hook, action))

    @_carry.register
    def _(self, action: Fence, later: Later) -> None:
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
                closed = before - own_connections() if ok else frozenset()
                if ok:
                    traced["result"] = "ok"
                    traced["closed"] = len(closed)
            # the fence's spans end before its acks go out (decode may release at once)
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
