"""The embedded ``loopback`` transport: real cross-process writes into decode's
memory, asynchronous like a NIC, with deterministic fault injection.

Decode's region is either a POSIX shared-memory segment it allocates
(``open_region``), which a prefill rank attaches and a "NIC" thread of the
writer copies posted segments into piece by piece (``ctypes.memmove``
releases the GIL); or memory the engine already owns (``register_region``):
private memory of the decode process, which no other process can map. The
NIC thread then writes straight into decode's addresses with Linux
``process_vm_writev`` (it needs ptrace access to decode: the same user
without Yama restrictions, or CAP_SYS_PTRACE). Either way a write really is
in flight when an abort arrives, and a SIGSTOPped writer really resumes
writing; and since each piece is one call that completes before it returns,
a writer stopped between pieces, or gone, lands nothing more.

A writer checks, when it connects, that decode's pid still names decode
(its start time) and holds a pidfd on it; before every write it polls that
pidfd, so it never writes once decode exited (a pid is reused only after
its process is reaped, and pids would have to wrap around in between).

Options (strings, from ``Config.backend_options``):

``piece_bytes``
    bytes copied per step (default 262144): the granularity of in-flight data.
    Into engine-owned memory a step is one ``process_vm_writev`` of up to
    this many bytes over up to 1024 ranges.
``piece_delay_s``
    sleep before every piece (default 0): slow writes, wide abort windows.
``fail_chunks``
    comma-separated ``room:index`` pairs whose chunk fails half way.
``fail_every``
    fail every N-th posted chunk half way (0: never).
``freeze_chunks``
    comma-separated ``rank:room:index`` triples: the rank writes the first
    half of that chunk, then stops its own process (SIGSTOP: a GC pause, a
    host frozen mid-write) until something sends it SIGCONT; the second half
    was already handed to the NIC and lands at once on SIGCONT, whatever a
    fence says (the fence waits for it). A fault at a point the test fixes,
    where a SIGSTOP sent from outside lands wherever the rank happens to be.
``late_chunks``
    ``rank:room:index`` triples: the first half of that chunk lands at once,
    the second half sits in the NIC's queue (handed to hardware: a fence
    waits for it) and lands ``late_delivery_s`` after the post, as a queue
    behind a congested or retransmitting link delivers.
``late_delivery_s``
    how late (default 2.0).

The DONE barrier answers LANDED (or FAILED_SETTLED) only for a chunk that
settled by its deadline; one that settles later (its process was frozen) is
UNSETTLED, as it would be had the barrier looked at the deadline.

Any other key is refused when a region or writer opens (a typo is an error,
not a default silently applied). Every option keeps the transport honest:
the broken variants the conformance suite and the bench must catch are a
test-only transport of their own (``liar-loopback``, in the repository's
``tests/conformance/liars``), never an option a deployment could set.

The fence (``on_fence``) stops the NIC thread between pieces and joins it:
once it returns no thread of this writer touches the region, so nothing
posted before it can land; then a new NIC thread serves new posts.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import mmap
import os
import queue
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import attrs
import numpy as np

from kvconn.backends.loopback_peers import (
    _CREATED_HERE,
    _PROCESS_TAG,
    _address,
    _buffer,
    _Peer,
    _ProcessPeer,
    _ShmPeer,
    populate,
)
from kvconn.buffers import Buffer, FlatSpace, buffers_of
from kvconn.chunk import Chunk, Segment, SegmentTable
from kvconn.hookspecs import hookimpl
from kvconn.options import BackendOptions, OptionError
from kvconn.runtime.procs import pid_namespace, proc_stat
from kvconn.transport import Capabilities, Settlement

if TYPE_CHECKING:
    import numpy.typing as npt


@attrs.frozen
class LoopbackOptions:
    """The options above, parsed (every one is for writers; a region refuses
    unknown keys all the same: decode and prefill get one mapping)."""

    piece_bytes: int = 256 << 10
    piece_delay_s: float = 0.0
    fail_chunks: frozenset[tuple[int, int]] = frozenset()
    fail_every: int = 0
    freeze_chunks: frozenset[tuple[int, int, int]] = frozenset()
    late_chunks: frozenset[tuple[int, int, int]] = frozenset()
    late_delivery_s: float = 2.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> LoopbackOptions:
        opts = BackendOptions("loopback", options, [f.name for f in attrs.fields(cls)])
        default = cls()
        return cls(
            piece_bytes=opts.integer("piece_bytes", default.piece_bytes, low=1),
            piece_delay_s=opts.number("piece_delay_s", default.piece_delay_s, low=0.0),
            fail_chunks=_chunk_ids(opts, "fail_chunks"),
            fail_every=opts.integer("fail_every", default.fail_every, low=0),
            freeze_chunks=_rank_chunk_ids(opts, "freeze_chunks"),
            late_chunks=_rank_chunk_ids(opts, "late_chunks"),
            late_delivery_s=opts.number("late_delivery_s", default.late_delivery_s, low=0.0),
        )


@atexit.register
def _unlink_kept_segments() -> None:
    """Decode keeps a region open past its endpoint's close while pages are
    held (a writer may still reach them); at exit its name goes. Unlinking
    frees nothing a writer still maps and lets no new writer attach, and
    the resource tracker would do it anyway, with a warning on stderr. A
    forked child that exits normally runs this too: it leaves its parent's."""
    me = os.getpid()
    for pid, shm in list(_CREATED_HERE.values()):
        if pid == me:
            with contextlib.suppress(OSError):
                shm.unlink()


