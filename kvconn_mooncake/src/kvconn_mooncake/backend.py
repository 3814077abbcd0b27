"""The Mooncake Transfer Engine backend: page regions, writers and their hooks.

Design (measured on 0.3.13.post1, tcp over loopback):

* A chunk's segments go as many-task batches (``batch_transfer_async_write``,
  at most ``max_batch`` segments each, default ``max_inflight``) polled with
  ``mooncake::TransferEngine::getBatchTransferStatus`` through ctypes
  (:mod:`kvconn_mooncake._batch_status`): one non-blocking pass over the
  batch's tasks, COMPLETED / FAILED (a task failed or timed out) / WAITING.
  A completed batch is freed with ``freeBatchID`` and never looked at again;
  a failed one is left alone for good (tasks of it may still be writing;
  freeing could free memory the transport threads still use): a small leak
  per failed batch. The hack is guarded (x86-64 Linux, wheel 0.3.13.x, the
  symbols and the known prologues of the ``Status``-returning wrappers, a
  self-test per engine); ``batch_status=auto`` (default) falls back to the
  per-segment path below when a guard fails, ``on`` requires the batch path,
  ``off`` never uses it.
* Fallback, one transfer per segment: ``transfer_submit_write`` (an async
  one-task batch) polled with ``transfer_check_status`` (non-blocking: 1 done,
  0 pending, -1 failed, -2 timeout), because that call reads only task 0 of a
  batch.
* Either way no thread ever sits inside a blocking engine call
  (``get_batch_transfer_status`` busy-waits, cannot honour a deadline, frees
  its batches and segfaults on a second call), so the DONE barrier honours
  its deadline exactly and ``on_fence`` can destroy the engine.
* At most ``max_inflight`` (default 512) segments are queued per peer: the
  engine rejects pieces beyond ~1024 per peer (``queue-full``) and poisons the
  next calls. Segments beyond the cap stay in the posted token and are
  submitted by whichever barrier drives progress next (any waiting thread
  polls the in-flight batches of every peer, oldest first, stopping at a
  peer's first pending one, so no chunk waits on a credit held by a chunk
  whose barrier has not started).
* A failed or timed-out transfer may still have written (measured): the
  chunk is ``UNSETTLED``. ``FAILED_SETTLED`` only when nothing of the chunk
  was ever handed to the engine (a batch whose submission failed counts as
  handed: the engine may have queued part of it).
* ``on_fence`` destroys the writer's engine (closes every connection its late
  pieces would travel on), creates a new one and registers the source again.
"""

from __future__ import annotations

import collections
import gc
import math
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvconn.chunk import Chunk, Segment, SegmentTable
from kvconn.hookspecs import hookimpl
from kvconn.transport import Capabilities, Settlement
from kvconn_mooncake._batch_status import DONE, PENDING, BatchPoller, bind
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
from kvconn_mooncake._options import read as read_options

configure_env()

DEFAULT_MAX_INFLIGHT = 512
BATCH_STATUS_MODES = ("auto", "on", "off")
DEFAULT_POLL_INTERVAL_S = 0.0001  # a longer cap noticed completion late: 78% of raw at 1 MiB
#: How long a DONE barrier polls hot (None: until the chunk settles or its
#: deadline passes), then it sleeps between polls. None, as the raw API's
#: blocking status call spins: side by side with it (`kvconn bench
#: --transport`, 2-core VM, 15 pairs, two rounds each) spinning gave 95.0 and
#: 95.6% of raw for 1024 scattered 4 KiB pages against 76.7 and 94.8% with
#: 2 ms, 97.7 and 94.6% at 1 MiB against 92.8 and 92.2%, 104.1 and 104.4% at
#: 64 MiB against 108.3 and 106.6% (all met there); release p99 at 3,000
#: requests 8.64 and 5.51 ms against 8.87 and 8.38. (Interleaved chunk by
#: chunk in one process, 64 MiB chunks had taken 62.6 ms spinning against
#: 52.2 with 2 ms: there the spinner took a core from the engine's copies.)
DEFAULT_HOT_POLL_S: float | None = None
_BAD_IDS = (0, 2**64 - 1, -1)


