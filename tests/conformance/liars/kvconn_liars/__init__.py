"""Transports that lie, for the conformance suite's own tests.

``liar-honest`` is a transport written as a third party would from the
public interface (:mod:`kvconn.transport`, :mod:`kvconn.hookspecs`): decode's
pages in POSIX shared memory, a copy thread per writer that copies posted
segments piece by piece. Every other ``liar-*`` backend is that transport
telling one lie (see :data:`LIES`). The tests register them as backends
through a throw-away ``.dist-info`` (see ``tests/conformance/liars/registry.py``),
never through the installed packages. ``liar-loopback``
(:mod:`kvconn_liars.loopback`) is kvconn's own loopback transport with four
lies to switch on by option; ``liar-mooncake`` (:mod:`kvconn_liars.mooncake`)
is kvconn-mooncake with two (a barrier that calls a write its engine took
LANDED, a fence that closes its connections instead of resetting them).

Options: ``piece_bytes`` (default 65536), ``pace_s`` (sleep per piece,
default 0), ``memory`` (``dram``; ``vram`` only where declared),
``lie_delay_s`` (how late a lying backend delivers, default 1.5: a
resumed fence's rewrite, an outliving helper's replay; 0.5 for
``outlive_linger``'s linger), ``sync_post`` (1: ``on_post`` copies every
piece before it returns, as nixl's ``transfer()`` over tcp does on an idle
machine; honest, and nothing is left in flight for a fence).

Every backend also registers engine-owned buffers
(:mod:`kvconn_liars.engine`): decode's private memory, written with
``process_vm_writev``.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from kvconn.buffers import Buffer, FlatSpace
from kvconn.chunk import Chunk, Segment, SegmentTable
from kvconn.hookspecs import hookimpl
from kvconn.protocol.messages import Abort
from kvconn.transport import Capabilities, Settlement
from kvconn_liars.engine import EngineRegion, ProcessPeer

#: Each lie, and what it does wrong.
LIES = {
    "honest": "nothing: the reference every lie departs from",
    "vram": "declares vram; a memory=vram region is host memory all the same",
    "cross_host": "declares cross_host; reaches its peer through this host's /dev/shm only",
    "outlive": "a helper process does the copies and finishes queued ones after the rank died",
    "outlive_detached": "outlive, with a helper in a session of its own (a system daemon)",
    "fence_idle": "its fence stops nothing; its barrier waits for the copy past the deadline, so a fence after a barrier finds nothing in flight",
    "fence_resume": "after a fence, every chunk posted before it is written again lie_delay_s later (a reconnect retransmitting)",
    "wide": "in a chunk of more than 24 segments, later destinations are off by one row",
    "overrun": "lengths rounded up to 4 KiB: bytes past a segment are overwritten",
    "any_decode": "ignores which decode a chunk is for: writes to the last peer connected",
    "cancel": "answers FAILED_SETTLED for a cancel it only requested; the copy goes on",
    "late_landed": "answers LANDED at the deadline, whatever is still in flight",
    "owner_fence": "its owner fence only swaps the metadata: the old shared memory stays the region's",
    "stray": "after each chunk it writes 8 bytes just past the peer's region, where the region keeps the pointer it reads through: the next read crashes the region's process",
    "room_route": "caches each room's route (the peer it wrote the room's first chunk to) by room id alone: a room id used again, by another decode or a restarted one, is written to the old peer's pages",
    "outlive_linger": "outlive, but its helper writes nothing late: it keeps decode's memory mapped for lie_delay_s (0.5 s) after the rank died, then exits",
}
WIDE_AT = 24


def _address(buf: Any) -> tuple[int, ctypes.c_char]:
    anchor = ctypes.c_char.from_buffer(buf)
    return ctypes.addressof(anchor), anchor


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


class Options:
    KEYS = ("piece_bytes", "pace_s", "memory", "lie_delay_s", "sync_post")

    def __init__(
        self, options: Mapping[str, str], memory_kinds: frozenset[str], delay_s: float = 1.5
    ) -> None:
        unknown = sorted(set(options) - set(self.KEYS))
        if unknown:
            raise ValueError(f"unknown liar option {unknown[0]!r}")
        self.piece_bytes = int(options.get("piece_bytes", 65536))
        self.pace_s = float(options.get("pace_s", 0.0))
        self.memory = options.get("memory", "dram")
        self.lie_delay_s = float(options.get("lie_delay_s", delay_s))
        self.sync_post = options.get("sync_post", "0") not in ("0", "", "false", "no", "off")
        if self.memory not in memory_kinds:
            raise ValueError(f"liar: memory {self.memory!r} not offered")


class Region:
    def __init__(self, nbytes: int, lie: str = "honest") -> None:
        self.nbytes = nbytes
        self.lie = lie
        # stray: the segment's last 8 bytes, past the region, hold where it starts
        tail = 8 if lie == "stray" else 0
        self._shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1) + tail)
        self._buf = self._shm.buf
        self.address, self._anchor = _address(self._buf)  # where a memory=vram region "is"
        if tail:
            self._buf[nbytes : nbytes + 8] = self.address.to_bytes(8, "little")
        self.metadata = json.dumps({"shm": self._shm.name, "nbytes": nbytes}).encode()

    def owner_fence(self) -> bytes:
        """Honest: the contents move to a new shared memory segment and the
        old one is unlinked, so a writer still mapping it writes into memory
        that is no longer the region's. The lie keeps the old segment."""
        if self.lie == "owner_fence":
            self.metadata = json.dumps(
                {"shm": self._shm.name, "nbytes": self.nbytes, "epoch": uuid.uuid4().hex}
            ).encode()
            return self.metadata
        new = shared_memory.SharedMemory(create=True, size=max(self.nbytes, 1))
        new.buf[: self.nbytes] = self._buf[: self.nbytes]
        old = self._shm
        del self._anchor
        del self._buf
        old.close()
        old.unlink()
        self._shm, self._buf = new, new.buf
        self.address, self._anchor = _address(self._buf)
        self.metadata = json.dumps({"shm": self._shm.name, "nbytes": self.nbytes}).encode()
        return self.metadata

    def read(self, offset: int, nbytes: int) -> bytes:
        if self.lie == "stray":  # through the pointer it keeps past the region
            start = int.from_bytes(self._buf[self.nbytes : self.nbytes + 8], "little")
            return ctypes.string_at(start + offset, nbytes)
        return bytes(self._buf[offset : offset + nbytes])

    def write(self, offset: int, data: bytes) -> None:
        self._buf[offset : offset + len(data)] = data

    def close(self) -> None:
        del self._anchor
        del self._buf
        self._shm.close()
        self._shm.unlink()


