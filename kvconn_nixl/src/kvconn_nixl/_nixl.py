"""Everything that touches the nixl package: environment, agent factory,
region metadata and page memory.

nixl is imported lazily (first agent), after the environment below is in
place, so that merely importing :mod:`kvconn_nixl` (entry-point discovery)
costs nothing and a user never meets the UCX segfault-at-exit.
"""

from __future__ import annotations

import glob
import importlib
import itertools
import logging
import os
import struct
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvconn.buffers import Buffer, FlatSpace, buffers_of
from kvconn.memory import MEMORY_KINDS, MemorySpace
from kvconn.options import BackendOptions, OptionError

#: Set (if unset) before nixl/UCX is loaded. ``UCX_MODULES=^ib``: without it
#: every process that made a UCX agent segfaults at exit (bundled libnl-route
#: destructor). ``NIXL_LOG_LEVEL=WARN``: nixl prints INFO lines to stdout.
DEFAULT_ENV = {"UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}

INSTALL_HINT = (
    "kvconn-nixl needs nixl 1.5.1 installed without its torch dependency: "
    "pip install numpy && pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
)

_lock = threading.Lock()  # env tweaks + agent construction
_api: Any = None
_names = itertools.count()


def prepare_env() -> None:
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)


def nixl_api() -> Any:
    """Import ``nixl._api`` once, with the environment prepared first."""
    global _api
    if _api is None:
        prepare_env()
        # importing nixl sets logging.raiseExceptions = False process-wide.
        raise_exc = logging.raiseExceptions
        try:
            _api = importlib.import_module("nixl._api")
        except ImportError as exc:  # pragma: no cover - depends on install
            raise ImportError(INSTALL_HINT) from exc
        finally:
            logging.raiseExceptions = raise_exc
    return _api


def remote_disconnect_error() -> type[BaseException] | None:
    bind = importlib.import_module("nixl._bindings")
    err = getattr(bind, "nixlRemoteDisconnectError", None)
    return err if isinstance(err, type) else None


# --------------------------------------------------------------------------
# options


#: The UCX transport selections whose writer-side fence (destroy the agent
#: after dropping every handle) has been proven by tests/nixl/test_nixl_fence.py
#: (tcp) and by the conformance suite on an H200 host (tcp,cuda_copy), for DRAM
#: pages only: see :attr:`Options.fence_proven`.
FENCE_PROVEN_TLS = frozenset({frozenset({"tcp"}), frozenset({"tcp", "cuda_copy"})})

#: Set (overriding the environment) while an agent's UCX context is created.
#: ``UCX_TCP_PUT_ENABLE=y`` (UCX's default): a NIXL WRITE between host buffers
#: is then a tcp PUT zcopy (``put/offload/zcopy``), which the page owner's UCT
#: layer receives and acks by itself. With ``n`` UCX emulates it
#: (``put/am/bcopy``): the owner's UCP acks every fragment with a request of
#: its own (``ucp_put_handler`` -> ``ucp_rma_sw_send_cmpl``), and once the
#: writer's agent is gone (fence, or killed) that request meets a failed
#: endpoint and UCX 1.23 aborts the owner (ucp_request.inl:356 "Fatal:
#: unexpected error: Endpoint timeout"; tests/nixl/test_nixl_fence.py).
FORCED_UCX_ENV = {"UCX_TCP_PUT_ENABLE": "y"}


