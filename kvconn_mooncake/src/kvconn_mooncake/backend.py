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
* A writer has an engine per decode region (:class:`Channel`): the engine's
  P2P handshake with a frozen decode takes ~61 s and holds up every call on
  that engine (measured: a write to a live decode on the same engine waited
  59 s). Handshakes run on a thread of their own, as a 0-byte write; a chunk
  posted meanwhile waits for it, and fails settled at its deadline.
* ``on_fence`` destroys the engine of every channel that may have a write in
  flight (closes every connection its late pieces would travel on); its
  channel opens a new one. Channels whose every batch completed keep theirs:
  a teardown takes ~1 s with the GIL held.
* A channel that needs an engine takes an idle one (nothing of it can land
  later): a replaced channel's, or past ``max_engines`` the least recently
  used channel's, so a decode that left does not keep an engine for the
  writer's lifetime. Past ``max_engines`` a new channel opens at its first
  post, not at ``connect``.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import numpy.typing as npt

from kvconn.buffers import Buffer
from kvconn.chunk import Chunk, Segment, SegmentTable
from kvconn.hookspecs import hookimpl
from kvconn.sockets import resetting_closed_sockets
from kvconn.transport import Capabilities, Settlement
from kvconn_mooncake._batch_status import DONE, PENDING, BatchPoller, bind
from kvconn_mooncake._channel import Channel, Pieces, Posted
from kvconn_mooncake._engine import (
    configure_env,
    engine_settings,
    engine_timeout_s,
    new_engine,
)
from kvconn_mooncake._memory import (
    MEMORY_KINDS,
    MemoryOptions,
    cuda_engine_installed,
    open_space,
    register_space,
)
from kvconn_mooncake._options import WriterOptions
from kvconn_mooncake._region import MooncakeRegion

configure_env()
log = logging.getLogger(__name__)

_BAD_IDS = (0, 2**64 - 1, -1)


