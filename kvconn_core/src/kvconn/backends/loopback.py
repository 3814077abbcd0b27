"""The embedded ``loopback`` transport: real cross-process writes into shared
memory, asynchronous like a NIC, with deterministic fault injection.

Decode's region is a POSIX shared-memory segment. A prefill rank attaches it
and a "NIC" thread of the writer copies posted segments into it piece by
piece (``ctypes.memmove`` releases the GIL), so a write really is in flight
when an abort arrives, and a SIGSTOPped writer really resumes writing.

Options (strings, from ``Config.backend_options``):

``piece_bytes``
    bytes copied per step (default 262144): the granularity of in-flight data.
``piece_delay_s``
    sleep before every piece (default 0): slow writes, wide abort windows.
``fail_chunks``
    comma-separated ``room:index`` pairs whose chunk fails half way.
``fail_every``
    fail every N-th posted chunk half way (0: never).
``linger_after_fail``
    BROKEN on purpose: report a failed chunk settled but keep writing it.
``early_done``
    BROKEN on purpose: the DONE barrier answers LANDED without waiting.
``no_fence``
    BROKEN on purpose: the fence returns at once, the NIC keeps writing.
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

Any other key is refused when a region or writer opens (a typo is an error,
not a default silently applied).

The DONE barrier answers LANDED (or FAILED_SETTLED) only for a chunk that
settled by its deadline; one that settles later (its process was frozen) is
UNSETTLED, as it would be had the barrier looked at the deadline.

The fence (``on_fence``) stops the NIC thread between pieces and joins it:
once it returns no thread of this writer touches the region, so nothing
posted before it can land; then a new NIC thread serves new posts.
"""

from __future__ import annotations

import ctypes
import mmap
import queue
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing import resource_tracker, shared_memory

import attrs

from kvconn.chunk import Chunk, Segment, SegmentTable
from kvconn.hookspecs import hookimpl
from kvconn.options import BackendOptions, OptionError
from kvconn.transport import Capabilities, Settlement


def _address(buf: memoryview | mmap.mmap) -> tuple[int, ctypes.c_char]:
    anchor = ctypes.c_char.from_buffer(buf)
    return ctypes.addressof(anchor), anchor


@attrs.frozen
class LoopbackOptions:
    """The options above, parsed (every one is for writers; a region refuses
    unknown keys all the same: decode and prefill get one mapping)."""

    piece_bytes: int = 256 << 10
    piece_delay_s: float = 0.0
    fail_chunks: frozenset[tuple[int, int]] = frozenset()
    fail_every: int = 0
    linger_after_fail: bool = False
    early_done: bool = False
    no_fence: bool = False
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
            linger_after_fail=opts.flag("linger_after_fail", default.linger_after_fail),
            early_done=opts.flag("early_done", default.early_done),
            no_fence=opts.flag("no_fence", default.no_fence),
            freeze_chunks=_rank_chunk_ids(opts, "freeze_chunks"),
            late_chunks=_rank_chunk_ids(opts, "late_chunks"),
            late_delivery_s=opts.number("late_delivery_s", default.late_delivery_s, low=0.0),
        )


