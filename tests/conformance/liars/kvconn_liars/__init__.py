"""Transports that lie, for the conformance suite's own tests.

``liar-honest`` is a transport written as a third party would from the
public interface (:mod:`kvconn.transport`, :mod:`kvconn.hookspecs`): decode's
pages in POSIX shared memory, a copy thread per writer that copies posted
segments piece by piece. Every other ``liar-*`` backend is that transport
telling one lie (see :data:`LIES`). The tests register them as backends
through a throw-away ``.dist-info`` (see ``tests/conformance/liars/registry.py``),
never through the installed packages. ``liar-loopback``
(:mod:`kvconn_liars.loopback`) is kvconn's own loopback transport with four
lies to switch on by option.

Options: ``piece_bytes`` (default 65536), ``pace_s`` (sleep per piece,
default 0), ``memory`` (``dram``; ``vram`` only where declared),
``lie_delay_s`` (how late a lying backend delivers, default 1.5: a
resumed fence's rewrite, an outliving helper's replay).
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

from kvconn.chunk import Chunk, Segment, SegmentTable
from kvconn.hookspecs import hookimpl
from kvconn.protocol.messages import Abort
from kvconn.transport import Capabilities, Settlement

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
    KEYS = ("piece_bytes", "pace_s", "memory", "lie_delay_s")

    def __init__(self, options: Mapping[str, str], memory_kinds: frozenset[str]) -> None:
        unknown = sorted(set(options) - set(self.KEYS))
        if unknown:
            raise ValueError(f"unknown liar option {unknown[0]!r}")
        self.piece_bytes = int(options.get("piece_bytes", 65536))
        self.pace_s = float(options.get("pace_s", 0.0))
        self.memory = options.get("memory", "dram")
        self.lie_delay_s = float(options.get("lie_delay_s", 1.5))
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
    def __init__(self, room: int, pieces: list[tuple[int, int, int]]) -> None:
        self.room = room
        self.pieces = pieces
        #: stray: (where, from where) 8 bytes are written once the pieces are
        self.stray: tuple[int, int] | None = None
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.cancelled = False


class _Peer:
    def __init__(self, metadata: bytes) -> None:
        info = json.loads(metadata)
        self.name = str(info["shm"])
        self.shm = _attach(self.name)
        self.base, self._anchor = _address(self.shm.buf)
        self.nbytes = int(info["nbytes"])

    def close(self) -> None:
        del self._anchor
        self.shm.close()


class Writer:
    def __init__(self, lie: str, nbytes: int, options: Options) -> None:
        self.lie = lie
        self.opts = options
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._last_peer = ""
        self._aborted: set[int] = set()
        self._jobs: list[_Job] = []
        #: fence_resume: the chunks posted since the last fence, written again after it
        self._parked: list[_Job] = []
        if lie.startswith("outlive"):
            self._src_shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
            self._src_buf: Any = self._src_shm.buf
            self._helper = _Helper(self._src_shm.name, lie == "outlive_detached", options.lie_delay_s)
        else:
            self._src_buf = mmap.mmap(-1, max(nbytes, 1))
        self._src_base, self._src_anchor = _address(self._src_buf)
        self._start()

    # -- Writer --------------------------------------------------------------
    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self._src_buf[offset : offset + nbytes])

    def write(self, offset: int, data: bytes) -> None:
        self._src_buf[offset : offset + len(data)] = data

    def connect(self, peer: str, metadata: bytes) -> None:
        with self._lock:
            old = self._peers.get(peer)
            self._peers[peer] = _Peer(metadata)
            self._last_peer = peer
        if old is not None:
            old.close()

    def close(self) -> None:
        self._stop()
        if self.lie.startswith("outlive"):
            self._helper.close()
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()

    # -- hooks ---------------------------------------------------------------
    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> _Job:
        with self._lock:
            peer = self._peers[self._last_peer if self.lie == "any_decode" else chunk.peer]
            aborted = chunk.room in self._aborted
        rows = [tuple(int(x) for x in row) for row in SegmentTable.of(segments).rows]
        if self.lie == "wide" and len(rows) > WIDE_AT:
            dsts = [r[1] for r in rows[1:]] + [rows[-1][1]]
            rows = rows[:WIDE_AT] + [(s, dsts[i], n) for i, (s, _, n) in enumerate(rows) if i >= WIDE_AT]
        if self.lie == "overrun":
            rows = [(s, d, min(-(-n // 4096) * 4096, peer.nbytes - d, self.nbytes - s)) for s, d, n in rows]
        step = self.opts.piece_bytes
        pieces = []
        for src, dst, n in rows:
            if src < 0 or dst < 0 or src + n > self.nbytes or dst + n > peer.nbytes:
                raise ValueError(f"segment ({src}, {dst}, {n}) outside the source or the peer")
            for off in range(0, n, step):
                pieces.append((self._src_base + src + off, peer.base + dst + off, min(step, n - off)))
        job = _Job(chunk.room, pieces)
        if self.lie == "stray" and rows:
            job.stray = (peer.base + peer.nbytes, self._src_base + rows[0][0])
        if aborted:  # settled before a byte was written: the truthful FAILED_SETTLED
            job.cancelled = True
            job.done.set()
            return job
        with self._lock:
            self._jobs.append(job)
            if self.lie == "fence_resume":
                self._parked.append(job)
        if self.lie.startswith("outlive"):
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
        with self._lock:
            self._aborted.add(abort.room)
            for job in self._jobs:
                if job.room == abort.room:
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
            for src, dst, n in job.pieces:
                if halt.is_set():
                    job.cancelled = True
                    break
                if job.cancel.is_set() and self.lie != "cancel":
                    job.cancelled = True
                    break
                if self.opts.pace_s:
                    time.sleep(self.opts.pace_s)
                ctypes.memmove(dst, src, n)
            if job.stray is not None and not job.cancelled:
                ctypes.memmove(job.stray[0], job.stray[1], 8)
            job.done.set()
        while True:  # posted, never started: settled without a byte written
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancelled = True
                job.done.set()

    def _resume_later(self, parked: list[tuple[_Job, list[tuple[int, int, int]]]]) -> None:
        time.sleep(self.opts.lie_delay_s)
        for _, pieces in parked:
            for src, dst, n in pieces:
                ctypes.memmove(dst, src, n)


class _Helper:
    """A copy engine in its own process (think: an offload daemon). While the
    rank lives it copies what it is told; once the rank is gone it waits, then
    replays the writes it was given last (a retry of unacknowledged work)."""

    def __init__(self, src_name: str, detached: bool, delay_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvconn_liars.helper", src_name, str(delay_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=detached,
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
        Options(options, self.capabilities.memory)
        return self.capabilities

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> Region:
        Options(options, self.capabilities.memory)
        return Region(nbytes, self.lie)

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> Writer:
        return Writer(self.lie, nbytes, Options(options, self.capabilities.memory))


BACKENDS = {lie: Backend(lie) for lie in LIES}
for _lie, _backend in BACKENDS.items():
    globals()[_lie.upper()] = _backend

if os.environ.get("KVCONN_LIARS_DEBUG"):  # pragma: no cover
    print(sorted(b.name for b in BACKENDS.values()), file=sys.stderr)
