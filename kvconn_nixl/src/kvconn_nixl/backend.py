"""The NIXL backend: a page region on decode, a writer on each prefill rank."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import numpy.typing as npt

from kvconn.buffers import Buffer, FlatSpace
from kvconn.chunk import Chunk, Segment, SegmentTable
from kvconn.hookspecs import hookimpl
from kvconn.transport import (
    Capabilities,
    FencedWithoutEndpoint,
    OwnerFenceFailed,
    OwnerFenceUnsupported,
    Settlement,
)
from kvconn_nixl._nixl import (
    LIST_MAX_ROWS,
    Options,
    RegionInfo,
    make_agent,
    open_memory,
    options_for,
    register,
    remote_disconnect_error,
    write_xfer,
)

__all__ = ["NixlBackend", "NixlRegion", "NixlWriter", "backend"]

log = logging.getLogger(__name__)

#: The DONE barrier's sleep between polls once past ``hot_poll_s``, or
#: always with a progress thread (which moves the data by itself).
POLL_SLEEP_S = 0.0001
#: While polling hot, yield the GIL once in this many polls (see on_done_barrier).
YIELD_EVERY = 64
#: How long a barrier past its deadline polls a copy cma already made in
#: transfer() for completion (not the transfer itself: without a fence it
#: must not be driven any further).
PAST_DEADLINE_POLL_S = 0.005


class NixlRegion:
    """Decode's page memory, registered with its own agent.

    The agent runs a progress thread (with a sleep, see ``progress_delay_us``):
    a UCX tcp target that nobody progresses refuses the writer's connection,
    so writes land without anyone polling the region from Python.
    """

    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str]) -> None:
        """``source``: bytes to allocate, or the engine's buffers to register."""
        self.options = options_for(source, Options.parse(options))
        self._mem = open_memory(source, self.options)
        self.nbytes = self._mem.nbytes
        # Always: nothing lands in pages whose agent nobody progresses
        # (``progress_thread`` is the writers' choice).
        self._agent: Any = None
        self._reg: Any = None
        #: An agent a failed fence could not destroy (still referenced).
        self._outliving: weakref.ref[Any] | None = None
        self._closed = False
        self.metadata = self._new_agent()
        #: Seconds the last owner_fence took (teardown + new agent).
        self.last_owner_fence_s = 0.0

    def _new_agent(self) -> bytes:
        self._agent = make_agent("region", self.options, progress_thread=True)
        self._reg = register(self._agent, self._mem, self.options)
        return RegionInfo(
            agent_name=self._agent.name,
            agent_md=self._agent.get_agent_metadata(),
            buffers=self._mem.ranges(),
            mem=self._mem.mem_type,
            dev_id=self._mem.dev_id,
        ).encode()

    def owner_fence(self) -> bytes:
        """Destroy the region's whole agent (every UCX endpoint and socket a
        writer reached it through) and register the same memory with a new
        one; the new metadata. Measured over tcp: no byte posted to the old
        agent lands after it, from a frozen writer resumed or a partition
        healed. Writers must connect again with the new metadata.

        ``FencedWithoutEndpoint``: the old agent is gone, but UCX refused the
        new one (it does while the pinned interface has no carrier: "No such
        device"). The fence holds all the same (no agent, nothing can land);
        the next call only makes the agent."""
        if not self.options.fence_proven:
            raise OwnerFenceUnsupported(
                f"nixl owner fence: not proven for ucx_tls={self.options.ucx_tls} / {self.options.memory}"
            )
        t0 = time.monotonic()
        if self._outliving is not None:
            gc.collect()
            if self._outliving() is not None:
                # An earlier fence's agent is still referenced somewhere: it
                # may still take writes, so nothing is proven yet.
                raise OwnerFenceFailed("nixl owner fence: an earlier agent still outlives its last reference")
            self._outliving = None
        if self._agent is not None:
            wrapper, reg = self._agent, self._reg
            self._agent = self._reg = None
            binding = wrapper.agent
            with contextlib.suppress(Exception):  # the agent's destruction deregisters it anyway
                wrapper.deregister_memory(reg)
            gc.collect()
            agent_left = weakref.ref(binding)
            del wrapper, reg, binding  # UCX closes every endpoint and socket of it
            gc.collect()
            if agent_left() is not None:
                # Held elsewhere (a traceback's frame): not destroyed, so no
                # fence; every later call fails too until it is.
                self._outliving = agent_left
                raise OwnerFenceFailed("nixl owner fence: the region's agent outlived its last reference")
        # Only once the old agent is gone.
        try:
            self.metadata = self._new_agent()
        except Exception as exc:  # nixl raises its own (nixlBackendError, RuntimeError) classes
            self._agent = self._reg = None
            raise FencedWithoutEndpoint(
                f"nixl owner fence: the old agent is gone, a new one could not be made: {exc}"
            ) from exc
        finally:
            self.last_owner_fence_s = time.monotonic() - t0
        return self.metadata

    def array(self) -> np.ndarray:
        """The region's DRAM buffer, without a copy (tests, verification)."""
        return self._mem.array()

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._mem.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self._mem.write(offset, data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._agent is not None:  # None: an owner fence destroyed it and made none
                self._agent.deregister_memory(self._reg)
        finally:
            self._reg = None
            self._agent = None
            gc.collect()
            self._mem.free()


@attrs.frozen
class _Peer:
    info: RegionInfo
    metadata: bytes
    space: FlatSpace


@attrs.frozen
class Posted:
    """What ``on_post`` returns: keys into the writer's handle table, never the
    NIXL handles themselves (a handle referenced from outside would keep the
    agent alive through a fence)."""

    keys: tuple[int, ...]
    generation: int
    nbytes: int


def unreachable(options: Options, agent_name: str, exc: BaseException) -> str:
    """What a writer says when UCX cannot reach a region's agent (UCX itself
    only logs "Destination is unreachable" and NIXL raises NIXL_ERR_BACKEND):
    which interface it was pinned to, and the likely cause."""
    devices = options.net_devices or "UCX's choice"
    hint = (
        "net_devices=lo reaches this host only: a writer and a region on different hosts each need "
        "net_devices=<their host's interface on the network they share>"
        if "lo" in {d.strip() for d in options.net_devices.split(",")}
        else "the region's agent may listen on an interface this host cannot reach (its net_devices=lo, "
        "or another network): every endpoint needs net_devices=<its host's interface on the network they share>"
    )
    return (
        f"nixl: this writer (net_devices={devices}, ucx_tls={options.ucx_tls}) cannot reach the region's "
        f"agent {agent_name}: {exc}; {hint}"
    )


class NixlWriter:
    """A prefill rank's source memory and NIXL agent.

    Registered with the rank's pluggy manager; answers ``on_post``,
    ``on_done_barrier`` and ``on_fence``.
    """

    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str]) -> None:
        """``source``: bytes to allocate, or the engine's buffers to register."""
        self.options = options_for(source, Options.parse(options))
        self._mem = open_memory(source, self.options)
        self.nbytes = self._mem.nbytes
        self._prog = bool(self.options.progress_thread)
        self._lock = threading.Lock()  # handle table, peers, agent swap
        self._handles: dict[int, Any] = {}
        self._keys = itertools.count()
        self._peers: dict[str, _Peer] = {}
        self._generation = 0
        #: Posts of a generation below this were on an agent a fence proved
        #: destroyed; a failed fence moves the generation but not this.
        self._destroyed_below = 0
        self._disconnect = remote_disconnect_error()
        self._agent: Any = None
        self._reg: Any = None
        self._new_agent()
        #: Seconds the last on_fence took (teardown + new agent + reconnect).
        self.last_fence_s = 0.0

    # -- memory ----------------------------------------------------------
    def array(self) -> np.ndarray:
        return self._mem.array()

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._mem.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self._mem.write(offset, data)

    # -- connections -----------------------------------------------------
    def _new_agent(self) -> None:
        self._agent = make_agent("writer", self.options, progress_thread=self._prog)
        self._reg = register(self._agent, self._mem, self.options)

    def _ensure_agent(self) -> Any:
        """(With the lock.) The agent, made again (with every peer loaded) if a
        fence destroyed the last one and could not make its successor: UCX
        refuses a new agent while its pinned interface has no carrier (a
        partition), and the fence itself is done once the old one is gone."""
        agent: Any = self._agent
        if agent is None:
            self._new_agent()
            agent = self._agent
            for name, peer in self._peers.items():
                try:
                    agent.add_remote_agent(peer.info.agent_md)
                except Exception as exc:  # a peer gone: the next post to it fails (and fences)
                    log.warning("nixl: could not reconnect to %s: %r", name, exc)
        return agent

    def connect(self, peer: str, metadata: bytes) -> None:
        info = RegionInfo.decode(metadata)
        with self._lock:
            self._ensure_agent()
            old = self._peers.get(peer)
            if old is not None and old.info.agent_name != info.agent_name:
                with contextlib.suppress(Exception):  # best effort, peer may be gone
                    self._agent.remove_remote_agent(old.info.agent_name)
            if old is None or old.metadata != metadata:
                try:
                    name = self._agent.add_remote_agent(info.agent_md)
                except Exception as exc:
                    raise ConnectionError(unreachable(self.options, info.agent_name, exc)) from exc
                if isinstance(name, bytes):
                    name = name.decode()
                if name != info.agent_name:
                    raise ValueError(f"metadata names agent {info.agent_name!r}, nixl loaded {name!r}")
            self._peers[peer] = _Peer(info, metadata, info.space())

    # -- hooks -----------------------------------------------------------
    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> Posted:
        peer = self._peers.get(chunk.peer)
        if peer is None:
            raise KeyError(f"peer {chunk.peer!r} is not connected")
        segs = SegmentTable.of(segments)
        rows: npt.NDArray[np.int64] | list[tuple[int, int, int]]
        if len(segs) <= LIST_MAX_ROWS:
            srcs, dsts, lens = segs.columns_within(self.nbytes, peer.info.nbytes)
            rows, nbytes = list(zip(srcs, dsts, lens, strict=True)), sum(lens)
        else:
            rows = segs.rows_within(self.nbytes, peer.info.nbytes)
            nbytes = int(rows[:, 2].sum())
        if not len(rows):
            return Posted((), self._generation, 0)
        with self._lock:
            agent = self._ensure_agent()
        handle = write_xfer(agent, self.options, self._mem, peer.info, rows, peer.space)
        with self._lock:
            key = next(self._keys)
            self._handles[key] = handle
            generation = self._generation
        del handle
        # May raise (no ERR state in nixl): the core then poisons the room,
        # and the handle stays in the table until settled or fenced.
        state = agent.transfer(self._handles[key])
        if state == "ERR":
            raise RuntimeError("nixl transfer() returned ERR")
        return Posted((key,), generation, nbytes)

    def _done_soon(self, agent: Any, keys: Sequence[int]) -> bool:
        """Whether every handle is DONE within a few polls: a copy cma made
        inside transfer() completes only as UCX progresses, which a poll does
        (one poll was not always enough: the request was still in progress)."""
        give_up = time.monotonic() + PAST_DEADLINE_POLL_S
        while not self._all_done(agent, keys):
            if time.monotonic() >= give_up:
                return False
        return True

    def _all_done(self, agent: Any, keys: Sequence[int]) -> bool:
        for key in keys:
            handle = self._handles.get(key)
            try:
                if handle is None or agent.check_xfer_state(handle) != "DONE":
                    return False
            except Exception:  # nixl raises instead of ERR
                return False
        return True

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement | None:
        if not isinstance(posted, Posted):
            return None  # not ours
        if posted.generation != self._generation:
            # The agent these handles belonged to was destroyed by on_fence:
            # nothing of them can land any more. (A fence that failed after
            # dropping the handles proved nothing: they may still write.)
            if posted.generation < self._destroyed_below:
                return Settlement.FAILED_SETTLED
            return Settlement.UNSETTLED
        agent = self._agent
        if posted.keys and time.monotonic() >= deadline:
            # Past the deadline on arrival (e.g. frozen inside on_post): give
            # up without progressing the transfer any further. Over cma,
            # transfer() copied in this thread before it returned: a handle
            # already DONE landed, and saying so spares a fence nobody has.
            if not self.options.fence_proven and self._done_soon(agent, posted.keys):
                for key in posted.keys:
                    self._release(key)
                return Settlement.LANDED
            return Settlement.UNSETTLED
        hot = self.options.hot_poll_s
        hot_until = math.inf if hot is None else time.monotonic() + hot
        pending = list(posted.keys)
        failed = False
        unsettled = False
        spins = 0
        while pending:
            for key in list(pending):
                handle = self._handles.get(key)
                if handle is None:  # released by someone else: treat as lost
                    pending.remove(key)
                    unsettled = True
                    continue
                try:
                    state = agent.check_xfer_state(handle)
                except BaseException as exc:  # nixl raises instead of ERR
                    state = "DISC" if self._disconnect and isinstance(exc, self._disconnect) else "ERR"
                if state == "PROC":
                    continue
                pending.remove(key)
                failed = failed or state != "DONE"
                if state == "ERR":
                    # An unknown error does not prove the handle's other
                    # requests are done; keep it for the fence.
                    unsettled = True
                    continue
                # DONE, or the peer disconnected (UCX purged the endpoint's
                # requests): settled, release it.
                self._release(key)
            del handle
            if not pending:
                break
            spins += 1
            # Without a progress thread the data moves only inside
            # check_xfer_state, so poll hot, as the raw API's wait loop does.
            # Every YIELD_EVERY polls, hand the GIL over to the rank's
            # listener (an ABORT waits for it) with os.sched_yield(), not
            # sleep(0): on Linux that sleeps the timer slack (~0.1 ms here),
            # and a 1 MiB chunk, which polls more than 64 times, took 5.5%
            # longer than the raw loop with it, 0.5-2.6% with sched_yield
            # (variants interleaved chunk by chunk; 64 KiB and 64 MiB: equal).
            if self._prog or time.monotonic() >= hot_until:
                time.sleep(POLL_SLEEP_S)
            elif spins % YIELD_EVERY == 0:
                os.sched_yield()
            # Checked right before polling again, so a writer that was frozen
            # past its deadline gives up without moving more data first.
            if time.monotonic() >= deadline:
                return Settlement.UNSETTLED
        if unsettled:
            return Settlement.UNSETTLED
        return Settlement.FAILED_SETTLED if failed else Settlement.LANDED

    def _release(self, key: int) -> None:
        with self._lock:
            handle = self._handles.pop(key, None)
        if handle is not None:
            try:
                handle.release()
            except Exception:
                with self._lock:
                    self._handles[key] = handle

    @hookimpl
    def on_fence(self) -> bool | None:
        """Destroy the agent after dropping every handle, then rebuild it.

        Only answered for the UCX transport selections where tests proved it
        (``ucx_tls=tcp``); otherwise ``None`` (rooms stay poisoned). ``False``
        when something else still holds the agent: it cannot be destroyed now.
        """
        with self._lock:
            vram_peer = any(p.info.mem != "DRAM" for p in self._peers.values())
        if not self.options.fence_proven or vram_peer:
            # Proven for DRAM pages on both sides only: a PUT to device memory
            # over tcp is emulated, and the teardown is no fence there.
            return None
        t0 = time.monotonic()
        # Under the lock connect() takes: a Hello during the fence waits for it.
        with self._lock:
            if self._agent is None:
                # An earlier fence destroyed the agent and no successor could
                # be made since: nothing was posted, nothing can write.
                self._generation += 1
                self._destroyed_below = self._generation
                self.last_fence_s = time.monotonic() - t0
                return True
            handles = list(self._handles.values())
            self._handles.clear()
            self._generation += 1
            while handles:
                with contextlib.suppress(Exception):  # in flight: destroyed with the agent
                    handles.pop().release()
            wrapper, reg = self._agent, self._reg
            self._agent = self._reg = None
            binding = wrapper.agent
            gc.collect()
            # Only the wrapper, our local name and getrefcount's argument may
            # hold the agent, and only our two names the wrapper; anything else
            # would keep it, and its connections, alive.
            if sys.getrefcount(binding) > 3 or sys.getrefcount(wrapper) > 2:
                # No fence now (the rooms stay poisoned), but the writer keeps
                # its agent and goes on writing; a later fence tries again.
                self._agent, self._reg = wrapper, reg
                log.warning("nixl fence: the agent is still referenced elsewhere, so not destroyed")
                return False
            # The counts above are CPython's and may differ elsewhere (3.14
            # borrows references): the proof is the agent itself being gone.
            agent_left = weakref.ref(binding)
            del wrapper, reg, binding  # ~10-30 ms: UCX closes every endpoint and socket
            destroyed = agent_left() is None
            try:
                self._ensure_agent()
            except Exception as exc:
                if not destroyed:
                    raise
                # Partitioned: the old agent is gone, which is the fence; the
                # next connect or post makes the new one.
                self._agent = self._reg = None
                log.warning("nixl fence: agent destroyed; its successor is made later (%r)", exc)
            if not destroyed:
                # Writing goes on through the new agent; the old one, and
                # anything it still carries, lives on: no fence.
                log.warning("nixl fence: the agent outlived its last reference here, so not destroyed")
                return False
            self._destroyed_below = self._generation
        self.last_fence_s = time.monotonic() - t0
        return True

    def close(self) -> None:
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            self._peers.clear()
        while handles:
            with contextlib.suppress(Exception):
                handles.pop().release()
        self._agent = None
        self._reg = None
        gc.collect()
        self._mem.free()


