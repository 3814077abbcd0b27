"""``liar-net``: a transport that crosses hosts, written as the plugin guide
tells an author to (docs/writing-a-transport-plugin.md): a backend object
with its capabilities and ``host_options``, options read with
:class:`kvconn.options.BackendOptions`, decode's pages in the page owner's
memory behind a listening TCP socket (a receiver thread per connection
copies write frames straight into them and acks each write), a sender
thread per peer on the writer's side, and a fence that stops the senders
and resets their connections inside
:func:`kvconn.sockets.resetting_closed_sockets`.

Honest with no lie switched on. Each option below (``1``) tells one lie,
each of which a check passed by having nothing at stake before (issue 44):

``fence_one``
    the fence is honest while at most one write is unfinished; with more, it
    answers True and leaves the old senders writing (later posts go through
    new connections).
``tmp_regions``
    claims cross_host, but keeps each region in a file under ``region_dir``
    (default ``/tmp``) that writers map: nothing crosses the network.
``stakeless``
    its fence stops nothing, and it keeps anything from being at stake when
    the suite fences: a write of ``stakeless_bytes`` (16 MiB) or more is sent
    whole inside ``on_post``, so a big write is never in flight at a fence
    (a partition's cut finds nothing left to cross).

Options: ``host`` (the address to bind and to advertise, default
127.0.0.1), ``piece_bytes`` (frame size, default 262144), the lies, and
``region_dir``, ``stakeless_bytes``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import queue
import socket
import struct
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

from kvconn.chunk import Chunk, SegmentTable
from kvconn.hookspecs import hookimpl
from kvconn.options import BackendOptions
from kvconn.protocol.messages import Abort
from kvconn.sockets import resetting_closed_sockets
from kvconn.transport import Capabilities, Settlement

NAME = "liar-net"
LIES = ("fence_one", "tmp_regions", "stakeless")
KNOWN = ("host", "piece_bytes", "region_dir", "stakeless_bytes", *LIES)
HEADER = struct.Struct("!QQQB")  # write id, offset, length, last piece of its write
ACK = struct.Struct("!Q")
_RESET = struct.pack("ii", 1, 0)


class Options:
    def __init__(self, options: Mapping[str, str]) -> None:
        opts = BackendOptions(NAME, options, KNOWN)
        self.host = opts.text("host", "127.0.0.1")
        self.piece_bytes = opts.integer("piece_bytes", 1 << 18, low=1)
        self.region_dir = opts.text("region_dir", "/tmp")
        self.stakeless_bytes = opts.integer("stakeless_bytes", 16 << 20, low=1)
        self.lies = frozenset(lie for lie in LIES if opts.flag(lie))


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


class Region:
    """Decode's pages: anonymous memory behind a listening socket (or, lying,
    a file under ``region_dir``)."""

    def __init__(self, nbytes: int, opts: Options) -> None:
        self.nbytes = nbytes
        self._path = ""
        if "tmp_regions" in opts.lies:
            self._path = os.path.join(opts.region_dir, f"kvconn-liar-net-{uuid.uuid4().hex}")
            with open(self._path, "wb") as f:
                f.truncate(max(nbytes, 1))
            fd = os.open(self._path, os.O_RDWR)
            try:
                self._mem = mmap.mmap(fd, max(nbytes, 1))
            finally:
                os.close(fd)
            self.metadata = json.dumps({"path": self._path, "nbytes": nbytes}).encode()
            return
        self._mem = mmap.mmap(-1, max(nbytes, 1))
        self._server = socket.create_server((opts.host, 0))
        host, port = self._server.getsockname()[:2]
        self.metadata = json.dumps({"host": host, "port": port, "nbytes": nbytes}).encode()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._receive, args=(conn,), daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        header = bytearray(HEADER.size)
        view = memoryview(self._mem)
        with contextlib.suppress(OSError, ValueError):
            while _recv_exact(conn, memoryview(header)):
                job, offset, length, last = HEADER.unpack(header)
                if offset + length > self.nbytes:
                    break
                if not _recv_exact(conn, view[offset : offset + length]):
                    break
                if last:
                    conn.sendall(ACK.pack(job))
        with contextlib.suppress(OSError):
            conn.close()  # the writer is gone: nothing more comes from it

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self._mem[offset : offset + nbytes])

    def write(self, offset: int, data: bytes) -> None:
        self._mem[offset : offset + len(data)] = data

    def close(self) -> None:
        if self._path:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
        else:
            self._server.close()
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.close()
        with contextlib.suppress(BufferError):
            self._mem.close()


class _Write:
    def __init__(self, wid: int, pieces: list[tuple[int, int, int]]) -> None:
        self.id = wid
        self.pieces = pieces  # (src, dst, n)
        self.nbytes = sum(n for _, _, n in pieces)
        self.done = threading.Event()
        self.cancel = threading.Event()
        self.started = False
        self.settled_unsent = False  # finished without a byte sent: nothing of it can land


class _Channel:
    """One connection to a peer and its sender thread; after a fence, a new one."""

    def __init__(self, info: Mapping[str, Any], source: memoryview) -> None:
        self._source = source
        self.sock = socket.create_connection((str(info["host"]), int(info["port"])), timeout=30)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.queue: queue.Queue[_Write | None] = queue.Queue()
        self.halt = threading.Event()
        self.waiting: dict[int, _Write] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._send, daemon=True).start()
        threading.Thread(target=self._acks, daemon=True).start()

    def unfinished(self) -> list[_Write]:
        with self.lock:
            return [w for w in self.waiting.values() if not w.done.is_set()]

    def post(self, write: _Write) -> None:
        with self.lock:
            self.waiting[write.id] = write
        self.queue.put(write)

    def _send(self) -> None:
        while not self.halt.is_set():
            write = self.queue.get()
            if write is None or self.halt.is_set():
                break
            if write.cancel.is_set():
                write.settled_unsent = True
                write.done.set()
                continue
            write.started = True
            try:
                for k, (src, dst, n) in enumerate(write.pieces):
                    if self.halt.is_set():
                        return
                    last = k == len(write.pieces) - 1
                    self.sock.sendall(HEADER.pack(write.id, dst, n, last))
                    self.sock.sendall(self._source[src : src + n])
            except OSError:
                return
        # Posted, never started: settled without a byte sent.
        while True:
            try:
                write = self.queue.get_nowait()
            except queue.Empty:
                return
            if write is not None and not write.started:
                write.settled_unsent = True
                write.done.set()

    def _acks(self) -> None:
        buf = bytearray(ACK.size)
        with contextlib.suppress(OSError, ValueError):
            while _recv_exact(self.sock, memoryview(buf)):
                (wid,) = ACK.unpack(buf)
                with self.lock:
                    write = self.waiting.pop(wid, None)
                if write is not None:
                    write.done.set()

    def stop(self) -> None:
        """Stop sending and reset the connection: queued bytes are dropped."""
        self.halt.set()
        self.queue.put(None)
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class _FileChannel:
    """``tmp_regions``: the peer's region file, mapped; a copy thread."""

    def __init__(self, info: Mapping[str, Any], source: memoryview) -> None:
        self._source = source
        fd = os.open(str(info["path"]), os.O_RDWR)  # another host has no such file
        try:
            self._mem = mmap.mmap(fd, max(int(info["nbytes"]), 1))
        finally:
            os.close(fd)
        self.queue: queue.Queue[_Write | None] = queue.Queue()
        self.halt = threading.Event()
        self._pending: list[_Write] = []
        threading.Thread(target=self._copy, daemon=True).start()

    def unfinished(self) -> list[_Write]:
        return [w for w in self._pending if not w.done.is_set()]

    def post(self, write: _Write) -> None:
        self._pending.append(write)
        self.queue.put(write)

    def _copy(self) -> None:
        while True:
            write = self.queue.get()
            if write is None or self.halt.is_set():
                return
            write.started = True
            for src, dst, n in write.pieces:
                if self.halt.is_set():
                    return
                self._mem[dst : dst + n] = self._source[src : src + n]
            write.done.set()

    def stop(self) -> None:
        self.halt.set()
        self.queue.put(None)