class LoopbackRegion:
    """Decode's pages in a fresh shared-memory segment."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        _CREATED_HERE[self._shm._name] = (os.getpid(), self._shm)  # type: ignore[attr-defined]
        populate(self._shm._mmap)  # type: ignore[attr-defined]
        self._buf = _buffer(self._shm)
        self.metadata = self._shm.name.encode()

    def read(self, offset: int, nbytes: int) -> bytes:
        _check(offset, nbytes, self.nbytes)
        return bytes(self._buf[offset : offset + nbytes])

    def write(self, offset: int, data: bytes) -> None:
        _check(offset, len(data), self.nbytes)
        self._buf[offset : offset + len(data)] = data

    def close(self) -> None:
        del self._buf
        self._shm.close()
        self._shm.unlink()
        _CREATED_HERE.pop(self._shm._name, None)  # type: ignore[attr-defined]


class LoopbackEngineRegion:
    """Decode's pages in buffers the engine owns (this process's memory).

    The metadata names this process (pid, start time, pid namespace) and the
    buffers' addresses; ``close()`` forgets them and frees nothing."""

    def __init__(self, buffers: Sequence[Buffer]) -> None:
        self._space = FlatSpace(buffers_of(buffers))
        if self._space.kind != "dram":
            raise ValueError("loopback regions live in dram; these buffers are vram")
        self.nbytes = self._space.nbytes
        pid = os.getpid()
        self.metadata = (
            _PROCESS_TAG
            + json.dumps(
                {
                    "pid": pid,
                    "start_time": proc_stat(pid)[1],
                    "pid_namespace": pid_namespace(),
                    "buffers": [[b.address, b.nbytes] for b in self._space.buffers],
                }
            ).encode()
        )

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._space.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self._space.write(offset, data)

    def close(self) -> None:
        """Nothing was registered with a kernel or device: forget the buffers."""


class _Handle:
    __slots__ = ("error", "finished", "finished_at", "not_before", "programmed", "steps")

    def __init__(
        self, steps: list[tuple[int, int]], programmed: bool = False, not_before: float = 0.0
    ) -> None:
        #: (first, end) rows of the chunk's pieces, one step each
        self.steps = steps
        #: Already handed to the hardware: lands whole, a fence cannot stop it.
        self.programmed = programmed
        #: A programmed transfer lands no earlier than this (time.monotonic()).
        self.not_before = not_before
        self.finished = threading.Event()
        self.finished_at = float("inf")
        self.error: str | None = None

    def finish(self, error: str | None = None) -> None:
        if error is not None:
            self.error = error
        self.finished_at = time.monotonic()
        self.finished.set()