class LoopbackRegion:
    """Decode's pages in a fresh shared-memory segment."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
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


class _Handle:
    __slots__ = ("error", "finished", "finished_at", "not_before", "pieces", "programmed")

    def __init__(
        self, pieces: list[tuple[int, int, int]], programmed: bool = False, not_before: float = 0.0
    ) -> None:
        self.pieces = pieces
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


class _Peer:
    def __init__(self, name: str) -> None:
        self.shm = shared_memory.SharedMemory(name=name)
        # Attaching registers the segment with this process's resource
        # tracker, which would unlink decode's memory when we exit.
        resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.base, self.anchor = _address(_buffer(self.shm))
        self.nbytes = self.shm.size

    def close(self) -> None:
        del self.anchor
        self.shm.close()


class LoopbackWriter:
    """A prefill rank's source memory and its NIC thread."""

    def __init__(self, nbytes: int, options: Mapping[str, str]) -> None:
        self.options = LoopbackOptions.parse(options)
        self.nbytes = nbytes
        self._src = mmap.mmap(-1, max(nbytes, 1))
        self._src_base, self._src_anchor = _address(self._src)
        self._peers: dict[str, _Peer] = {}
        self._posted = 0
        self._lock = threading.Lock()
        self._start_nic()

    # -- Writer ------------------------------------------------------------
    def read(self, offset: int, nbytes: int) -> bytes:
        _check(offset, nbytes, self.nbytes)
        return self._src[offset : offset + nbytes]

    def write(self, offset: int, data: bytes) -> None:
        _check(offset, len(data), self.nbytes)
        self._src[offset : offset + len(data)] = data

    def connect(self, peer: str, metadata: bytes) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
            self._peers[peer] = _Peer(metadata.decode())
        if old is not None:
            old.close()

    def close(self) -> None:
        self._stop_nic()
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()
        del self._src_anchor
        self._src.close()

    # -- hooks -------------------------------------------------------------
    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> _Handle:
        peer = self._peers[chunk.peer]
        table = SegmentTable.of(segments)
        srcs, dsts, lens = table.columns_within(self.nbytes, peer.nbytes, self._src_base, peer.base)
        step = self.options.piece_bytes
        pieces = []
        for src, dst, nbytes in zip(srcs, dsts, lens, strict=True):
            for off in range(0, nbytes, step):
                pieces.append((src + off, dst + off, min(step, nbytes - off)))
        with self._lock:
            self._posted += 1
            fail = (chunk.room, chunk.index) in self.options.fail_chunks or (
                self.options.fail_every > 0 and self._posted % self.options.fail_every == 0
            )
        key = (chunk.rank, chunk.room, chunk.index)
        if key in self.options.freeze_chunks:
            return self._freeze_mid_write(pieces)
        if key in self.options.late_chunks:
            return self._deliver_late(pieces)
        handle = _Handle(pieces)
        self._nic_queue.put((handle, len(pieces) // 2 if fail else -1))
        return handle

    def _freeze_mid_write(self, pieces: list[tuple[int, int, int]]) -> _Handle:
        """Write half, stop this process, then hand the rest to the NIC as one
        programmed transfer. In on_post, so before the chunk's DONE barrier
        can look at its deadline: the freeze happens mid-write, always."""
        half = max(1, len(pieces) // 2)
        for src, dst, n in pieces[:half]:
            ctypes.memmove(dst, src, n)
        # To this thread: a signal to the process may be taken by another
        # thread, and this one would run on until the group stop reached it.
        # A stop signal stops every thread; this one on return from the call.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        # Queued after the stop: the NIC must not finish it before the freeze.
        handle = _Handle(pieces[half:], programmed=True)
        self._nic_queue.put((handle, -1))
        return handle

    def _deliver_late(self, pieces: list[tuple[int, int, int]]) -> _Handle:
        half = max(1, len(pieces) // 2)
        for src, dst, n in pieces[:half]:
            ctypes.memmove(dst, src, n)
        late = time.monotonic() + self.options.late_delivery_s
        handle = _Handle(pieces[half:], programmed=True, not_before=late)
        self._nic_queue.put((handle, -1))
        return handle

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: _Handle, deadline: float) -> Settlement:
        if self.options.early_done:
            return Settlement.LANDED
        if not posted.finished.wait(max(0.0, deadline - time.monotonic())):
            return Settlement.UNSETTLED
        if posted.finished_at > deadline:  # settled late (frozen past the deadline)
            return Settlement.UNSETTLED
        return Settlement.LANDED if posted.error is None else Settlement.FAILED_SETTLED

    @hookimpl
    def on_fence(self) -> bool:
        if not self.options.no_fence:
            self._stop_nic()
            self._start_nic()
        return True

    # -- the NIC -----------------------------------------------------------
    def _start_nic(self) -> None:
        self._nic_stop = threading.Event()
        self._nic_queue: queue.Queue[tuple[_Handle, int] | None] = queue.Queue()
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

    def _run_nic(self, jobs: queue.Queue[tuple[_Handle, int] | None], stop: threading.Event) -> None:
        while not stop.is_set():
            job = jobs.get()
            if job is None:
                break
            handle, fail_at = job
            if handle.programmed:
                self._land(handle)
                continue
            error = None
            for i, (src, dst, n) in enumerate(handle.pieces):
                if stop.is_set():
                    error = "fenced"
                    break
                if i == fail_at:
                    error = "injected failure"
                    if self.options.linger_after_fail:
                        rest = handle.pieces[i:]
                        threading.Thread(target=self._linger, args=(rest,), daemon=True).start()
                    break
                if self.options.piece_delay_s:
                    time.sleep(self.options.piece_delay_s)
                ctypes.memmove(dst, src, n)
            handle.finish(error)
        # Posted but never started: settled without writing a byte.
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            if job[0].programmed:  # the hardware has it: it lands, and the fence waits
                self._land(job[0])
            else:
                job[0].finish("fenced")

    @staticmethod
    def _land(handle: _Handle) -> None:
        """A programmed transfer: nothing stops it, not even a fence."""
        time.sleep(max(0.0, handle.not_before - time.monotonic()))
        for src, dst, n in handle.pieces:
            ctypes.memmove(dst, src, n)
        handle.finish()

    def _linger(self, pieces: list[tuple[int, int, int]]) -> None:
        time.sleep(max(self.options.piece_delay_s, 0.05) * 4)
        for src, dst, n in pieces:
            ctypes.memmove(dst, src, n)


class LoopbackBackend:
    name = "loopback"
    capabilities = Capabilities(
        writer_fence=True,
        memory=frozenset({"dram"}),
        cross_host=False,
        notes="POSIX shared memory on one host; writes are async pieces on a NIC thread",
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


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:
        raise ValueError(f"shared memory {shm.name} is closed")
    return buf


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


def _check(offset: int, nbytes: int, size: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"range [{offset}, {offset + nbytes}) outside a region of {size} bytes")


backend = LoopbackBackend()
