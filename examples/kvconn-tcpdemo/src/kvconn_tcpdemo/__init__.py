"""``tcpdemo``: a kvconn transport over plain TCP sockets.

The page owner (decode) keeps its pages in a ``bytearray``, or in the
engine's own buffers (``register_region``: per-layer tensors, arrays), and
runs a receiver thread per connection that copies incoming write frames
straight into them. A writer sends from its ``bytearray`` or from the
engine's buffers (``register_writer``), without a copy either way. A writer (prefill rank) streams frames from a sender thread and
counts the receiver's per-segment acks. Written only against kvconn's public
API: :mod:`kvconn.transport`, :mod:`kvconn.hookspecs`, :mod:`kvconn.chunk`,
:mod:`kvconn.buffers`.

Wire: ``!BQQQ`` header (kind, id, offset, length), then ``length`` bytes for
a WRITE; the receiver answers ``!BQ`` (kind, id) after applying a frame.
TCP keeps a connection's frames in order, which makes the fence simple: stop
the sender between frames, drop what it has not started, send FENCE and wait
for its ack. Every earlier frame on that connection was applied before it,
and nothing else will ever be sent: no byte posted before the fence can land.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import json
import queue
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence

from kvconn.buffers import Buffer
from kvconn.chunk import Chunk, Segment
from kvconn.hookspecs import hookimpl
from kvconn.options import BackendOptions
from kvconn.transport import Capabilities, Settlement

HEADER = struct.Struct("!BQQQ")
ACK = struct.Struct("!BQ")
WRITE, FENCE = 1, 2
FENCE_TIMEOUT_S = 5.0


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on EOF."""
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


class _Memory:
    """Memory as one offset space: a ``bytearray`` of our own, or the
    engine's buffers end to end (a range never spans two)."""

    def __init__(self, source: int | Sequence[Buffer]) -> None:
        if isinstance(source, int):
            self._own: bytearray | None = bytearray(max(source, 1))
            self._views = [memoryview(self._own)]
            self.sizes = [source]
        else:
            # The engine keeps its memory alive; a Buffer's owner is referenced here too.
            self._own, self._buffers = None, list(source)
            self._views = [
                memoryview((ctypes.c_char * b.nbytes).from_address(b.address)).cast("B") for b in source
            ]
            self.sizes = [b.nbytes for b in source]
        self.starts = list(itertools.accumulate([0, *self.sizes[:-1]]))
        self.nbytes = sum(self.sizes)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The bytes at ``offset``, in place; ValueError outside or across buffers."""
        i = _buffer_of(self.starts, self.sizes, offset, nbytes)
        at = offset - self.starts[i]
        return self._views[i][at : at + nbytes]


def _buffer_of(starts: Sequence[int], sizes: Sequence[int], offset: int, nbytes: int) -> int:
    i = bisect.bisect_right(starts, offset) - 1
    if offset < 0 or nbytes < 0 or i < 0 or offset + nbytes > starts[i] + sizes[i]:
        raise ValueError(f"range [{offset}, {offset + nbytes}) lies outside one buffer of {sizes}")
    return i


class TcpRegion:
    """Decode's pages, and the receiver that writes into them."""

    def __init__(self, source: int | Sequence[Buffer]) -> None:
        self._mem = _Memory(source)
        self.nbytes = self._mem.nbytes
        # Loopback only: hence cross_host=False. Across hosts this would bind
        # the address a `host` option names, and the metadata would carry it
        # (README, "Across hosts").
        self._server = socket.create_server(("127.0.0.1", 0))
        host, port = self._server.getsockname()[:2]
        info = {"host": host, "port": port, "nbytes": self.nbytes, "sizes": self._mem.sizes}
        self.metadata = json.dumps(info).encode()
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tcpdemo-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="tcpdemo-recv").start()

    def _serve(self, conn: socket.socket) -> None:
        header = bytearray(HEADER.size)
        try:
            while _recv_exact(conn, memoryview(header)):
                kind, ident, offset, length = HEADER.unpack(header)
                if kind == WRITE:
                    try:
                        target = self._mem.view(offset, length)
                    except ValueError:
                        return  # a broken writer: drop the connection
                    if not _recv_exact(conn, target):
                        return
                elif kind != FENCE:
                    return
                conn.sendall(ACK.pack(kind, ident))
        except OSError:
            return
        finally:
            conn.close()

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self._mem.view(offset, nbytes))

    def write(self, offset: int, data: bytes) -> None:
        self._mem.view(offset, len(data))[:] = data

    def close(self) -> None:
        self._server.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


class _Handle:
    """One posted chunk: done once every segment was acked."""

    def __init__(self, segments: int) -> None:
        self.left = segments
        self.done = threading.Event()
        self.error: str | None = None
        if segments == 0:
            self.done.set()


