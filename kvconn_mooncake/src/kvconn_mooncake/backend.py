"""The Mooncake Transfer Engine backend: page regions, writers and their hooks.

Design (measured on 0.3.13.post1, tcp over loopback):

* Every segment is posted with ``transfer_submit_write`` (an async one-task
  batch) and polled with ``transfer_check_status`` (non-blocking: 1 done,
  0 pending, -1 failed, -2 timeout). No thread ever sits inside a blocking
  engine call (``get_batch_transfer_status`` busy-waits, cannot honour a
  deadline, frees its batches and segfaults on a second call), so the DONE
  barrier honours its deadline exactly and ``on_fence`` can destroy the engine.
* At most ``max_inflight`` (default 512) transfers are queued per peer: the
  engine rejects pieces beyond ~1024 per peer (``queue-full``) and poisons the
  next calls. Segments beyond the cap stay in the posted token and are
  submitted by whichever barrier drives progress next (any waiting thread
  polls the in-flight transfers of every peer, oldest first, stopping at a
  peer's first pending one, so no chunk waits on a credit held by a chunk
  whose barrier has not started).
* Why one transfer per segment: the only non-blocking status call,
  ``transfer_check_status``, reads task 0 of a batch, so a many-task batch
  cannot be polled; that costs scattered 4 KiB pages ~15-25% against the raw
  path's blocking ``get_batch_transfer_status`` on two cores.
* A failed or timed-out transfer may still have written (measured): the
  chunk is ``UNSETTLED``. ``FAILED_SETTLED`` only when nothing of the chunk
  was ever handed to the engine.
* ``on_fence`` destroys the writer's engine (closes every connection its late
  pieces would travel on), creates a new one and registers the source again.
"""

from __future__ import annotations

import collections
import gc
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvconn.chunk import Chunk, Segment
from kvconn.hookspecs import hookimpl
from kvconn.transport import Capabilities, Settlement
from kvconn_mooncake._engine import (
    configure_env,
    engine_settings,
    engine_timeout_s,
    new_engine,
    pack_metadata,
    session_id,
    shared_engine,
    unpack_metadata,
)
from kvconn_mooncake._memory import MEMORY_KINDS, MemoryOptions, cuda_engine_installed, open_memory

configure_env()

DEFAULT_MAX_INFLIGHT = 512
#: How long a DONE barrier polls without sleeping before it backs off.
HOT_POLL_S = 0.002
DEFAULT_POLL_INTERVAL_S = 0.0001  # a longer cap noticed completion late: 78% of raw at 1 MiB
_BAD_IDS = (0, 2**64 - 1, -1)


def _check_range(offset: int, nbytes: int, size: int, what: str) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"{what} range [{offset}, {offset + nbytes}) outside [0, {size})")