class _Job:
    def __init__(self, key: tuple[str, int], peer: _Target, pieces: list[tuple[int, int, int]]) -> None:
        #: (decode, room): a room id is unique per decode only
        self.key = key
        self.peer = peer
        self.pieces = pieces
        #: stray: (where, from where) 8 bytes are written once the pieces are
        self.stray: tuple[int, int] | None = None
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.cancelled = False


class _Peer:
    """A peer's region in shared memory, mapped here: pieces are memmoves."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.name = str(info["shm"])
        self.shm = _attach(self.name)
        self.base, self._anchor = _address(self.shm.buf)
        self.nbytes = int(info["nbytes"])
        #: Just past the region: where the region keeps its pointer (stray).
        self.tail = self.base + self.nbytes

    def address(self, offset: int, nbytes: int) -> int:
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"segment ({offset}, {nbytes}) outside the peer")
        return self.base + offset

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def close(self) -> None:
        del self._anchor
        self.shm.close()


_Target = _Peer | ProcessPeer


def _peer_of(metadata: bytes) -> _Target:
    info = json.loads(metadata)
    return ProcessPeer(info) if "pid" in info else _Peer(info)


class Writer:
    def __init__(self, lie: str, source: int | Sequence[Buffer], options: Options) -> None:
        self.lie = lie
        self.opts = options
        self._lock = threading.Lock()
        self._peers: dict[str, _Target] = {}
        self._last_peer = ""
        #: room_route: room id -> the peer its first chunk went to; and the
        #: peers replaced since, kept mapped for the routes that name them
        self._routes: dict[int, _Target] = {}
        self._retired: list[_Target] = []
        self._aborted: set[tuple[str, int]] = set()
        self._jobs: list[_Job] = []
        #: fence_resume: the chunks posted since the last fence, written again after it
        self._parked: list[_Job] = []
        self._space: FlatSpace | None = None
        if not isinstance(source, int):  # engine-owned buffers (register_writer)
            self._space = FlatSpace(list(source))
            self.nbytes = self._space.nbytes
        elif lie.startswith("outlive"):
            self.nbytes = source
            self._src_shm = shared_memory.SharedMemory(create=True, size=max(source, 1))
            self._src_buf: Any = self._src_shm.buf
        else:
            self.nbytes = source
            self._src_buf = mmap.mmap(-1, max(source, 1))
        if self._space is None:
            self._src_base, self._src_anchor = _address(self._src_buf)
        #: outlive: the copy engine (for a source of its own in shared memory)
        self._helper: _Helper | None = None
        if lie.startswith("outlive") and self._space is None:
            self._helper = _Helper(self._src_shm.name, lie, options.lie_delay_s)
        self._start()

    # -- Writer --------------------------------------------------------------
    def read(self, offset: int, nbytes: int) -> bytes:
        if self._space is not None:
            return self._space.read(offset, nbytes)
        return bytes(self._src_buf[offset : offset + nbytes])

    def write(self, offset: int, data: bytes) -> None:
        if self._space is not None:
            self._space.write(offset, data)
            return
        self._src_buf[offset : offset + len(data)] = data

    def _src_address(self, offset: int, nbytes: int) -> int:
        if self._space is not None:
            return self._space.address(offset, nbytes)
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"segment ({offset}, {nbytes}) outside the source")
        return self._src_base + offset

    def connect(self, peer: str, metadata: bytes) -> None:
        with self._lock:
            old = self._peers.get(peer)
            self._peers[peer] = _peer_of(metadata)
            self._last_peer = peer
            if old is not None and self.lie == "room_route":
                self._retired.append(old)  # a cached route may still name it
                old = None
        if old is not None:
            old.close()

    def close(self) -> None:
        self._stop()
        if self._helper is not None:
            self._helper.close()
        with self._lock:
            for peer in [*self._peers.values(), *self._retired]:
                peer.close()
            self._peers.clear()
            self._retired.clear()

    # -- hooks ---------------------------------------------------------------
    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> _Job:
        key = (chunk.peer, chunk.room)
        with self._lock:
            peer = self._peers[self._last_peer if self.lie == "any_decode" else chunk.peer]
            if self.lie == "room_route":
                peer = self._routes.setdefault(chunk.room, peer)
            aborted = key in self._aborted
        rows = [tuple(int(x) for x in row) for row in SegmentTable.of(segments).rows]
        if self.lie == "wide" and len(rows) > WIDE_AT:
            dsts = [r[1] for r in rows[1:]] + [rows[-1][1]]
            rows = rows[:WIDE_AT] + [(s, dsts[i], n) for i, (s, _, n) in enumerate(rows) if i >= WIDE_AT]
        if self.lie == "overrun":
            rows = [(s, d, min(-(-n // 4096) * 4096, peer.nbytes - d, self.nbytes - s)) for s, d, n in rows]
        step = self.opts.piece_bytes
        pieces = []
        for src, dst, n in rows:
            src_at, dst_at = self._src_address(src, n), peer.address(dst, n)
            for off in range(0, n, step):
                pieces.append((src_at + off, dst_at + off, min(step, n - off)))
        job = _Job(key, peer, pieces)
        if self.lie == "stray" and rows:
            job.stray = (peer.tail, self._src_address(rows[0][0], 8))
        if aborted:  # settled before a byte was written: the truthful FAILED_SETTLED
            job.cancelled = True
            job.done.set()
            return job
        if self.opts.sync_post:  # every byte moved before on_post returns: nothing in flight after
            self._run(job, threading.Event())
            return job
        with self._lock:
            self._jobs.append(job)
            if self.lie == "fence_resume":
                self._parked.append(job)
        if self._helper is not None and isinstance(peer, _Peer):
            self._helper.submit(job, peer.name, peer.base, self._src_base)
        else:
            self._queue.put(job)
        return job

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: _Job, deadline: float) -> Settlement:
        if self.lie == "cancel" and posted.cancel.is_set():
            return Settlement.FAILED_SETTLED
        if self.lie == "fence_idle":
            deadline = max(deadline, time.monotonic() + 10.0)  # drains: true, but no deadline
        if not posted.done.wait(max(0.0, deadline - time.monotonic())):
            return Settlement.LANDED if self.lie == "late_landed" else Settlement.UNSETTLED
        return Settlement.FAILED_SETTLED if posted.cancelled else Settlement.LANDED

    @hookimpl
    def on_abort_notification(self, abort: Abort, known: bool) -> None:
        key = (abort.decode, abort.room)
        with self._lock:
            self._aborted.add(key)
            for job in self._jobs:
                if job.key == key:
                    job.cancel.set()

    @hookimpl
    def on_fence(self) -> bool:
        if self.lie.startswith("outlive"):
            return False  # the helper cannot be fenced: only the rank's exit proves it
        if self.lie == "fence_idle":
            return True  # the copy thread runs on
        self._stop()
        if self.lie == "fence_resume" and self._parked:
            # Whether or not a piece had landed before the fence: at the speed
            # the copy runs it may have, and the lie must not depend on that.
            parked, self._parked = [(job, job.pieces) for job in self._parked], []
            threading.Thread(target=self._resume_later, args=(parked,), daemon=True).start()
        self._start()
        return True

    # -- the copy thread -------------------------------------------------------
    def _start(self) -> None:
        self._halt = threading.Event()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._copy, args=(self._queue, self._halt), daemon=True)
        self._thread.start()

    def _stop(self) -> None:
        self._halt.set()
        self._queue.put(None)
        self._thread.join()

    def _copy(self, jobs: queue.Queue[_Job | None], halt: threading.Event) -> None:
        while True:
            job = jobs.get()
            if job is None or halt.is_set():
                break
            self._run(job, halt)
        while True:  # posted, never started: settled without a byte written
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancelled = True
                job.done.set()

    def _run(self, job: _Job, halt: threading.Event) -> None:
        """Copy ``job``'s pieces in order, unless halted (a fence) or cancelled."""
        for src, dst, n in job.pieces:
            if halt.is_set():
                job.cancelled = True
                break
            if job.cancel.is_set() and self.lie != "cancel":
                job.cancelled = True
                break
            if self.opts.pace_s:
                time.sleep(self.opts.pace_s)
            job.peer.copy(dst, src, n)
        if job.stray is not None and not job.cancelled:
            job.peer.copy(job.stray[0], job.stray[1], 8)
        job.done.set()

    def _resume_later(self, parked: list[tuple[_Job, list[tuple[int, int, int]]]]) -> None:
        time.sleep(self.opts.lie_delay_s)
        for job, pieces in parked:
            for src, dst, n in pieces:
                job.peer.copy(dst, src, n)


