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

Any other key is refused when a region or writer opens (a typo is an error,
not a default silently applied).

The fence (``on_fence``) stops the NIC thread between pieces and joins it:
once it returns no thread of this writer touches the region, so nothing
posted before it can land; then a new NIC thread serves new posts.
"""

from __future__ import annotations

import ctypes
import mmap
import queue
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
    __slots__ = ("error", "finished", "pieces")

    def __init__(self, pieces: list[tuple[int, int, int]]) -> None:
        self.pieces = pieces
        self.finished = threading.Event()
        self.error: str | None = None


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
        handle = _Handle(pieces)
        self._nic_queue.put((handle, len(pieces) // 2 if fail else -1))
        return handle

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: _Handle, deadline: float) -> Settlement:
        if self.options.early_done:
            return Settlement.LANDED
        if not posted.finished.wait(max(0.0, deadline - time.monotonic())):
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
            for i, (src, dst, n) in enumerate(handle.pieces):
                if stop.is_set():
                    handle.error = "fenced"
                    break
                if i == fail_at:
                    handle.error = "injected failure"
                    if self.options.linger_after_fail:
                        rest = handle.pieces[i:]
                        threading.Thread(target=self._linger, args=(rest,), daemon=True).start()
                    break
                if self.options.piece_delay_s:
                    time.sleep(self.options.piece_delay_s)
                ctypes.memmove(dst, src, n)
            handle.finished.set()
        # Posted but never started: settled without writing a byte.
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[0].error = "fenced"
                job[0].finished.set()

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


def _check(offset: int, nbytes: int, size: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"range [{offset}, {offset + nbytes}) outside a region of {size} bytes")


backend = LoopbackBackend()
