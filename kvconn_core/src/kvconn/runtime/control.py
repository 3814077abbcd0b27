"""The ZMQ control plane: one bound PULL socket per endpoint, read by its own
thread, and PUSH sockets to peers. Frames are decoded here; a frame that does
not decode, or a handler that raises, is counted and dropped: the listener
never dies of its input.

An outbox may keep its links alive and watched: ZMTP's own heartbeat
(``ZMQ_HEARTBEAT_IVL`` / ``_TIMEOUT``) pings each peer, and the peer's
libzmq I/O thread answers without the peer's Python; a ping unanswered for
the timeout drops the connection (the peer is stopped, gone or cut off).
The heartbeat runs on a probe connection of its own beside the one that
carries frames: dropping a connection loses what its kernel buffer still
held, and a TransferRequest lost so is never sent again (its room waited
for ever after a 0.5 s cut in 2 of 7 runs when the heartbeat ran on the
frames' connection; 0 of 10 with it apart). A connection attempt gives up
after half a second and is made again 0.1-0.2 s later
(``ZMQ_CONNECT_TIMEOUT``, ``RECONNECT_IVL_MAX``): a link lost to a
partition comes back within about 0.7 s of the heal, where the kernel's
SYN back-off waited up to half a minute. An
outbox that watches its links (decode's) has a socket monitor on each,
reporting a handshake done or a connection lost; the listener thread reads
those events (before the messages that came with them, and before its idle
call) and hands them to ``on_links``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvconn.protocol import wire
from kvconn.protocol.drops import DropReason
from kvconn.protocol.messages import Message

log = logging.getLogger(__name__)

Handler = Callable[[Message], None]
Idle = Callable[[], float | None]
#: (peer address, link up) in the order the monitors reported them.
LinkHandler = Callable[[list[tuple[str, bool]]], None]
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
# Plain ints: pyzmq's flag enums cost an enum construction on every ``&``
# and every ``getsockopt(EVENTS)``, twice per frame read (profiled: 30 of
# the ~450 Python calls per aborted room).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


class Listener:
    """Binds ``tcp://host:port`` (port 0: any free one) and calls ``handler``
    for every decoded message and ``idle`` between messages (after each
    batch, and when the wait it asked for is up). ``idle`` returns how many
    seconds the listener may sleep at most, or ``None``: until the next
    message. Without ``idle`` it sleeps until a message comes. :meth:`wake`
    (and :meth:`close`) end a sleep at once."""

    #: The first wait, before ``idle`` said anything.
    POLL_S = 0.05

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        handler: Handler,
        on_drop: Callable[[DropReason], None],
        key: bytes | None = None,
        idle: Idle | None = None,
        links: Outbox | None = None,
        on_links: LinkHandler | None = None,
    ) -> None:
        """``links``/``on_links``: the outbox whose links' monitors this
        thread reads, and what it hands their events to."""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME + wire.MAC_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        # A pair of in-process sockets ends the listener's sleep: it may
        # sleep until its next message, however long.
        wake_at = f"inproc://kvconn-wake-{id(self):x}"
        self._woken = self._ctx.socket(zmq.PAIR)
        self._woken.setsockopt(zmq.LINGER, 0)
        self._woken.bind(wake_at)
        self._waker = self._ctx.socket(zmq.PAIR)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.connect(wake_at)
        self._wake_lock = threading.Lock()
        self._handler = handler
        self._on_drop = on_drop
        self._key = key
        self._idle = idle
        self._links = links
        self._on_links = on_links
        if links is not None:
            links.on_monitors_changed = self.wake
        self._versions_seen: set[str] = set()  # wire versions of dropped frames, logged once each
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvconn-listen-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """End the listener's sleep now: it calls ``idle`` again."""
        with self._wake_lock:
            if not self._waker.closed:
                with contextlib.suppress(zmq.Again):  # a wake-up is pending already
                    self._waker.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread.ident is not None:  # an endpoint that failed to start closes it unstarted
            self._thread.join(timeout=5)
        self._sock.close()
        with self._wake_lock:
            self._waker.close()
        self._woken.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._woken, zmq.POLLIN)
        monitors: dict[zmq.Socket[bytes], str] = {}
        seen = -1
        timeout: float | None = self.POLL_S
        while not self._stop.is_set():
            if self._links is not None and self._links.monitors_version != seen:
                seen, current = self._links.monitors()
                for mon in set(monitors) - set(current):
                    poller.unregister(mon)
                for mon in set(current) - set(monitors):
                    poller.register(mon, zmq.POLLIN)
                monitors = current
            # zmq polls in whole ms: rounding a 0.3 ms wait down to 0 would
            # spin until the deadline
            ready = dict(poller.poll(None if timeout is None else math.ceil(timeout * 1000)))
            changes = [c for mon, at in monitors.items() if mon in ready for c in _link_events(mon, at)]
            if changes:
                self._links_changed(changes)
            if self._woken in ready:
                for _ in _frames(self._woken):
                    pass  # wake-ups carry nothing
            # Every frame that arrived is read before the idle call, which
            # judges silence: a busy moment of this thread blames no peer.
            for frame in _frames(self._sock):
                self.deliver(frame)
            timeout = None
            if self._idle is not None:
                try:
                    wait = self._idle()
                except Exception:
                    log.exception("kvconn idle handler raised")
                    self._on_drop(DropReason.IDLE_ERROR)
                    wait = self.POLL_S
                timeout = None if wait is None else max(0.0, wait)

    def _links_changed(self, changes: list[tuple[str, bool]]) -> None:
        if self._on_links is None:
            return
        try:
            self._on_links(changes)
        except Exception:
            log.exception("kvconn handler raised on link events")
            self._on_drop(DropReason.HANDLER_ERROR)

    def deliver(self, frame: bytes) -> None:
        """Decode and handle one frame; never raises."""
        try:
            message = wire.decode(frame, self._key)
        except wire.FrameError as exc:
            self._on_drop(exc.reason)
            if exc.reason is DropReason.BAD_VERSION and exc.detail not in self._versions_seen:
                # once per version: a peer of another version sends nothing else
                self._versions_seen.add(exc.detail)
                log.warning(
                    "kvconn dropping frames of wire version %s: this side speaks wire version %d",
                    exc.detail,
                    wire.VERSION,
                )
            return
        try:
            self._handler(message)
        except Exception:
            log.exception("kvconn handler raised on %s", type(message).__name__)
            self._on_drop(DropReason.HANDLER_ERROR)