class _Helper:
    """A copy engine in its own process (think: an offload daemon), for
    peers in shared memory. While the rank lives it copies what it is told;
    once the rank is gone it waits, then replays the writes it was given
    last (a retry of unacknowledged work); ``outlive_linger``'s only keeps
    what it mapped for the delay, and writes nothing."""

    def __init__(self, src_name: str, lie: str, delay_s: float) -> None:
        mode = "linger" if lie == "outlive_linger" else "replay"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvconn_liars.helper", src_name, str(delay_s), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=lie == "outlive_detached",
        )
        self._pending: dict[str, _Job] = {}
        self._lock = threading.Lock()
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":  # an engine is up before the writer is
            raise RuntimeError("liar: the helper process did not start")
        threading.Thread(target=self._read, daemon=True).start()

    def submit(self, job: _Job, peer: str, peer_base: int, src_base: int) -> None:
        key = uuid.uuid4().hex
        with self._lock:
            self._pending[key] = job
        rows = [(s - src_base, d - peer_base, n) for s, d, n in job.pieces]
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"key": key, "peer": peer, "rows": rows}) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                job = self._pending.pop(line.strip(), None)
            if job is not None:
                job.done.set()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("bye\n")  # an orderly close: nothing replayed
        self.proc.stdin.close()
        self.proc.wait(10)