class MooncakeWriter:
    """A prefill rank's endpoint: source memory and a :class:`Channel` (an
    engine of its own) per decode region it writes to, so that it can fence.

    Hooks may run on several worker threads at once; one lock serialises the
    (short, non-blocking) engine calls and the bookkeeping. Handshakes, the
    one blocking engine call, run on opening threads outside it.
    """

    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str]) -> None:
        """``source``: bytes to allocate, or the engine's buffers to register."""
        if isinstance(source, int) and source <= 0:
            raise ValueError("source size must be positive")
        self._host, self._protocol, self._device = engine_settings(options)
        self.options = WriterOptions.parse(options)
        self.memory = MemoryOptions.parse(options)
        self._mem = open_space(source, self.memory)
        self.nbytes = self._mem.nbytes
        self.base: int = self._mem.addr
        self._lock = threading.Lock()
        self._channels: dict[str, Channel] = {}
        #: Channels replaced by a later connect(): polled until their writes
        #: settle, fenced like the others, and first to hand on an idle engine.
        self._retired: list[Channel] = []
        #: Engines a fence took out but could not destroy (something else held
        #: them): every fence tries again, and answers True only once none is left.
        self._zombies: list[Any] = []
        self._generation = 0
        self._posts = 0
        self._closed = False
        self.last_fence_s: float | None = None
        #: Made here, so bad settings fail now: the first channel takes it.
        self._spare: tuple[Any, BatchPoller | None] | None = self._new_engine()

    # -- memory -------------------------------------------------------------

    def array(self) -> npt.NDArray[np.uint8]:
        """The source's DRAM buffer, without a copy (DRAM only). A method, not
        a property: pluggy reads every attribute of a registered plugin."""
        return self._mem.array()

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._mem.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self._mem.write(offset, data)

    # -- channels -------------------------------------------------------------

    def connect(self, peer: str, metadata: bytes) -> None:
        """Open a channel to ``peer``'s region. The handshake starts now, on a
        thread of its own (the decode that sent the Hello is alive), when an
        engine is at hand: below ``max_engines``, or a replaced channel's idle
        one. Past the limit it starts at the channel's first post (or
        :meth:`wait_open`), so a burst of Hellos does not pass engines around
        among channels that never write."""
        channel = Channel.of(metadata)
        with self._lock:
            if self._closed:
                raise RuntimeError("mooncake writer is closed")
            known = self._channels.get(peer)
            if known is not None:
                if known.same_region(channel):
                    return
                known.fail_queued()  # never submitted there now
                self._retired.append(known)
            self._channels[peer] = channel
            if self._engine_at_hand():
                self._start_opening(channel)

    def channel(self, peer: str) -> Channel:
        with self._lock:
            return self._channels[peer]

    def wait_open(self, peer: str, timeout_s: float) -> bool:
        """Open ``peer``'s channel if it is not opening yet; whether it opened
        within ``timeout_s`` (for callers that would rather wait than have
        the first chunk wait)."""
        end = time.monotonic() + timeout_s
        with self._lock:
            channel = self._channels[peer]
            self._start_opening(channel)
        while not channel.opened:
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)
        return True

    @property
    def batched(self) -> bool:
        """Whether segments go as many-task batches (else one transfer each;
        each engine's self-test decides for its channel)."""
        if self.options.batch_status == "off":
            return False
        with self._lock:
            pollers = [c.poller for c in self._channels.values() if c.engine is not None]
            if self._spare is not None:
                pollers.append(self._spare[1])
        return bool(pollers) and all(p is not None for p in pollers)

    def _new_engine(self) -> tuple[Any, BatchPoller | None]:
        engine = new_engine(self._host, self._protocol, self._device)
        register_space(engine, self._mem)
        poller = None if self.options.batch_status == "off" else bind(engine)
        if poller is None and self.options.batch_status == "on":
            raise RuntimeError("mooncake batch_status=on, but the batch status check failed (see log)")
        return engine, poller

    def _start_opening(self, channel: Channel) -> None:
        """(With the lock.) One opening thread per channel at a time."""
        if channel.opened or channel.opening or self._closed:
            return
        if channel.engine is None and self._spare is not None:
            (channel.engine, channel.poller), self._spare = self._spare, None
        if channel.engine is None:
            self._adopt_idle_engine(channel)
        channel.opening = True
        threading.Thread(target=self._open, args=(channel,), name="kvconn-mooncake-open", daemon=True).start()

    def _engine_at_hand(self) -> bool:
        """(With the lock.) Whether a channel could open now without taking a
        live channel's engine."""
        return (
            self._spare is not None
            or any(c.idle for c in self._retired)
            or self._engines() < self.options.max_engines
        )

    def _engines(self) -> int:
        """(With the lock.) Engines alive or being made, bar zombies."""
        channels = [*self._channels.values(), *self._retired]
        return sum(c.engine is not None or c.opening for c in channels) + (self._spare is not None)

    def _adopt_idle_engine(self, channel: Channel) -> None:
        """(With the lock.) Give ``channel`` an idle engine: a replaced
        channel's (never written again, its engine is a spare), or past
        ``max_engines`` the least recently used live channel's. None idle: it
        makes its own, so engines stay bounded by max_engines or by the most
        channels busy at once.

        Nothing of the donor's can land later (every batch completed), so its
        engine carries only what ``channel`` posts from now on: a fence then
        treats it as ``channel``'s. Reusing it also spares the rank the ~1 s
        teardown (GIL held) that destroying it would cost.
        """
        idle = [c for c in self._retired if c.idle]
        if not idle and self._engines() >= self.options.max_engines:
            idle = [c for c in self._channels.values() if c.idle]
        if not idle:
            return
        donor = min(idle, key=lambda c: c.last_post)
        if donor in self._retired:
            self._retired.remove(donor)
        channel.poller = donor.poller
        channel.engine = self._take_engine(donor)

    def _open(self, channel: Channel) -> None:
        """An opening thread: make the channel's engine if it has none, then
        shake hands by writing 0 bytes (opens the session, moves nothing),
        polled without blocking."""
        with self._lock:
            engine, poller = channel.engine, channel.poller
        ok = False
        try:
            if engine is None:
                engine, poller = self._new_engine()
            bid = engine.transfer_submit_write(channel.session, self.base, channel.base, 0)
            rc = PENDING
            while bid not in _BAD_IDS and rc == PENDING:
                time.sleep(0.0002)
                rc = engine.transfer_check_status(bid)
            ok = rc == DONE
            if not ok:
                log.warning(
                    "mooncake: no handshake with %s (batch id %s, status %s)", channel.session, bid, rc
                )
        except Exception as exc:
            log.warning("mooncake: cannot open a channel to %s: %s", channel.session, repr(exc))
        with self._lock:
            channel.opening = False
            if not self._closed:  # else: this engine carried nothing, let it go
                channel.engine, channel.poller = engine, poller
                channel.opened = ok
                if ok:
                    self._progress()
                else:
                    # Nothing of these chunks reached an engine: they fail settled,
                    # and the next post tries the handshake again.
                    channel.fail_queued()
            # Under the lock: a fence right after must find no reference here.
            del engine, poller

    # -- progress (call with self._lock held) ---------------------------------

    def _submit(self, channel: Channel, tok: Posted) -> None:
        engine = channel.engine  # in this frame only: a fence must find no other reference
        used = channel.inflight_n
        while tok.pending and used < self.options.max_inflight:
            if channel.poller is None:
                srcs, dsts, lens = tok.pending.take(1)
            else:
                srcs, dsts, lens = tok.pending.take(
                    min(self.options.max_inflight - used, self.options.max_batch)
                )
            count = len(lens)
            raised = False
            try:
                if channel.poller is None:
                    bid = engine.transfer_submit_write(channel.session, srcs[0], dsts[0], lens[0])
                else:
                    bid = engine.batch_transfer_async_write(channel.session, srcs, dsts, lens)
            except Exception as exc:
                log.error("mooncake: a write to %s raised: %s", channel.session, repr(exc))
                bid, raised = 0, True
            if bid in _BAD_IDS:
                # 2**64-1: the segment could not be opened, nothing was sent. 0 (a
                # batch), or a call that raised: it failed, perhaps after queueing
                # part of it, so it counts as handed over and the engine is suspect.
                if raised or (channel.poller is not None and bid == 0):
                    tok.submitted += count
                    channel.suspect = True
                tok.fail()
                break
            channel.inflight.append((bid, count, tok))
            used += count
            tok.inflight += count
            tok.submitted += count
        channel.inflight_n = used

    def _check(self, channel: Channel, bid: int) -> int:
        """1 done (freed), 0 pending, else failed or timed out (never look at it again)."""
        if channel.poller is not None:
            return channel.poller.poll(bid)
        # transfer_check_status: 1 and -1 freed the batch inside the engine; -2
        # (timeout) did not.
        rc: int = channel.engine.transfer_check_status(bid)
        return rc

    def _progress(self) -> None:
        for channel in self._channels.values():
            if channel.opened:
                self._progress_channel(channel)
        for channel in self._retired:
            if channel.opened:
                self._poll(channel)  # its chunks in flight settle; nothing more is submitted

    def _progress_channel(self, channel: Channel) -> None:
        self._poll(channel)
        while channel.queued:
            tok = channel.queued[0]
            if tok.abandoned or tok.failed:
                tok.pending.clear()
            else:
                self._submit(channel, tok)
            if tok.pending:
                break
            channel.queued.popleft()

    def _poll(self, channel: Channel) -> None:
        """Settle the channel's batches that finished, oldest first."""
        done = 0
        while channel.inflight:
            bid, count, tok = channel.inflight[0]
            rc = self._check(channel, bid)
            if rc == PENDING:
                break
            channel.inflight.popleft()
            tok.inflight -= count
            if rc == DONE:
                done += count
            else:
                # Its other tasks may still sit in the engine's queue: their
                # credits come back with the fence, not now.
                channel.suspect = True
                tok.fail()
        channel.inflight_n -= done

    # -- hooks ----------------------------------------------------------------

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> object | None:
        with self._lock:
            if self._closed:
                raise RuntimeError("mooncake writer is closed")
            channel = self._channels.get(chunk.peer)
            if channel is None:
                raise KeyError(f"mooncake writer not connected to peer {chunk.peer!r}")
            srcs, dsts, lens = self._addresses(SegmentTable.of(segments), channel)
            tok = Posted(self._generation, channel, Pieces(srcs, dsts, lens), sum(lens))
            if not lens:
                return tok
            self._posts += 1
            channel.last_post = self._posts
            channel.queued.append(tok)  # behind chunks waiting for credits or the handshake
            if channel.opened:
                self._progress_channel(channel)
            else:
                self._start_opening(channel)
            return tok

    def _addresses(self, table: SegmentTable, channel: Channel) -> tuple[list[int], list[int], list[int]]:
        """Source addresses, destination addresses and lengths of ``table``'s
        segments (checked to lie inside, and within one buffer each side)."""
        if self._mem.single and len(channel.buffers) == 1:
            return table.columns_within(self.nbytes, channel.nbytes, self.base, channel.base)
        rows = table.rows_within(self.nbytes, channel.nbytes)
        srcs = self._mem.flat.locate(rows[:, 0], rows[:, 2])[0]
        assert channel.space is not None  # Channel.of made it
        dsts = channel.space.locate(rows[:, 1], rows[:, 2])[0]
        return srcs.tolist(), dsts.tolist(), rows[:, 2].tolist()

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
        channel = posted.channel
        while True:
            with self._lock:
                if posted.generation != self._generation:
                    return Settlement.UNSETTLED  # fenced under it: it never settled
                if posted.done and not posted.failed:
                    return Settlement.LANDED
                if not posted.failed:
                    self._progress()
                if posted.failed:
                    return posted.give_up()
                if posted.done:
                    return Settlement.LANDED
                now = time.monotonic()
                if now >= deadline:
                    return posted.give_up()  # settled if still waiting for a handshake or credits
                # Pieces held back by max_inflight are submitted only here:
                # keep polling hot while any wait, or the engine may idle. A
                # channel still shaking hands is waited for asleep.
                hot = channel.opened and (now < hot_until or bool(channel.queued))
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
        """Destroy the engine of every channel that may have a write in flight
        (every connection it had closes); the others keep theirs.

        The core calls this with no worker inside on_post / on_done_barrier,
        so no thread is inside an engine call that carried data (an opening
        thread's engine carries nothing that can land later) and such an
        engine has no other reference: ``del`` really destroys it (measured:
        0 bytes land after). Its channel opens a new engine at once, on an
        opening thread, once every engine to destroy is taken: an idle one,
        a replaced channel's first, may be handed to it (``max_engines``).
        """
        if self._protocol != "tcp":
            return None  # not proven there (see MooncakeBackend.capabilities_for)
        start = time.monotonic()
        with self._lock:
            self._generation += 1
            reopen = []
            for channel in [*self._channels.values(), *self._retired]:
                for tok in [tok for _, _, tok in channel.inflight] + list(channel.queued):
                    tok.abandon()
                channel.queued.clear()
                if channel.opened and (channel.inflight or channel.suspect):
                    self._zombies.append(self._take_engine(channel))
                    reopen.append(channel)
            # A replaced channel is kept while it has an engine (idle: nothing of
            # it can land, and the next channel needing one takes it) or opens one.
            self._retired = [c for c in self._retired if c.engine is not None or c.opening]
            for channel in reopen:
                if channel in self._channels.values():
                    self._start_opening(channel)
            # The engines' connections reset, not closed: a closed one's queued
            # bytes would land once a partition heals (measured).
            with resetting_closed_sockets():
                destroyed = self._destroy_zombies()
        self.last_fence_s = time.monotonic() - start
        return destroyed

    def _take_engine(self, channel: Channel) -> Any:
        """(With the lock.) The channel's engine, the channel left without one."""
        engine = channel.engine
        channel.engine = channel.poller = None  # the poller holds the engine too
        channel.opened = channel.suspect = False
        channel.inflight.clear()
        channel.inflight_n = 0
        return engine

    def _destroy_zombies(self) -> bool:
        """(With the lock.) Destroy every engine that only ``_zombies`` holds
        (~1 s each, the GIL held); True if none is left."""
        gc.collect()
        # Only the list and getrefcount's argument may hold a zombie (a raising
        # hook's frames, kept by a traceback, would hold it too). By index: a
        # loop variable, or enumerate's tuple, would count as a holder.
        zombies = self._zombies
        alive = [i for i in range(len(zombies)) if sys.getrefcount(zombies[i]) > 2]
        zombies[:] = [zombies[i] for i in alive]  # the others' destructors join their transport threads
        gc.collect()
        return not zombies

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._generation += 1
            for channel in [*self._channels.values(), *self._retired]:
                if channel.opening:
                    channel.engine = channel.poller = None  # its opening thread lets it go
                elif channel.engine is not None:
                    self._zombies.append(self._take_engine(channel))
            if self._spare is not None:
                spare, self._spare = self._spare[0], None  # and its poller, which holds it too
                self._zombies.append(spare)
                del spare
            self._destroy_zombies()


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@attrs.frozen
class MooncakeBackend:
    """The object behind the ``kvconn.backends`` entry point ``mooncake``."""

    name: str = "mooncake"
    #: What binds an endpoint to a host's network (the conformance suite's
    #: cross-host mode fills these in for each host).
    host_options: ClassVar[dict[str, str]] = {"host": "{ip}"}
    capabilities: Capabilities = attrs.field(
        factory=lambda: Capabilities(
            writer_fence=True,
            owner_fence=True,
            memory=frozenset(MEMORY_KINDS if cuda_engine_installed() else ("dram",)),
            cross_host=True,
            max_write_timeout_s=engine_timeout_s(),
            notes=(
                "Mooncake TE 0.3.13 over P2PHANDSHAKE; tcp tested on one host and across hosts (host=<address>), rdma untested. "
                "Failed writes count as UNSETTLED (a failed call may still write). Fence = destroy "
                "and re-create the engine of each decode with writes in flight (~1 s each); proven for a stalled writer; for a stalled "
                "page owner the core waits for decode's ends of the closed connections to drain (8 MiB "
                "measured in its socket buffers). Owner fence (tcp): the region destroys its engine and "
                "registers its memory with a new one of its own (refused while another region shares the engine). Engine timeout from MC_TRANSFER_TIMEOUT / MC_TCP_STATUS_TIMEOUT_SEC (min 5 s). "
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
        host, protocol, _ = engine_settings(options)
        MemoryOptions.parse(options)
        WriterOptions.parse(options)
        # The engine timeout as the engines made from now on will read it (the
        # environment may have changed since this backend was loaded).
        caps = attrs.evolve(self.capabilities, max_write_timeout_s=engine_timeout_s())
        if protocol != "tcp":
            # Untested: writes already handed to an RDMA NIC, and its own
            # retries, are not shown to stop with the engine.
            return attrs.evolve(caps, writer_fence=False, owner_fence=False, cross_host=False)
        if _loopback(host):
            # Peers on other hosts cannot reach an engine bound to loopback.
            return attrs.evolve(caps, cross_host=False)
        return caps

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> MooncakeRegion:
        return MooncakeRegion(nbytes, options)

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> MooncakeWriter:
        return MooncakeWriter(nbytes, options)

    def register_region(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> MooncakeRegion:
        """Decode's engine buffers as one region (registered with the
        process's shared engine, in one batch); ``close()`` unregisters them."""
        return MooncakeRegion(buffers, options)

    def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> MooncakeWriter:
        """A prefill rank's engine buffers as its source (registered with
        each engine the writer makes)."""
        return MooncakeWriter(buffers, options)


backend = MooncakeBackend()