class Outbox:
    """PUSH sockets to peers, one per address, each used under its own lock
    (ZMQ sockets are not thread-safe).

    ``send`` never blocks and never raises on a peer's account: its callers
    hold the endpoint's lock (a worker, between two transfers). A frame for
    an address that is no ZMQ endpoint, or for a peer with ``queue_limit``
    frames waiting, is dropped, counted through ``on_drop``, and ``send``
    says False. A live peer never has that many: it gets frames only for
    rooms it asked for (or, at decode, rooms it is writing), and pages bound
    those. A lost frame never releases pages: decode re-sends ABORTs once a
    room is quarantined, and fails a room whose request it could not send;
    a lost room status leaves that room waiting at decode for the engine's
    own timeout.
    """

    #: Frames queued for one peer before its frames are dropped.
    QUEUE_LIMIT = 100_000
    #: A connection attempt that has not completed in this long is given up
    #: (ZMQ_CONNECT_TIMEOUT) and made again after RECONNECT_MAX_S (libzmq
    #: adds up to as much again at random), never backed off further: after
    #: a partition heals, each link's next SYN is at most ~0.7 s away. The
    #: links of a pair cycle apart, and a page waits for the slowest:
    #: decode's frames, decode's probe and the rank's frames to decode. A
    #: 30 s cut's pages came back 0.17-1.02 s after the heal (10 runs), where
    #: 1 s and 1 s gave 0.97-1.88 s. Not shorter: an attempt whose I/O
    #: thread waits longer than this for a CPU gives up a connection made.
    CONNECT_TIMEOUT_S = 0.5
    RECONNECT_MAX_S = 0.1

    def __init__(
        self,
        key: bytes | None = None,
        on_drop: Callable[[DropReason], None] = lambda _: None,
        queue_limit: int = 0,
        stalled_after_s: float | None = None,
        heartbeat: tuple[float, float] | None = None,
        watch: bool = False,
    ) -> None:
        """``stalled_after_s``: a connection whose sent bytes stay unacked
        this long is dropped (``TCP_USER_TIMEOUT``) and made anew. After a
        partition, TCP retransmits only at its backed-off timer, up to 2
        minutes apart: a 30 s cut measured 23 s from the heal to the first
        frame through, against 1 s with a fresh connection. Frames still in
        the dropped connection's kernel buffer are lost: endpoints pass twice
        ``Config.peer_timeout_s``, by when a partition has made decode call
        the rank down and fail its rooms, and the protocol sends again
        whatever else it needs (Hellos each heartbeat, ABORTs while held).
        ``heartbeat``: (interval, timeout) in seconds of each link's ZMTP
        heartbeat (decode's: liveness reads its links by it), and ``watch``:
        a monitor on each link (:meth:`monitors`); both on a probe
        connection that carries no frames."""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._key = key
        self._on_drop = on_drop
        self._queue_limit = queue_limit or self.QUEUE_LIMIT
        self._stalled_after_ms = None if stalled_after_s is None else max(1, round(stalled_after_s * 1000))
        self._heartbeat = heartbeat
        self._watch = watch
        self._lock = threading.Lock()
        self._socks: dict[str, tuple[threading.Lock, zmq.Socket[bytes]]] = {}
        #: Each link's probe connection (heartbeat and monitor), by address.
        self._probes: dict[str, zmq.Socket[bytes]] = {}
        #: Each link's monitor socket (read by one listener thread only), and
        #: a count that changes whenever one is added or removed.
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._retired: list[zmq.Socket[bytes]] = []
        self.monitors_version = 0
        #: Called once a monitor was added or removed: the listener that
        #: reads them (and may sleep until its next deadline) wakes to.
        self.on_monitors_changed: Callable[[], None] | None = None

    def send(self, address: str, message: Message) -> bool:
        """Queue ``message`` for ``address``; False if it was dropped."""
        frame = wire.encode(message, self._key)
        entry = self._socket(address)
        if entry is None:
            return False
        lock, sock = entry
        with lock:
            try:
                sock.send(frame, _NOBLOCK, copy=True)
            except zmq.Again:
                self._on_drop(DropReason.SEND_QUEUE_FULL)
                return False
        return True

    def reachable(self, address: str) -> bool:
        """``address`` is a ZMQ endpoint this outbox can send to (connecting
        to it now, as the first send would)."""
        return self._socket(address, count=False) is not None

    def _socket(self, address: str, count: bool = True) -> tuple[threading.Lock, zmq.Socket[bytes]] | None:
        with self._lock:
            entry = self._socks.get(address)
            if entry is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 2000)
                sock.setsockopt(zmq.SNDHWM, self._queue_limit)
                if self._stalled_after_ms is not None:
                    sock.setsockopt(zmq.TCP_MAXRT, self._stalled_after_ms)
                    sock.setsockopt(zmq.CONNECT_TIMEOUT, round(self.CONNECT_TIMEOUT_S * 1000))
                    sock.setsockopt(zmq.RECONNECT_IVL_MAX, round(self.RECONNECT_MAX_S * 1000))
                try:
                    sock.connect(address)
                except zmq.ZMQError:
                    sock.close(linger=0)
                    if count:
                        self._on_drop(DropReason.UNSENDABLE_ADDRESS)
                    return None
                entry = self._socks[address] = (threading.Lock(), sock)
                if self._watch or self._heartbeat is not None:
                    self._probe(address)
            return entry

    def _probe(self, address: str) -> None:
        """The probe connection to ``address`` (lock held): the heartbeat's
        and the monitor's, never a frame's."""
        probe = self._ctx.socket(zmq.PUSH)
        probe.setsockopt(zmq.LINGER, 0)
        probe.setsockopt(zmq.CONNECT_TIMEOUT, round(self.CONNECT_TIMEOUT_S * 1000))
        probe.setsockopt(zmq.RECONNECT_IVL_MAX, round(self.RECONNECT_MAX_S * 1000))
        if self._heartbeat is not None:
            interval, timeout = self._heartbeat
            probe.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(interval * 1000)))
            probe.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, round(timeout * 1000)))
        monitor = probe.get_monitor_socket(_LINK_EVENTS) if self._watch else None  # before connect()
        probe.connect(address)  # the frames' socket connected to it: a valid address
        self._probes[address] = probe
        if monitor is not None:
            self._monitors[monitor] = address
            self.monitors_version += 1
            if self.on_monitors_changed is not None:
                self.on_monitors_changed()

    def monitors(self) -> tuple[int, dict[zmq.Socket[bytes], str]]:
        """(version, each link's monitor socket and its address): for the one
        listener thread that reads them."""
        with self._lock:
            return self.monitors_version, dict(self._monitors)

    def reset(self, address: str) -> None:
        """Forget the socket to ``address``: the next send opens a new
        connection. For a new peer at an address an earlier peer had: the
        earlier connection may not have been seen to close yet, and a frame
        written into it is lost with it (nothing re-sends a HelloAck)."""
        with self._lock:
            entry = self._socks.pop(address, None)
            probe = self._probes.pop(address, None)
            if probe is not None:
                _close_probe(probe)
            for monitor, at in list(self._monitors.items()):
                if at == address:  # the listener stops reading it; closed with the outbox
                    del self._monitors[monitor]
                    self._retired.append(monitor)
                    self.monitors_version += 1
                    if self.on_monitors_changed is not None:
                        self.on_monitors_changed()
        if entry is not None:
            lock, sock = entry
            with lock:
                sock.close(linger=0)

    def close(self) -> None:
        """Close every link (stop the listener reading the monitors first)."""
        with self._lock:
            # Probes before their monitors' readers: see _close_probe.
            for probe in self._probes.values():
                _close_probe(probe)
            self._probes.clear()
            for monitor in [*self._monitors, *self._retired]:
                monitor.close(linger=0)
            self._monitors.clear()
            self._retired.clear()
            self.monitors_version += 1
            for lock, sock in self._socks.values():
                with lock:
                    sock.close()
            self._socks.clear()