class Writer:
    def __init__(self, nbytes: int, opts: Options) -> None:
        self.opts = opts
        self.nbytes = nbytes
        self._mem = mmap.mmap(-1, max(nbytes, 1))
        self._source = memoryview(self._mem)
        self._peers: dict[str, Mapping[str, Any]] = {}
        self._channels: dict[str, _Channel | _FileChannel] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._writes: dict[tuple[str, int], list[_Write]] = {}

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self._mem[offset : offset + nbytes])

    def write(self, offset: int, data: bytes) -> None:
        self._mem[offset : offset + len(data)] = data

    def connect(self, peer: str, metadata: bytes) -> None:
        info = json.loads(metadata)
        with self._lock:
            old = self._channels.pop(peer, None)
            self._peers[peer] = info
            self._channels[peer] = self._open(info)
        if old is not None:
            old.stop()

    def _open(self, info: Mapping[str, Any]) -> _Channel | _FileChannel:
        return _FileChannel(info, self._source) if "path" in info else _Channel(info, self._source)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            with contextlib.suppress(OSError):
                channel.stop()

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Any) -> _Write:
        rows = SegmentTable.of(segments).rows_within(self.nbytes, int(self._peers[chunk.peer]["nbytes"]))
        step = self.opts.piece_bytes
        pieces = [
            (int(src) + off, int(dst) + off, min(step, int(n) - off))
            for src, dst, n in rows
            for off in range(0, int(n), step)
        ]
        write = _Write(next(self._ids), pieces)
        with self._lock:
            channel = self._channels.get(chunk.peer)
            if channel is None:  # after a fence: a new connection
                channel = self._channels[chunk.peer] = self._open(self._peers[chunk.peer])
            self._writes.setdefault((chunk.peer, chunk.room), []).append(write)
        channel.post(write)
        if "stakeless" in self.opts.lies and write.nbytes >= self.opts.stakeless_bytes:
            write.done.wait(120)  # nothing big is ever in flight when anyone looks
        return write

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: _Write, deadline: float) -> Settlement:
        if not posted.done.wait(max(0.0, deadline - time.monotonic())):
            return Settlement.UNSETTLED
        return Settlement.FAILED_SETTLED if posted.settled_unsent else Settlement.LANDED

    @hookimpl
    def on_abort_notification(self, abort: Abort, known: bool) -> None:
        with self._lock:
            for write in self._writes.pop((abort.decode, abort.room), []):
                write.cancel.set()

    @hookimpl
    def on_fence(self) -> bool:
        with self._lock:
            channels, self._channels = dict(self._channels), {}
            self._writes.clear()
        unfinished = sum(len(c.unfinished()) for c in channels.values())
        if "stakeless" in self.opts.lies:
            return True  # the old senders write on
        if "fence_one" in self.opts.lies and unfinished > 1:
            return True  # the old senders write on; new posts take new connections
        with resetting_closed_sockets():
            for channel in channels.values():
                channel.stop()
        return True


class Backend:
    name = NAME
    host_options: ClassVar[dict[str, str]] = {"host": "{ip}"}
    capabilities = Capabilities(
        writer_fence=True,
        memory=frozenset({"dram"}),
        cross_host=True,
        notes="TCP, written from the plugin guide; lies to switch on: " + ", ".join(LIES),
    )

    def capabilities_for(self, options: Mapping[str, str]) -> Capabilities:
        Options(options)
        return self.capabilities

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> Region:
        return Region(nbytes, Options(options))

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> Writer:
        return Writer(nbytes, Options(options))


backend = Backend()