def gpu_present() -> bool:
    """An NVIDIA GPU is visible. NIXL then refuses UCX_TLS without a CUDA
    transport ("NVIDIA GPU(s) are present, but this setting does not enable
    CUDA memory support"), even for DRAM."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*"))


def default_ucx_tls() -> str:
    return "tcp,cuda_copy" if gpu_present() else "tcp"


@attrs.frozen
class Options:
    """Parsed ``options`` mapping (all values are strings, as the core passes)."""

    #: UCX_TLS for this endpoint's agent. "tcp" (default; "tcp,cuda_copy" on a
    #: host with an NVIDIA GPU): data moves over sockets, the writer fence is
    #: proven. "default": let UCX choose (cma + tcp here); "DONE" then means
    #: landed, but no fence is claimed.
    ucx_tls: str = attrs.field(factory=default_ucx_tls)
    #: UCX network devices (UCX_NET_DEVICES while the agent is created). "lo"
    #: (default): this host only, as ``cross_host=False`` declares; without it
    #: UCX also stripes a PUT over every other interface (here 52% lo, 48%
    #: eth0, to this host's own eth0 address). Empty: UCX chooses (writers on
    #: other hosts; untested). Accelerator transports (cuda_copy) are not
    #: network devices and are not affected.
    net_devices: str = "lo"
    #: "dram" or "vram".
    memory: str = "dram"
    #: CUDA device id for memory=vram.
    device: int = 0
    #: Progress thread. Page owners need one (a UCX tcp target that nobody
    #: progresses refuses the connection); writers progress by hand inside
    #: on_done_barrier unless this is set.
    progress_thread: bool | None = None
    #: Progress-thread sleep (NIXL pthrDelay, us). nixl's Python wrapper
    #: hard-codes 0, which busy-spins a core per idle agent.
    progress_delay_us: int = 1000
    #: How long (s) a writer's DONE barrier polls without sleeping before it
    #: polls every 0.1 ms; ``None``: until the chunk settles (its deadline
    #: still ends the wait). Without a progress thread the data moves only
    #: while check_xfer_state is called, as in the raw API's own wait loop:
    #: a sleeping barrier stalls its transfer.
    hot_poll_s: float | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> Options:
        opts = BackendOptions("nixl", options, {f.name for f in attrs.fields(cls)})
        return cls(
            ucx_tls=opts.text("ucx_tls") or default_ucx_tls(),
            net_devices=opts.text("net_devices", "lo"),
            memory=opts.choice("memory", "dram", MEMORY_KINDS),
            device=opts.integer("device", 0, low=0),
            progress_thread=opts.flag("progress_thread") if "progress_thread" in options else None,
            progress_delay_us=opts.integer("progress_delay_us", 1000, low=0),
            hot_poll_s=opts.seconds_or_none("hot_poll_s", None),
        )

    @property
    def cross_host(self) -> bool:
        """Writers on other hosts: proven by the conformance suite across
        hosts for an agent pinned to a network interface over tcp, DRAM
        (``lo`` cannot leave this host; UCX's own pick, ``default``, is cma
        here and untested across hosts)."""
        devices = {d.strip() for d in self.net_devices.split(",")}
        return bool(self.net_devices) and "lo" not in devices and self.fence_proven

    @property
    def fence_proven(self) -> bool:
        # Not for VRAM: tcp registers host memory only, so UCX emulates a PUT
        # to or from device memory (put/am/bcopy or put/rndv) and the owner
        # acks every fragment itself (see FORCED_UCX_ENV). After the writer's
        # agent is destroyed, UCX aborts the resumed owner (seen on an H200):
        # the teardown is no fence there.
        tls = frozenset(t.strip() for t in self.ucx_tls.split(","))
        return self.memory == "dram" and tls in FENCE_PROVEN_TLS

    @property
    def nixl_mem(self) -> str:
        return "VRAM" if self.memory == "vram" else "DRAM"

    @property
    def dev_id(self) -> int:
        return self.device if self.memory == "vram" else 0


# --------------------------------------------------------------------------
# agents


def check_net_devices(devices: str, sysfs: str = "/sys/class/net") -> None:
    """Refuse a network interface this host (its network namespace) does not
    have, by name: UCX only says "no usable transports/devices" and NIXL
    ``NIXL_ERR_BACKEND``. An interface that exists without carrier (a
    partition) passes; UCX then refuses it, and a fence copes."""
    present = set(os.listdir(sysfs)) if os.path.isdir(sysfs) else set()
    for device in (d.strip() for d in devices.split(",")):
        # "all", and IB-style "mlx5_0:1" names, are UCX's to judge.
        if device and device != "all" and ":" not in device and device not in present:
            raise OptionError(
                f"nixl option net_devices={devices!r}: this host has no network interface {device!r} "
                f"(it has: {', '.join(sorted(present)) or 'none'})"
            )


def make_agent(role: str, opts: Options, progress_thread: bool) -> Any:
    """Build a ``nixl_agent`` with UCX only, the requested UCX_TLS, a real
    progress-thread delay and a serialising sync mode (hooks run on several
    worker threads at once)."""
    api = nixl_api()
    bind = api.nixlBind
    delay = max(0, opts.progress_delay_us)

    class _Config(bind.nixlAgentConfig):  # type: ignore[misc,name-defined]
        # nixl_agent.__init__ writes pthrDelay = 0; keep ours instead.
        @property
        def pthrDelay(self) -> int:
            return int(bind.nixlAgentConfig.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:
            bind.nixlAgentConfig.pthrDelay.__set__(self, delay)

    class _Bind:
        nixlAgentConfig = _Config

        def __getattr__(self, name: str) -> Any:
            return getattr(bind, name)

    name = f"kvconn-{role}-{os.getpid()}-{next(_names)}-{uuid.uuid4().hex[:8]}"
    conf = api.nixl_agent_config(
        enable_prog_thread=progress_thread,
        backends=[],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    check_net_devices(opts.net_devices)
    env = dict(FORCED_UCX_ENV)
    if opts.ucx_tls != "default":
        env["UCX_TLS"] = opts.ucx_tls
    if opts.net_devices:
        # Not NIXL's "device_list" param: nixl 1.5.1 appends an IB port to each
        # name ("lo:1"), which no tcp device matches.
        env["UCX_NET_DEVICES"] = opts.net_devices
    with _lock:
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        api.nixlBind = _Bind()
        try:
            agent = api.nixl_agent(name, conf)
            # UCX reads its UCX_* variables when the backend (its context) is created.
            agent.create_backend("UCX", {})
        finally:
            api.nixlBind = bind
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return agent


# --------------------------------------------------------------------------
# region metadata: b"KVNX" v2, mem, dev, buffer count, name length, agent
# metadata length, then (addr, len) per buffer, the name, the agent metadata

_MAGIC = b"KVNX"
_HEAD = struct.Struct("<4sBBHIII")
_RANGE = struct.Struct("<QQ")
_MAX_BUFFERS = 1 << 16


@attrs.frozen
class RegionInfo:
    agent_name: str
    agent_md: bytes
    #: (address, bytes) of each registered buffer, in the region's offset order
    buffers: tuple[tuple[int, int], ...]
    mem: str  # "DRAM" | "VRAM"
    dev_id: int

    @property
    def addr(self) -> int:
        return self.buffers[0][0]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.buffers)

    def space(self) -> FlatSpace:
        """The region's offsets as addresses on its host."""
        kind = "vram" if self.mem == "VRAM" else "dram"
        return FlatSpace([Buffer(a, n, kind, self.dev_id) for a, n in self.buffers])

    def encode(self) -> bytes:
        name = self.agent_name.encode()
        head = _HEAD.pack(
            _MAGIC,
            2,
            1 if self.mem == "VRAM" else 0,
            self.dev_id,
            len(self.buffers),
            len(name),
            len(self.agent_md),
        )
        ranges = b"".join(_RANGE.pack(a, n) for a, n in self.buffers)
        return head + ranges + name + self.agent_md

    @classmethod
    def decode(cls, data: bytes) -> RegionInfo:
        if len(data) < _HEAD.size:
            raise ValueError("nixl region metadata too short")
        magic, ver, mem, dev, count, nlen, mlen = _HEAD.unpack_from(data)
        if magic != _MAGIC or ver != 2:
            raise ValueError("not kvconn-nixl region metadata (bad magic/version)")
        if not 0 < count <= _MAX_BUFFERS or len(data) != _HEAD.size + count * _RANGE.size + nlen + mlen:
            raise ValueError("nixl region metadata has the wrong length")
        off = _HEAD.size
        buffers = tuple(_RANGE.unpack_from(data, off + i * _RANGE.size) for i in range(count))
        off += count * _RANGE.size
        name = data[off : off + nlen].decode()
        return cls(name, bytes(data[off + nlen :]), buffers, "VRAM" if mem else "DRAM", dev)