class _Connection:
    """A writer's connection to one page owner: a sender and an ack reader."""

    def __init__(self, metadata: bytes, src: _Memory) -> None:
        info = json.loads(metadata)
        self.nbytes = int(info["nbytes"])
        self.sizes = [int(n) for n in info.get("sizes", [self.nbytes])]
        self.starts = list(itertools.accumulate([0, *self.sizes[:-1]]))
        self.sock = socket.create_connection((info["host"], info["port"]), timeout=10)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._src = src
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, _Handle] = {}
        self._fences: dict[int, threading.Event] = {}
        threading.Thread(target=self._read_acks, daemon=True, name="tcpdemo-acks").start()
        self._start_sender()

    def post(self, segments: Sequence[Segment]) -> _Handle:
        handle = _Handle(len(segments))
        for seg in segments:
            with self._lock:
                ident = next(self._ids)
                self._pending[ident] = handle
            self._jobs.put((ident, seg))
        return handle

    def fence(self) -> bool:
        self._stop_sender()
        with self._lock:
            ident = next(self._ids)
            event = self._fences[ident] = threading.Event()
        try:
            self.sock.sendall(HEADER.pack(FENCE, ident, 0, 0))
        except OSError:
            return False
        ok = event.wait(FENCE_TIMEOUT_S)
        self._start_sender()
        return ok

    def close(self) -> None:
        self._stop_sender()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    # -- threads -------------------------------------------------------------
    def _start_sender(self) -> None:
        self._stop = threading.Event()
        self._jobs: queue.Queue[tuple[int, Segment] | None] = queue.Queue()
        self._sender = threading.Thread(
            target=self._send, args=(self._jobs, self._stop), daemon=True, name="tcpdemo-send"
        )
        self._sender.start()

    def _stop_sender(self) -> None:
        self._stop.set()
        self._jobs.put(None)
        self._sender.join()
        # Never started: nothing of these frames was sent, nothing can land.
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._settle(job[0], "fenced before sending")

    def _send(self, jobs: queue.Queue[tuple[int, Segment] | None], stop: threading.Event) -> None:
        while not stop.is_set():
            job = jobs.get()
            if job is None or stop.is_set():
                if job is not None:
                    self._settle(job[0], "fenced before sending")
                return
            ident, seg = job
            try:
                self.sock.sendall(HEADER.pack(WRITE, ident, seg.dst, seg.nbytes))
                self.sock.sendall(self._src.view(seg.src, seg.nbytes))
            except OSError:
                return  # the ack reader fails the pending handles

    def _read_acks(self) -> None:
        buf = bytearray(ACK.size)
        try:
            while _recv_exact(self.sock, memoryview(buf)):
                kind, ident = ACK.unpack(buf)
                if kind == FENCE:
                    with self._lock:
                        event = self._fences.pop(ident, None)
                    if event is not None:
                        event.set()
                else:
                    self._settle(ident, None)
        except OSError:
            pass
        # Connection gone: pending writes are unsettled (bytes may have landed);
        # their barriers time out and the core poisons the rooms.

    def _settle(self, ident: int, error: str | None) -> None:
        with self._lock:
            handle = self._pending.pop(ident, None)
        if handle is None:
            return
        if error is not None:
            handle.error = error
        handle.left -= 1
        if handle.left == 0:
            handle.done.set()


class TcpWriter:
    """A prefill rank's source memory and its connections."""

    def __init__(self, source: int | Sequence[Buffer]) -> None:
        self._src = _Memory(source)
        self.nbytes = self._src.nbytes
        self._conns: dict[str, _Connection] = {}
        self._metadata: dict[str, bytes] = {}

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self._src.view(offset, nbytes))

    def write(self, offset: int, data: bytes) -> None:
        self._src.view(offset, len(data))[:] = data

    def connect(self, peer: str, metadata: bytes) -> None:
        old = self._conns.pop(peer, None)
        if old is not None:
            old.close()
        self._conns[peer] = _Connection(metadata, self._src)
        self._metadata[peer] = metadata

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> _Handle:
        conn = self._conns[chunk.peer]
        for seg in segments:
            # each segment inside one buffer on both sides (raises otherwise)
            _buffer_of(self._src.starts, self._src.sizes, seg.src, seg.nbytes)
            _buffer_of(conn.starts, conn.sizes, seg.dst, seg.nbytes)
        return conn.post(segments)

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: _Handle, deadline: float) -> Settlement:
        if not posted.done.wait(max(0.0, deadline - time.monotonic())):
            return Settlement.UNSETTLED
        return Settlement.LANDED if posted.error is None else Settlement.FAILED_SETTLED

    @hookimpl
    def on_fence(self) -> bool | None:
        ok = all([conn.fence() for conn in list(self._conns.values())])
        return True if ok else None


class TcpBackend:
    name = "tcpdemo"
    capabilities = Capabilities(
        writer_fence=True,
        memory=frozenset({"dram"}),
        # Claiming it takes a `host` option bound by the region, host_options
        # = {"host": "{ip}"} and `kvconn conformance tcpdemo --cross-host`
        # passing (README, "Across hosts").
        cross_host=False,
        notes="tutorial transport: TCP frames applied by a receiver thread in the page owner",
    )

    def capabilities_for(self, options: Mapping[str, str]) -> Capabilities:
        # asked before any process starts: a stray option fails there, once
        BackendOptions(self.name, options, known=())
        return self.capabilities

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> TcpRegion:
        BackendOptions(self.name, options, known=())  # this transport takes none
        return TcpRegion(nbytes)

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> TcpWriter:
        BackendOptions(self.name, options, known=())
        return TcpWriter(nbytes)

    def register_region(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> TcpRegion:
        """Decode's pages in the engine's buffers (host memory): received in place."""
        BackendOptions(self.name, options, known=())
        return TcpRegion(buffers)

    def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> TcpWriter:
        """A prefill rank sending straight from the engine's buffers."""
        BackendOptions(self.name, options, known=())
        return TcpWriter(buffers)


backend = TcpBackend()