class MooncakeRegion:
    """Decode's page memory (DRAM, or VRAM with ``memory=vram``), registered
    with the process's shared engine."""

    def __init__(self, nbytes: int, options: Mapping[str, str]) -> None:
        if nbytes <= 0:
            raise ValueError("region size must be positive")
        host, protocol, device = engine_settings(options)
        self.nbytes = nbytes
        self.memory = MemoryOptions.parse(options)
        self._mem = open_memory(nbytes, self.memory)
        self.base: int = self._mem.addr
        self._engine = shared_engine(host, protocol, device)
        rc = self._engine.register_memory(self.base, nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory({nbytes} bytes) returned {rc}")
        self.session = session_id(self._engine, host)
        self.metadata: bytes = pack_metadata(self.session, self.base, nbytes, protocol)
        self._closed = False

    def array(self) -> npt.NDArray[np.uint8]:
        """The region's DRAM buffer, without a copy (DRAM only). A method, not
        a property: pluggy reads every attribute of a registered plugin."""
        return self._mem.array()

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._mem.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self._mem.write(offset, data)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.unregister_memory(self.base)


@attrs.define(eq=False)
class _Peer:
    session: str
    base: int
    nbytes: int


@attrs.define(eq=False)
class Posted:
    """The token ``on_post`` returns: one chunk's transfers."""

    generation: int
    session: str
    pending: collections.deque[tuple[int, int, int]]
    nbytes: int
    inflight: int = 0
    submitted: int = 0
    failed: bool = False
    abandoned: bool = False

    @property
    def done(self) -> bool:
        return not self.pending and self.inflight == 0


class MooncakeWriter:
    """A prefill rank's endpoint: its own engine (so that it can fence) and source memory.

    Hooks may run on several worker threads at once; one lock serialises the
    (short, non-blocking) engine calls and the bookkeeping.
    """

    def __init__(self, nbytes: int, options: Mapping[str, str]) -> None:
        if nbytes <= 0:
            raise ValueError("source size must be positive")
        self._host, self._protocol, self._device = engine_settings(options)
        self.max_inflight = int(options.get("max_inflight", DEFAULT_MAX_INFLIGHT))
        self.poll_interval_s = float(options.get("poll_interval_s", DEFAULT_POLL_INTERVAL_S))
        if not 0 < self.max_inflight <= 1000:
            raise ValueError("max_inflight must be in 1..1000 (the engine rejects ~1024 per peer)")
        self.nbytes = nbytes
        self.memory = MemoryOptions.parse(options)
        self._mem = open_memory(nbytes, self.memory)
        self.base: int = self._mem.addr
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        #: Per peer session, transfer ids in submission order. A peer's pieces
        #: complete in order, so a poll stops at the first one still pending:
        #: O(completed) engine calls per poll, not O(in flight).
        self._inflight: dict[str, collections.deque[tuple[int, Posted]]] = {}
        self._queued: collections.deque[Posted] = collections.deque()
        self._generation = 0
        self._engine: Any = None
        self._closed = False
        self.last_fence_s: float | None = None
        self._open_engine()

    # -- memory -------------------------------------------------------------

    def array(self) -> npt.NDArray[np.uint8]:
        """The source's DRAM buffer, without a copy (DRAM only). A method, not
        a property: pluggy reads every attribute of a registered plugin."""
        return self._mem.array()

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._mem.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self._mem.write(offset, data)

    # -- engine ---------------------------------------------------------------

    def _open_engine(self) -> None:
        engine = new_engine(self._host, self._protocol, self._device)
        rc = engine.register_memory(self.base, self.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory({self.nbytes} bytes) returned {rc}")
        self._engine = engine

    @property
    def session(self) -> str:
        """This writer's engine session id (changes at every fence)."""
        if self._engine is None:
            raise RuntimeError("writer has no engine")
        return session_id(self._engine, self._host)

    def connect(self, peer: str, metadata: bytes) -> None:
        session, base, nbytes = unpack_metadata(metadata)
        with self._lock:
            self._peers[peer] = _Peer(session, base, nbytes)

    # -- progress (call with self._lock held) ---------------------------------

    def _submit(self, tok: Posted) -> None:
        engine = self._engine
        inflight = self._inflight.setdefault(tok.session, collections.deque())
        while tok.pending and len(inflight) < self.max_inflight:
            src, dst, n = tok.pending.popleft()
            tid = engine.transfer_submit_write(tok.session, src, dst, n)
            if tid in _BAD_IDS:
                tok.failed = True
                tok.pending.clear()
                return
            inflight.append((tid, tok))
            tok.inflight += 1
            tok.submitted += 1

    def _progress(self) -> None:
        engine = self._engine
        for inflight in self._inflight.values():
            while inflight:
                tid, tok = inflight[0]
                rc = engine.transfer_check_status(tid)
                if rc == 0:
                    break
                # 1 and -1 freed the batch inside the engine; -2 (timeout) did not:
                # never look at this id again either way.
                inflight.popleft()
                tok.inflight -= 1
                if rc != 1:
                    tok.failed = True
                    tok.pending.clear()
        while self._queued:
            tok = self._queued[0]
            if tok.abandoned or tok.failed:
                tok.pending.clear()
            else:
                self._submit(tok)
            if tok.pending:
                break
            self._queued.popleft()

    # -- hooks ----------------------------------------------------------------

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> object | None:
        with self._lock:
            peer = self._peers.get(chunk.peer)
            if peer is None:
                raise KeyError(f"mooncake writer not connected to peer {chunk.peer!r}")
            work: collections.deque[tuple[int, int, int]] = collections.deque()
            total = 0
            for seg in segments:
                _check_range(seg.src, seg.nbytes, self.nbytes, "segment source")
                _check_range(seg.dst, seg.nbytes, peer.nbytes, "segment destination")
                if seg.nbytes:
                    work.append((self.base + seg.src, peer.base + seg.dst, seg.nbytes))
                    total += seg.nbytes
            tok = Posted(self._generation, peer.session, work, total)
            if self._engine is None:
                self._open_engine()
            if not work:
                return tok
            if self._queued:  # keep FIFO order behind chunks waiting for credits
                self._queued.append(tok)
            else:
                self._submit(tok)
                if tok.pending:
                    self._queued.append(tok)
            return tok

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement | None:
        if not isinstance(posted, Posted):
            return None
        sleep = min(5e-5, self.poll_interval_s)
        # Poll hot first (yielding the GIL): a 1 MiB piece lands in ~0.4 ms,
        # and sleeps of 50 us doubling found it ~0.3 ms late (70-80% of raw).
        hot_until = time.monotonic() + HOT_POLL_S
        while True:
            with self._lock:
                if posted.generation != self._generation:
                    return Settlement.UNSETTLED  # fenced under it: it never settled
                if posted.done and not posted.failed:
                    return Settlement.LANDED
                if not posted.failed:
                    self._progress()
                if posted.failed:
                    posted.abandoned = True
                    posted.pending.clear()
                    if posted.submitted == 0:
                        return Settlement.FAILED_SETTLED  # nothing ever reached the engine
                    return Settlement.UNSETTLED  # a failed Mooncake write may still land
                if posted.done:
                    return Settlement.LANDED
                now = time.monotonic()
                if now >= deadline:
                    posted.abandoned = True
                    posted.pending.clear()
                    return Settlement.UNSETTLED
            if now < hot_until:
                time.sleep(0)
                continue
            time.sleep(min(sleep, max(0.0, deadline - now)))
            sleep = min(sleep * 2, self.poll_interval_s)

    @hookimpl
    def on_fence(self) -> bool | None:
        """Destroy the engine (every connection closes), then open a new one.

        The core calls this with no worker inside on_post / on_done_barrier,
        so no thread is inside an engine call and the engine has no other
        reference: ``del`` really destroys it (measured: 0 bytes land after).
        """
        start = time.monotonic()
        with self._lock:
            self._generation += 1
            for tok in [tok for q in self._inflight.values() for _, tok in q] + list(self._queued):
                tok.abandoned = True
                tok.pending.clear()
            self._inflight.clear()
            self._queued.clear()
            engine, self._engine = self._engine, None
            del engine  # the only reference: the destructor joins the transport threads
            gc.collect()
            self._open_engine()  # same targets: a new engine reaches the same session ids
        self.last_fence_s = time.monotonic() - start
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._generation += 1
            self._inflight.clear()
            self._queued.clear()
            engine, self._engine = self._engine, None
            del engine
            gc.collect()


@attrs.frozen
class MooncakeBackend:
    """The object behind the ``kvconn.backends`` entry point ``mooncake``."""

    name: str = "mooncake"
    capabilities: Capabilities = attrs.field(
        factory=lambda: Capabilities(
            writer_fence=True,
            memory=frozenset(MEMORY_KINDS if cuda_engine_installed() else ("dram",)),
            cross_host=False,
            max_write_timeout_s=engine_timeout_s(),
            notes=(
                "Mooncake TE 0.3.13 over P2PHANDSHAKE; tcp tested (loopback), rdma untested. "
                "Failed writes count as UNSETTLED (a failed call may still write). Fence = destroy "
                "and re-create the writer's engine (~1 s); proven for a stalled writer; for a stalled "
                "page owner the core waits for decode's ends of the closed connections to drain (8 MiB "
                "measured in its socket buffers). Engine timeout from MC_TRANSFER_TIMEOUT / MC_TCP_STATUS_TIMEOUT_SEC (min 5 s). "
                "vram (memory=vram, gpu_device=N; cupy/torch allocation): declared only with the CUDA "
                "wheel, whose tcp transport stages device memory through host buffers; conformance passed "
                "on VRAM on an H200 host."
            ),
        )
    )

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> MooncakeRegion:
        return MooncakeRegion(nbytes, options)

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> MooncakeWriter:
        return MooncakeWriter(nbytes, options)


backend = MooncakeBackend()