# --------------------------------------------------------------------------
# memory


class Space(MemorySpace):
    """An endpoint's registered memory (see :class:`~kvconn.memory.MemorySpace`),
    with its NIXL memory type and device."""

    def __init__(self, source: int | Sequence[Buffer], opts: Options) -> None:
        super().__init__(source, opts.memory, opts.dev_id)
        self.mem_type = "VRAM" if self.kind == "vram" else "DRAM"
        self.dev_id = self.device


def options_for(source: int | Sequence[Buffer], opts: Options) -> Options:
    """``opts`` with the memory kind and device of engine buffers (which
    decide them: the fence, for one, is proven for DRAM only)."""
    if isinstance(source, int):
        return opts
    bufs = buffers_of(source)
    return attrs.evolve(opts, memory=bufs[0].kind, device=bufs[0].device if bufs[0].kind == "vram" else 0)


def open_memory(source: int | Sequence[Buffer], opts: Options) -> Space:
    """Page or source memory: zeroed of the kind ``opts`` names, or the engine's."""
    return Space(source, opts)


def register(agent: Any, mem: Space, opts: Options) -> Any:
    """One registration of every buffer (a descriptor list)."""
    return agent.register_memory([(a, n, mem.dev_id, "") for a, n in mem.ranges()], mem.mem_type)