class LoopbackWriter:
    """A prefill rank's source memory and its NIC thread."""

    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str]) -> None:
        """``source``: bytes of memory to allocate, or the engine's buffers."""
        self.options = LoopbackOptions.parse(options)
        self._src: mmap.mmap | None = None
        if isinstance(source, int):
            self._src = mmap.mmap(-1, max(source, 1))
            populate(self._src)
            base, self._src_anchor = _address(self._src)
            self._space = FlatSpace([Buffer(base, max(source, 1), owner=self._src)])
            self.nbytes = source
        else:
            self._space = FlatSpace(buffers_of(source))
            if self._space.kind != "dram":
                raise ValueError("loopback writes from dram; these buffers are vram")
            self.nbytes = self._space.nbytes
        self._peers: dict[str, _Peer] = {}
        self._posted = 0
        self._lock = threading.Lock()
        self._start_nic()

    # -- Writer ------------------------------------------------------------
    def read(self, offset: int, nbytes: int) -> bytes:
        _check(offset, nbytes, self.nbytes)
        return self._space.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        _check(offset, len(data), self.nbytes)
        self._space.write(offset, data)

    def connect(self, peer: str, metadata: bytes) -> None:
        new: _Peer
        new = _ProcessPeer(metadata) if metadata.startswith(_PROCESS_TAG) else _ShmPeer(metadata.decode())
        with self._lock:
            old = self._peers.pop(peer, None)
            self._peers[peer] = new
        if old is not None:
            old.close()

    def close(self) -> None:
        self._stop_nic()
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()
        if self._src is not None:
            del self._src_anchor
            self._space = FlatSpace([Buffer(1, 1)])  # drops the last reference to the map
            self._src.close()

    # -- hooks -------------------------------------------------------------
    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> _Handle:
        peer = self._peers[chunk.peer]
        rows = SegmentTable.of(segments).rows_within(self.nbytes, peer.nbytes)
        pieces = _pieces(rows, self.options.piece_bytes)
        pieces[:, 0] = self._space.locate(pieces[:, 0], pieces[:, 2])[0]
        pieces[:, 1] = peer.space.locate(pieces[:, 1], pieces[:, 2])[0]
        steps = peer.steps(pieces, self.options.piece_bytes)
        with self._lock:
            self._posted += 1
            fail = (chunk.room, chunk.index) in self.options.fail_chunks or (
                self.options.fail_every > 0 and self._posted % self.options.fail_every == 0
            )
        key = (chunk.rank, chunk.room, chunk.index)
        if key in self.options.freeze_chunks:
            return self._freeze_mid_write(peer, pieces, steps)
        if key in self.options.late_chunks:
            return self._deliver_late(peer, pieces, steps)
        handle = _Handle(steps)
        self._nic_queue.put((handle, peer, pieces, len(steps) // 2 if fail else -1))
        return handle

    def _freeze_mid_write(
        self, peer: _Peer, pieces: npt.NDArray[np.int64], steps: list[tuple[int, int]]
    ) -> _Handle:
        """Write half, stop this process, then hand the rest to the NIC as one
        programmed transfer. In on_post, so before the chunk's DONE barrier
        can look at its deadline: the freeze happens mid-write, always."""
        half = max(1, len(steps) // 2)
        for first, end in steps[:half]:
            peer.copy(pieces, first, end)
        # To this thread: a signal to the process may be taken by another
        # thread, and this one would run on until the group stop reached it.
        # A stop signal stops every thread; this one on return from the call.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        # Queued after the stop: the NIC must not finish it before the freeze.
        handle = _Handle(steps[half:], programmed=True)
        self._nic_queue.put((handle, peer, pieces, -1))
        return handle

    def _deliver_late(
        self, peer: _Peer, pieces: npt.NDArray[np.int64], steps: list[tuple[int, int]]
    ) -> _Handle:
        half = max(1, len(steps) // 2)
        for first, end in steps[:half]:
            peer.copy(pieces, first, end)
        late = time.monotonic() + self.options.late_delivery_s
        handle = _Handle(steps[half:], programmed=True, not_before=late)
        self._nic_queue.put((handle, peer, pieces, -1))
        return handle

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: _Handle, deadline: float) -> Settlement:
        if not posted.finished.wait(max(0.0, deadline - time.monotonic())):
            return Settlement.UNSETTLED
        if posted.finished_at > deadline:  # settled late (frozen past the deadline)
            return Settlement.UNSETTLED
        return Settlement.LANDED if posted.error is None else Settlement.FAILED_SETTLED

    @hookimpl
    def on_fence(self) -> bool:
        self._stop_nic()
        self._start_nic()
        return True

    # -- the NIC -----------------------------------------------------------
    def _start_nic(self) -> None:
        self._nic_stop = threading.Event()
        self._nic_queue: queue.Queue[_Job | None] = queue.Queue()
        self._nic = threading.Thread(
            target=self._run_nic,
            args=(self._nic_queue, self._nic_stop),
            name="kvconn-loopback-nic",
            daemon=True,
        )
        self._nic.start()

    def _stop_nic(self) -> None:
        self._nic_stop.set()
        self._nic_queue.put(None)
        self._nic.join()

    def _run_nic(self, jobs: queue.Queue[_Job | None], stop: threading.Event) -> None:
        while not stop.is_set():
            job = jobs.get()
            if job is None:
                break
            handle, peer, pieces, fail_at = job
            if handle.programmed:
                self._land(handle, peer, pieces)
                continue
            error = None
            for i, (first, end) in enumerate(handle.steps):
                if stop.is_set():
                    error = "fenced"
                    break
                if i == fail_at:
                    error = self._fail_midway(peer, pieces, handle.steps[i:])
                    break
                if self.options.piece_delay_s:
                    time.sleep(self.options.piece_delay_s)
                error = peer.copy(pieces, first, end)
                if error is not None:
                    break  # the call returned: nothing of it is still in flight
            handle.finish(error)
        # Posted but never started: settled without writing a byte.
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            handle, peer, pieces, _ = job
            if handle.programmed:  # the hardware has it: it lands, and the fence waits
                self._land(handle, peer, pieces)
            else:
                handle.finish("fenced")

    @staticmethod
    def _land(handle: _Handle, peer: _Peer, pieces: npt.NDArray[np.int64]) -> None:
        """A programmed transfer: nothing stops it, not even a fence."""
        time.sleep(max(0.0, handle.not_before - time.monotonic()))
        error = None
        for first, end in handle.steps:
            error = peer.copy(pieces, first, end) or error
        handle.finish(error)

    def _fail_midway(self, peer: _Peer, pieces: npt.NDArray[np.int64], rest: list[tuple[int, int]]) -> str:
        """An injected failure (``fail_chunks``, ``fail_every``) at the first
        of the ``rest`` steps: none of them is ever written, so the chunk is
        settled as it fails. The error it fails with."""
        return "injected failure"


#: What the NIC thread is given: the handle, the peer, the pieces (source
#: address, destination address, bytes) and the step to fail at (-1: none).
_Job = tuple[_Handle, _Peer, "npt.NDArray[np.int64]", int]


def _pieces(rows: npt.NDArray[np.int64], step: int) -> npt.NDArray[np.int64]:
    """``rows`` (offset, offset, bytes) cut in pieces of at most ``step`` bytes,
    as a fresh writable array."""
    lens = rows[:, 2]
    if not len(rows) or int(lens.max()) <= step:
        return np.array(rows, dtype=np.int64)
    counts = -(-lens // step)
    row = np.repeat(np.arange(len(rows)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    offset = within * step
    pieces = np.empty((len(row), 3), dtype=np.int64)
    pieces[:, 0] = rows[row, 0] + offset
    pieces[:, 1] = rows[row, 1] + offset
    pieces[:, 2] = np.minimum(step, lens[row] - offset)
    return pieces


class LoopbackBackend:
    name = "loopback"
    capabilities = Capabilities(
        writer_fence=True,
        memory=frozenset({"dram"}),
        cross_host=False,
        notes="POSIX shared memory, or process_vm_writev into engine-owned memory, on one host; "
        "writes are async pieces on a NIC thread",
    )

    def capabilities_for(self, options: Mapping[str, str]) -> Capabilities:
        """The same with any options; asked before processes start, so a bad
        option fails there."""
        LoopbackOptions.parse(options)
        return self.capabilities

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> LoopbackRegion:
        LoopbackOptions.parse(options)
        return LoopbackRegion(nbytes)

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> LoopbackWriter:
        return LoopbackWriter(nbytes, options)

    def register_region(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> LoopbackEngineRegion:
        LoopbackOptions.parse(options)
        return LoopbackEngineRegion(buffers)

    def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> LoopbackWriter:
        return LoopbackWriter(buffers, options)


def _rank_chunk_ids(opts: BackendOptions, key: str) -> frozenset[tuple[int, int, int]]:
    """``rank:room:index`` triples, comma-separated."""
    ids = set()
    for item in filter(None, (x.strip() for x in opts.text(key).split(","))):
        parts = item.split(":")
        try:
            rank, room, index = (int(p) for p in parts)
        except ValueError:
            raise OptionError(
                f"loopback option {key}: expected rank:room:index triples, got {item!r}"
            ) from None
        ids.add((rank, room, index))
    return frozenset(ids)


def _chunk_ids(opts: BackendOptions, key: str) -> frozenset[tuple[int, int]]:
    """``room:index`` pairs, comma-separated."""
    ids = set()
    for item in filter(None, (x.strip() for x in opts.text(key).split(","))):
        room, _, index = item.partition(":")
        try:
            ids.add((int(room), int(index)))
        except ValueError:
            raise OptionError(f"loopback option {key}: expected room:index pairs, got {item!r}") from None
    return frozenset(ids)


def _check(offset: int, nbytes: int, size: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"range [{offset}, {offset + nbytes}) outside a region of {size} bytes")


backend = LoopbackBackend()
