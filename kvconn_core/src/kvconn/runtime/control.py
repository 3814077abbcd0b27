"""The ZMQ control plane: one bound PULL socket per endpoint, read by its own
thread, and PUSH sockets to peers. Frames are decoded here; a frame that does
not decode, or a handler that raises, is counted and dropped: the listener
never dies of its input."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable

import zmq

from kvconn.protocol import wire
from kvconn.protocol.drops import DropReason
from kvconn.protocol.messages import Message

log = logging.getLogger(__name__)

Handler = Callable[[Message], None]
Idle = Callable[[], float | None]


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
    ) -> None:
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
        self._thread.join(timeout=5)
        self._sock.close()
        with self._wake_lock:
            self._waker.close()
        self._woken.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._woken, zmq.POLLIN)
        timeout: float | None = self.POLL_S
        while not self._stop.is_set():
            # zmq polls in whole ms: rounding a 0.3 ms wait down to 0 would
            # spin until the deadline
            ready = poller.poll(None if timeout is None else math.ceil(timeout * 1000))
            for sock, _ in ready:
                # Read while ZMQ_EVENTS says a frame is there: a recv that
                # raises zmq.Again to end the batch costs more than the check.
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    try:
                        frame = sock.recv(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    if sock is self._sock:
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
    #: and tried again (ZMQ_CONNECT_TIMEOUT), at most this often once failing.
    CONNECT_TIMEOUT_S = 1.0
    RECONNECT_MAX_S = 1.0

    def __init__(
        self,
        key: bytes | None = None,
        on_drop: Callable[[DropReason], None] = lambda _: None,
        queue_limit: int = 0,
        stalled_after_s: float | None = None,
    ) -> None:
        """``stalled_after_s``: a connection whose sent bytes stay unacked
        this long is dropped (``TCP_USER_TIMEOUT``) and made anew. After a
        partition, TCP retransmits only at its backed-off timer, up to 2
        minutes apart: a 30 s cut measured 23 s from the heal to the first
        frame through, against 1 s with a fresh connection. Frames still in
        the dropped connection's kernel buffer are lost; the protocol sends
        again whatever it needs (Hellos each heartbeat, ABORTs while held),
        and a partition that long has already made decode call the rank
        down. Endpoints pass ``Config.peer_timeout_s``."""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._key = key
        self._on_drop = on_drop
        self._queue_limit = queue_limit or self.QUEUE_LIMIT
        self._stalled_after_ms = None if stalled_after_s is None else max(1, round(stalled_after_s * 1000))
        self._lock = threading.Lock()
        self._socks: dict[str, tuple[threading.Lock, zmq.Socket[bytes]]] = {}

    def send(self, address: str, message: Message) -> bool:
        """Queue ``message`` for ``address``; False if it was dropped."""
        frame = wire.encode(message, self._key)
        entry = self._socket(address)
        if entry is None:
            return False
        lock, sock = entry
        with lock:
            try:
                sock.send(frame, zmq.NOBLOCK, copy=True)
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
            return entry

    def reset(self, address: str) -> None:
        """Forget the socket to ``address``: the next send opens a new
        connection. For a new peer at an address an earlier peer had: the
        earlier connection may not have been seen to close yet, and a frame
        written into it is lost with it (nothing re-sends a HelloAck)."""
        with self._lock:
            entry = self._socks.pop(address, None)
        if entry is not None:
            lock, sock = entry
            with lock:
                sock.close(linger=0)

    def close(self) -> None:
        with self._lock:
            for lock, sock in self._socks.values():
                with lock:
                    sock.close()
            self._socks.clear()