#: Up to this many rows, descriptors are built from Python lists: numpy's
#: per-call cost on a row or two (cold after the previous transfer) made a
#: 1 MiB chunk 8% slower and a 64 KiB chunk 12% (interleaved, same agent).
LIST_MAX_ROWS = 16


class _Scratch(threading.local):
    """Each thread's descriptor arrays, reused from chunk to chunk: nixl
    copies a descriptor list into its own (``get_xfer_descs``), and new
    arrays for a chunk of 20,000 segments (480 KB each) were fresh pages to
    fault in every time, about as long as filling them."""

    def __init__(self) -> None:
        self.local = np.empty((0, 3), dtype=np.uint64)
        self.remote = np.empty((0, 3), dtype=np.uint64)

    def descriptors(self, n: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """Two ``(n, 3)`` uint64 arrays (address, bytes, device) to fill."""
        if len(self.local) < n:
            self.local = np.empty((n, 3), dtype=np.uint64)
            self.remote = np.empty((n, 3), dtype=np.uint64)
        return self.local[:n], self.remote[:n]


_scratch = _Scratch()


def write_xfer(
    agent: Any,
    opts: Options,
    local: Space,
    peer: RegionInfo,
    rows: npt.NDArray[np.int64] | Sequence[tuple[int, int, int]],
    peer_space: FlatSpace | None = None,
) -> Any:
    """A prepared WRITE handle for ``rows`` (``(n, 3)`` int64, or a list of
    triples: source offset, destination offset, bytes) from ``local`` into
    ``peer``'s region: one transfer of every row. Offsets become addresses
    in numpy (``peer_space``: ``peer.space()``, kept by the caller)."""
    single = len(local.flat.buffers) == 1 and len(peer.buffers) == 1
    base = local.addr
    if single and not isinstance(rows, np.ndarray):
        return agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs([(base + s, n, local.dev_id) for s, _, n in rows], local.mem_type),
            agent.get_xfer_descs([(peer.addr + d, n, peer.dev_id) for _, d, n in rows], peer.mem),
            peer.agent_name,
        )
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    local_descs, remote = _scratch.descriptors(len(rows))
    local_descs[:, 1] = remote[:, 1] = rows[:, 2]
    if single:
        local_descs[:, 0] = rows[:, 0]
        local_descs[:, 0] += base
        remote[:, 0] = rows[:, 1]
        remote[:, 0] += peer.addr
    else:
        space = peer_space if peer_space is not None else peer.space()
        local_descs[:, 0] = local.flat.locate(rows[:, 0], rows[:, 2])[0]
        remote[:, 0] = space.locate(rows[:, 1], rows[:, 2])[0]
    local_descs[:, 2] = local.dev_id
    remote[:, 2] = peer.dev_id
    return agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs(local_descs, local.mem_type),
        agent.get_xfer_descs(remote, peer.mem),
        peer.agent_name,
    )