class NixlBackend:
    """The object behind the ``kvconn.backends`` entry point ``nixl``."""

    name = "nixl"
    #: What binds an endpoint to a host's network (the conformance suite's
    #: cross-host mode fills these in for each host).
    host_options: ClassVar[dict[str, str]] = {"net_devices": "{iface}"}

    def __init__(self) -> None:
        # The defaults, bound to a host's interface (host_options): the
        # default net_devices=lo reaches this host only (capabilities_for).
        self.capabilities = attrs.evolve(self.capabilities_for({}), cross_host=True)

    @staticmethod
    def capabilities_for(options: Mapping[str, str]) -> Capabilities:
        """Capabilities of endpoints opened with ``options`` (the class-level
        ``capabilities`` are those of the defaults, ``ucx_tls=tcp``)."""
        opts = Options.parse(options)
        return Capabilities(
            writer_fence=opts.fence_proven,
            owner_fence=opts.fence_proven,
            memory=frozenset({"dram", "vram"}),
            cross_host=opts.cross_host,
            max_write_timeout_s=None,
            notes=(
                f"NIXL 1.5.1 / UCX, UCX_TLS={opts.ucx_tls}. writer_fence: destroy the "
                "agent after dropping every handle; owner_fence: the region destroys its whole "
                "agent and registers its memory with a new one (both proven for tcp and DRAM only: over "
                "tcp UCX emulates a PUT to or from VRAM, the owner acks each fragment, "
                "and UCX 1.23 aborts an owner whose writer vanished). vram: "
                "implemented (cupy/torch allocation), untested here. cross_host: with "
                "net_devices=<interface> (not lo), tcp, DRAM: the conformance suite across hosts. A frozen peer leaves transfers PROC forever: deadlines "
                "come from the core."
            ),
        )

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> NixlRegion:
        return NixlRegion(nbytes, options)

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> NixlWriter:
        return NixlWriter(nbytes, options)

    def register_region(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> NixlRegion:
        """Decode's engine buffers as one region (one ``register_memory`` of
        their descriptor list); ``close()`` deregisters them."""
        return NixlRegion(buffers, options)

    def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> NixlWriter:
        """A prefill rank's engine buffers as its source (one ``register_memory``)."""
        return NixlWriter(buffers, options)


backend = NixlBackend()
