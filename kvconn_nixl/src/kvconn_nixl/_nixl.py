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

from kvconn.memory import MEMORY_KINDS, Memory
from kvconn.options import BackendOptions

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
# region metadata: b"KVNX" v1, mem, dev, addr, len, name, agent metadata

_MAGIC = b"KVNX"
_HEAD = struct.Struct("<4sBBHQQII")


@attrs.frozen
class RegionInfo:
    agent_name: str
    agent_md: bytes
    addr: int
    nbytes: int
    mem: str  # "DRAM" | "VRAM"
    dev_id: int

    def encode(self) -> bytes:
        name = self.agent_name.encode()
        head = _HEAD.pack(
            _MAGIC,
            1,
            1 if self.mem == "VRAM" else 0,
            self.dev_id,
            self.addr,
            self.nbytes,
            len(name),
            len(self.agent_md),
        )
        return head + name + self.agent_md

    @classmethod
    def decode(cls, data: bytes) -> RegionInfo:
        if len(data) < _HEAD.size:
            raise ValueError("nixl region metadata too short")
        magic, ver, mem, dev, addr, nbytes, nlen, mlen = _HEAD.unpack_from(data)
        if magic != _MAGIC or ver != 1:
            raise ValueError("not kvconn-nixl region metadata (bad magic/version)")
        if len(data) != _HEAD.size + nlen + mlen:
            raise ValueError("nixl region metadata has the wrong length")
        off = _HEAD.size
        name = data[off : off + nlen].decode()
        return cls(name, bytes(data[off + nlen :]), addr, nbytes, "VRAM" if mem else "DRAM", dev)


# --------------------------------------------------------------------------
# memory


def open_memory(nbytes: int, opts: Options) -> Memory:
    """Zeroed page or source memory of the kind ``opts`` names."""
    return Memory(nbytes, opts.memory, opts.device)


def register(agent: Any, mem: Memory, opts: Options) -> Any:
    return agent.register_memory([(mem.addr, mem.nbytes, opts.dev_id, "")], opts.nixl_mem)


#: Up to this many rows, descriptors are built from Python lists: numpy's
#: per-call cost on a row or two (cold after the previous transfer) made a
#: 1 MiB chunk 8% slower and a 64 KiB chunk 12% (interleaved, same agent).
LIST_MAX_ROWS = 16


def write_xfer(
    agent: Any,
    opts: Options,
    base: int,
    peer: RegionInfo,
    rows: npt.NDArray[np.int64] | Sequence[tuple[int, int, int]],
) -> Any:
    """A prepared WRITE handle for ``rows`` (``(n, 3)`` int64, or a list of
    triples: source offset, destination offset, bytes) from ``agent``'s
    memory at ``base`` into ``peer``'s region: one transfer of every row."""
    if not isinstance(rows, np.ndarray):
        return agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs([(base + s, n, opts.dev_id) for s, _, n in rows], opts.nixl_mem),
            agent.get_xfer_descs([(peer.addr + d, n, peer.dev_id) for _, d, n in rows], peer.mem),
            peer.agent_name,
        )
    n = len(rows)
    local = np.empty((n, 3), dtype=np.uint64)
    local[:, 0] = rows[:, 0].astype(np.uint64) + np.uint64(base)
    local[:, 1] = rows[:, 2].astype(np.uint64)
    local[:, 2] = opts.dev_id
    remote = np.empty((n, 3), dtype=np.uint64)
    remote[:, 0] = rows[:, 1].astype(np.uint64) + np.uint64(peer.addr)
    remote[:, 1] = local[:, 1]
    remote[:, 2] = peer.dev_id
    return agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs(local, opts.nixl_mem),
        agent.get_xfer_descs(remote, peer.mem),
        peer.agent_name,
    )