@attrs.frozen
class WriterOptions:
    """A writer's own options (see the README for each)."""

    #: At most 1000: the engine rejects ~1024 pieces in flight per peer.
    max_inflight: int
    max_batch: int
    poll_interval_s: float
    #: How long a DONE barrier polls without sleeping (None: until the chunk
    #: settles or its deadline passes), then every poll_interval_s.
    hot_poll_s: float | None
    batch_status: str

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriterOptions:
        opts = read_options(options)
        max_inflight = opts.integer("max_inflight", DEFAULT_MAX_INFLIGHT, low=1, high=1000)
        return cls(
            max_inflight=max_inflight,
            max_batch=opts.integer("max_batch", max_inflight, low=1),
            poll_interval_s=opts.number("poll_interval_s", DEFAULT_POLL_INTERVAL_S, low=0.0),
            hot_poll_s=opts.seconds_or_none("hot_poll_s", DEFAULT_HOT_POLL_S),
            batch_status=opts.choice("batch_status", "auto", BATCH_STATUS_MODES),
        )


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


class Pieces:
    """A chunk's transfers not yet handed to the engine: source addresses,
    destination addresses and lengths as lists (the binding takes lists),
    consumed from the front."""

    __slots__ = ("_dsts", "_lens", "_next", "_srcs")

    def __init__(self, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        self._srcs, self._dsts, self._lens = srcs, dsts, lens
        self._next = 0

    def __len__(self) -> int:
        return len(self._lens) - self._next

    def take(self, count: int) -> tuple[list[int], list[int], list[int]]:
        """The next ``count`` transfers (fewer if fewer are left)."""
        a, b = self._next, min(self._next + count, len(self._lens))
        self._next = b
        return self._srcs[a:b], self._dsts[a:b], self._lens[a:b]

    def clear(self) -> None:
        self._next = len(self._lens)


@attrs.define(eq=False)
class Posted:
    """The token ``on_post`` returns: one chunk's transfers."""

    generation: int
    session: str
    pending: Pieces
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
        self.options = WriterOptions.parse(options)
        self.nbytes = nbytes
        self.memory = MemoryOptions.parse(options)
        self._mem = open_memory(nbytes, self.memory)
        self.base: int = self._mem.addr
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        #: Per peer session, (batch id, segments in it, token) in submission
        #: order. A peer's pieces complete in order, so a poll stops at the
        #: first one still pending: O(completed) engine calls per poll.
        self._inflight: dict[str, collections.deque[tuple[int, int, Posted]]] = {}
        #: Per peer session, segments in flight (the engine's per-peer cap).
        self._inflight_n: dict[str, int] = {}
        #: Non-blocking many-task batch status (None: one transfer per segment).
        self._poller: BatchPoller | None = None
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
        self._poller = None if self.options.batch_status == "off" else bind(engine)
        if self._poller is None and self.options.batch_status == "on":
            raise RuntimeError(
                "mooncake batch_status=on, but the batch status check is unavailable (see log)"
            )
        self._engine = engine

    @property
    def batched(self) -> bool:
        """Whether segments go as many-task batches (else one transfer each)."""
        return self._poller is not None

    def _drop_engine(self) -> bool:
        """Forget every in-flight id and destroy the engine (call with the
        lock). False if something else still holds the engine: then it lives
        on, and its writes with it."""
        self._inflight.clear()
        self._inflight_n.clear()
        self._queued.clear()
        self._poller = None  # holds a reference to the engine: drop it first
        engine, self._engine = self._engine, None
        gc.collect()
        # Our name and getrefcount's argument only (a raising hook's frames,
        # kept by a traceback, would hold it too).
        alone = engine is None or sys.getrefcount(engine) <= 2
        del engine  # if alone, the destructor joins the transport threads
        gc.collect()
        return alone

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
        engine = self._engine  # in this frame only: a fence must find no other reference
        inflight = self._inflight.setdefault(tok.session, collections.deque())
        used = self._inflight_n.get(tok.session, 0)
        while tok.pending and used < self.options.max_inflight:
            if self._poller is None:
                (src,), (dst,), (n,) = tok.pending.take(1)
                bid = engine.transfer_submit_write(tok.session, src, dst, n)
                count = 1
            else:
                srcs, dsts, lens = tok.pending.take(
                    min(self.options.max_inflight - used, self.options.max_batch)
                )
                count = len(lens)
                bid = engine.batch_transfer_async_write(tok.session, srcs, dsts, lens)
            if bid in _BAD_IDS:
                # 2**64-1: the segment could not be opened, nothing was sent. 0 (a
                # batch): submitTransfer failed, perhaps after enqueueing part of it.
                if self._poller is not None and bid == 0:
                    tok.submitted += count
                tok.failed = True
                tok.pending.clear()
                break
            inflight.append((bid, count, tok))
            used += count
            tok.inflight += count
            tok.submitted += count
        self._inflight_n[tok.session] = used

    def _check(self, bid: int) -> int:
        """1 done (freed), 0 pending, else failed or timed out (never look at it again)."""
        if self._poller is not None:
            return self._poller.poll(bid)
        # transfer_check_status: 1 and -1 freed the batch inside the engine; -2
        # (timeout) did not.
        rc: int = self._engine.transfer_check_status(bid)
        return rc

    def _progress(self) -> None:
        for session, inflight in self._inflight.items():
            done = 0
            while inflight:
                bid, count, tok = inflight[0]
                rc = self._check(bid)
                if rc == PENDING:
                    break
                inflight.popleft()
                tok.inflight -= count
                if rc == DONE:
                    done += count
                else:
                    # Its other tasks may still sit in the engine's queue: their
                    # credits come back with the fence, not now.
                    tok.failed = True
                    tok.pending.clear()
            if done:
                self._inflight_n[session] -= done
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
            if self._closed:
                raise RuntimeError("mooncake writer is closed")
            peer = self._peers.get(chunk.peer)
            if peer is None:
                raise KeyError(f"mooncake writer not connected to peer {chunk.peer!r}")
            srcs, dsts, lens = SegmentTable.of(segments).columns_within(
                self.nbytes, peer.nbytes, self.base, peer.base
            )
            work = Pieces(srcs, dsts, lens)
            tok = Posted(self._generation, peer.session, work, sum(lens))
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
        sleep = min(5e-5, self.options.poll_interval_s)
        # Poll hot first (see DEFAULT_HOT_POLL_S), as the raw API's blocking
        # status call spins, then sleep between polls.
        hot_until = (
            math.inf if self.options.hot_poll_s is None else time.monotonic() + self.options.hot_poll_s
        )
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
                # Pieces held back by max_inflight are submitted only here:
                # keep polling hot while any wait, or the engine may idle.
                hot = now < hot_until or bool(self._queued)
            if hot:
                # Hands the GIL to a waiting thread (the rank's listener) as
                # sleep(0) would, without sleeping: on Linux sleep(0) sleeps
                # the timer slack (50 us, ~100 us measured), and a poll per
                # sleep noticed 64 KiB chunks done 40% late.
                os.sched_yield()
                continue
            time.sleep(min(sleep, max(0.0, deadline - now)))
            sleep = min(sleep * 2, self.options.poll_interval_s)

    @hookimpl
    def on_fence(self) -> bool | None:
        """Destroy the engine (every connection closes), then open a new one.

        The core calls this with no worker inside on_post / on_done_barrier,
        so no thread is inside an engine call and the engine has no other
        reference: ``del`` really destroys it (measured: 0 bytes land after).
        """
        if self._protocol != "tcp":
            return None  # not proven there (see MooncakeBackend.capabilities_for)
        start = time.monotonic()
        with self._lock:
            self._generation += 1
            for tok in [tok for q in self._inflight.values() for _, _, tok in q] + list(self._queued):
                tok.abandoned = True
                tok.pending.clear()
            destroyed = self._drop_engine()
            if not self._closed:
                self._open_engine()  # same targets: a new engine reaches the same session ids
        self.last_fence_s = time.monotonic() - start
        return destroyed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._generation += 1
            self._drop_engine()


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

    def capabilities_for(self, options: Mapping[str, str]) -> Capabilities:
        """The same with any valid options, but for ``protocol``: the fence is
        proven over tcp only. The core asks before it starts processes, so a
        bad option fails there and then."""
        _, protocol, _ = engine_settings(options)
        MemoryOptions.parse(options)
        WriterOptions.parse(options)
        if protocol != "tcp":
            # Untested: writes already handed to an RDMA NIC, and its own
            # retries, are not shown to stop with the engine.
            return attrs.evolve(self.capabilities, writer_fence=False)
        return self.capabilities

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> MooncakeRegion:
        return MooncakeRegion(nbytes, options)

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> MooncakeWriter:
        return MooncakeWriter(nbytes, options)


backend = MooncakeBackend()