def _close_probe(probe: zmq.Socket[bytes]) -> None:
    """Stop ``probe``'s monitor, then close it. libzmq's I/O thread writes a
    monitor's events with a blocking send: an event for a monitor whose
    reading socket is closed (the peer went as the outbox closed) blocks
    that thread for good, and with it every ZMQ socket of the process. Once
    ``disable_monitor`` returns no event is written, so the reader may then
    close."""
    with contextlib.suppress(zmq.ZMQError):  # no monitor on it (watch=False)
        probe.disable_monitor()
    probe.close(linger=0)


def _frames(sock: zmq.Socket[bytes]) -> Iterator[bytes]:
    """Every frame waiting on ``sock``, read while ZMQ_EVENTS says one is
    there: a recv that raises zmq.Again to end the batch costs more than the
    check."""
    while int(sock.getsockopt(_EVENTS)) & _POLLIN:
        try:
            yield sock.recv(_NOBLOCK, copy=True)
        except zmq.Again:
            return


def _link_events(monitor: zmq.Socket[bytes], address: str) -> list[tuple[str, bool]]:
    """The events ``monitor`` holds now: (address, up) for each."""
    changes: list[tuple[str, bool]] = []
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return changes
        except zmq.ZMQError:  # closed under us (the outbox closed): nothing more to read
            return changes
        changes.append((address, event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED))