class Backend:
    def __init__(self, lie: str) -> None:
        self.lie = lie
        self.name = "liar-" + lie.replace("_", "-")
        self.capabilities = Capabilities(
            writer_fence=not lie.startswith("outlive"),
            memory=frozenset({"dram", "vram"} if lie == "vram" else {"dram"}),
            cross_host=lie == "cross_host",
            owner_fence=True,
            notes=LIES[lie],
        )

    def capabilities_for(self, options: Mapping[str, str]) -> Capabilities:
        self._options(options)
        return self.capabilities

    def _options(self, options: Mapping[str, str]) -> Options:
        return Options(options, self.capabilities.memory, 0.5 if self.lie == "outlive_linger" else 1.5)

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> Region:
        self._options(options)
        return Region(nbytes, self.lie)

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> Writer:
        return Writer(self.lie, nbytes, self._options(options))

    def register_region(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> EngineRegion:
        self._options(options)
        return EngineRegion(buffers)

    def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> Writer:
        return Writer(self.lie, buffers, self._options(options))


BACKENDS = {lie: Backend(lie) for lie in LIES}
for _lie, _backend in BACKENDS.items():
    globals()[_lie.upper()] = _backend

if os.environ.get("KVCONN_LIARS_DEBUG"):  # pragma: no cover
    print(sorted(b.name for b in BACKENDS.values()), file=sys.stderr)
