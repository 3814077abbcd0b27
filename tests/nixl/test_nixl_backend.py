"""The NIXL backend across real processes: integrity, two writers, a killed
and a frozen page owner. Hooks are called through a real pluggy manager."""

from __future__ import annotations

import importlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import kvconn_nixl
from kvconn.testing.libraries import require_library

kvconn_nixl.prepare_env()  # before anything imports nixl (UCX_MODULES=^ib)
require_library("nixl", module_level=True)  # by the library: the plugin installs without it

import numpy as np  # noqa: E402
import pluggy  # noqa: E402
from nixl_procs import PAGE, Child, children, decode_main, pattern, writer_main  # noqa: E402

from kvconn.chunk import Chunk, Segment  # noqa: E402
from kvconn.testing.inprocess import hooks_of  # noqa: E402
from kvconn.transport import FencedWithoutEndpoint, Settlement, Writer  # noqa: E402
from kvconn_nixl import FENCE_PROVEN_TLS, Options, backend  # noqa: E402

backend_module = importlib.import_module("kvconn_nixl.backend")  # the module (``backend`` is its object)
from kvconn_nixl._nixl import RegionInfo  # noqa: E402

MiB = 1 << 20
REGION = 96 * MiB
SRC = 80 * MiB
SEED = 7


def chunk(peer: str = "decode", room: int = 1, index: int = 0) -> Chunk:
    return Chunk(room=room, index=index, last=True, rank=0, peer=peer, src_pages=(), dst_pages=())


def write(pm: pluggy.PluginManager, segs: list[Segment], timeout: float = 20, room: int = 1) -> Settlement:
    c = chunk(room=room)
    posted = pm.hook.on_post(chunk=c, segments=segs)
    st = pm.hook.on_done_barrier(chunk=c, posted=posted, deadline=time.monotonic() + timeout)
    assert isinstance(st, Settlement)
    return st


def as_rows(segs: list[Segment]) -> list[tuple[int, int, int]]:
    return [(s.src, s.dst, s.nbytes) for s in segs]


def shapes() -> dict[str, list[Segment]]:
    rng = np.random.default_rng(3)
    src_pages = rng.permutation(SRC // PAGE)[:1024]
    dst_pages = rng.permutation(REGION // PAGE)[:1024]
    return {
        "one_page": [Segment(5 * PAGE, 17 * PAGE, PAGE)],
        "scattered_1024x4k": [
            Segment(int(s) * PAGE, int(d) * PAGE, PAGE) for s, d in zip(src_pages, dst_pages, strict=False)
        ],
        "1mib": [Segment(3 * MiB, 90 * MiB, MiB)],
        "64mib": [Segment(8 * MiB, 20 * MiB, 64 * MiB)],
        "odd_sizes": [Segment(1, 3, 1), Segment(100, 10_000, 12_345), Segment(SRC - 777, REGION - 777, 777)],
    }


# ------------------------------------------------------------------ units


def test_entry_point_and_capabilities() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="kvconn.backends") if e.name == "nixl"]
    assert ep.load() is backend
    assert backend.name == "nixl"
    assert backend.capabilities.writer_fence is True  # default ucx_tls=tcp
    assert backend.capabilities.memory == frozenset({"dram", "vram"})
    assert backend.capabilities_for({"ucx_tls": "default"}).writer_fence is False
    assert Options.parse({"ucx_tls": "tcp"}).fence_proven
    assert Options.parse({"ucx_tls": "cuda_copy, tcp"}).fence_proven
    assert not Options.parse({"ucx_tls": "tcp,cuda_copy", "memory": "vram"}).fence_proven
    assert not Options.parse({"ucx_tls": "tcp,cma"}).fence_proven
    assert frozenset({"tcp"}) in FENCE_PROVEN_TLS
    with pytest.raises(ValueError, match="unknown nixl option 'bogus'"):
        Options.parse({"bogus": "1"})
    with pytest.raises(ValueError, match="did you mean 'hot_poll_s'"):
        backend.capabilities_for({"hot_pol_s": "1"})
    with pytest.raises(ValueError, match=r"progress_thread='maybe': expected a flag"):
        Options.parse({"progress_thread": "maybe"})
    with pytest.raises(ValueError):
        Options.parse({"memory": "hbm"})
    assert Options.parse({}).hot_poll_s is None
    assert Options.parse({}).net_devices == "lo"  # this host only (cross_host=False)
    assert backend.capabilities.cross_host is True  # once bound to an interface (host_options)
    assert backend.capabilities_for({}).cross_host is False  # net_devices=lo: this host only
    assert backend.capabilities_for({"net_devices": "eth1"}).cross_host is True  # the suite across hosts
    assert backend.capabilities_for({"net_devices": "eth1,lo"}).cross_host is False
    assert backend.capabilities_for({"net_devices": ""}).cross_host is False  # UCX's pick: untested
    assert backend.capabilities_for({"net_devices": "eth1", "ucx_tls": "default"}).cross_host is False
    assert backend.host_options == {"net_devices": "{iface}"}
    assert Options.parse({"net_devices": ""}).net_devices == ""  # UCX chooses
    assert Options.parse({"hot_poll_s": "none"}).hot_poll_s is None
    assert Options.parse({"hot_poll_s": "0.25"}).hot_poll_s == 0.25
    with pytest.raises(ValueError):
        Options.parse({"hot_poll_s": "-1"})


def test_metadata_roundtrip_and_rejects_garbage() -> None:
    ranges = ((0x7F00_0000_1000, 123 * MiB), (0x7F00_4000_0000, 5))
    info = RegionInfo("agent-x", b"\x00md\xff" * 10, ranges, "VRAM", 3)
    assert (info.addr, info.nbytes) == (0x7F00_0000_1000, 123 * MiB + 5)
    assert RegionInfo.decode(info.encode()) == info
    for bad in (b"", b"nope" * 20, info.encode()[:-1], info.encode() + b"x"):
        with pytest.raises(ValueError):
            RegionInfo.decode(bad)


def test_writer_rejects_out_of_range_and_unknown_peer() -> None:
    region = backend.open_region(MiB, {})
    writer = backend.open_writer(MiB, {})
    try:
        assert isinstance(writer, Writer)
        writer.connect("decode", region.metadata)
        pm = hooks_of(writer)
        with pytest.raises(ValueError):
            pm.hook.on_post(chunk=chunk(), segments=[Segment(0, MiB - 10, 11)])
        with pytest.raises(ValueError):
            pm.hook.on_post(chunk=chunk(), segments=[Segment(MiB - 10, 0, 11)])
        with pytest.raises(KeyError):
            pm.hook.on_post(chunk=chunk(peer="nobody"), segments=[Segment(0, 0, 1)])
        assert write(pm, []) is Settlement.LANDED
        writer.write(0, b"hello")
        assert write(pm, [Segment(0, 42, 5)]) is Settlement.LANDED
        assert region.read(42, 5) == b"hello"
    finally:
        writer.close()
        region.close()


def test_net_devices_reaches_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    """net_devices becomes UCX_NET_DEVICES of the agent: a device UCX does not
    have fails the agent (nixl's own "device_list" param was silently
    ignored for tcp devices). kvconn's own check of the name is set aside
    here, so that UCX is the one to refuse it."""
    monkeypatch.setattr(
        importlib.import_module("kvconn_nixl._nixl"), "check_net_devices", lambda devices: None
    )
    with pytest.raises(Exception, match="NIXL_ERR_BACKEND"):
        backend.open_writer(MiB, {"net_devices": "nosuchdev0"})
    writer = backend.open_writer(MiB, {"net_devices": "lo"})
    writer.close()


def test_a_barrier_that_sleeps_between_polls_still_lands_every_byte() -> None:
    """hot_poll_s=0: no hot polling, the barrier sleeps 0.1 ms between polls
    (and without a progress thread, moves the data only when it polls)."""
    region = backend.open_region(16 * MiB, {})
    writer = backend.open_writer(8 * MiB, {"hot_poll_s": "0"})
    try:
        writer.connect("decode", region.metadata)
        data = np.random.default_rng(5).integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes()
        writer.write(0, data)
        segs = [Segment(i * MiB, (15 - 2 * i) * MiB, MiB) for i in range(8)]
        assert write(hooks_of(writer), segs) is Settlement.LANDED
        for i in range(8):
            assert region.read((15 - 2 * i) * MiB, MiB) == data[i * MiB : (i + 1) * MiB]
    finally:
        writer.close()
        region.close()


# ------------------------------------------------------------------ across processes


@pytest.fixture(scope="module", params=["tcp", "default"])
def tls(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def decode(tls: str) -> Iterator[Child]:
    with children((decode_main, REGION, {"ucx_tls": tls})) as (child,):
        yield child


@pytest.fixture(scope="module")
def writer(tls: str, decode: Child) -> Iterator[Any]:
    w = backend.open_writer(SRC, {"ucx_tls": tls})
    w.array()[:] = pattern(SEED, SRC)
    w.connect("decode", decode.hello)
    yield w
    w.close()


@pytest.mark.parametrize("shape", list(shapes()))
def test_integrity(shape: str, decode: Child, writer: Any) -> None:
    segs = shapes()[shape]
    decode.call("fill", 0)
    pm = hooks_of(writer)
    t0 = time.perf_counter()
    assert write(pm, segs) is Settlement.LANDED
    dt = time.perf_counter() - t0
    nbytes = sum(s.nbytes for s in segs)
    print(f"{shape}: {nbytes} B in {dt * 1e3:.2f} ms ({nbytes / dt / 1e9:.2f} GB/s)")
    assert decode.call("verify", SEED, SRC, as_rows(segs), timeout=60) == 0
    # nothing else was touched
    assert decode.call("nonzero") <= nbytes


def test_concurrent_workers(decode: Child, writer: Any) -> None:
    """Hooks from several worker threads at once, each its own chunk."""
    decode.call("fill", 0)
    pm = hooks_of(writer)
    rows: list[list[Segment]] = [
        [Segment((t * 64 + i) * PAGE * 4, (t * 64 + i) * PAGE * 5, PAGE * 4) for i in range(64)]
        for t in range(4)
    ]
    results: list[Settlement | None] = [None] * 4

    def run(t: int) -> None:
        for rep in range(5):
            results[t] = write(pm, rows[t], room=10 + t + rep)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert results == [Settlement.LANDED] * 4
    assert decode.call("verify", SEED, SRC, [r for t in rows for r in as_rows(t)]) == 0


def test_two_writer_processes_one_region(tls: str, decode: Child) -> None:
    decode.call("fill", 0)
    half = REGION // 2
    segs = {
        0: [(int(p) * PAGE, int(p) * PAGE, PAGE) for p in range(0, half // PAGE, 3)],
        1: [(int(p) * PAGE, half + int(p) * PAGE, PAGE) for p in range(0, half // PAGE, 3)],
    }
    opts = {"ucx_tls": tls}
    with children((writer_main, half, opts), (writer_main, half, opts)) as writers:
        for i, w in enumerate(writers):
            w.call("connect", "decode", decode.hello)
            w.call("fill_seed", 100 + i)
        for i, w in enumerate(writers):  # both in flight at once
            w.send("write", "decode", segs[i], 20)
        for w in writers:
            st, _secs = w.recv(60)
            assert st == "landed", st
    for i in (0, 1):
        assert decode.call("verify", 100 + i, half, segs[i], timeout=60) == 0


def test_fence_then_write_again_in_process() -> None:
    """(f) on a writer in this process: fence, then writes land correctly."""
    with children((decode_main, 8 * MiB, {})) as (dec,):
        w = backend.open_writer(8 * MiB, {})
        try:
            w.array()[:] = pattern(5, 8 * MiB)
            w.connect("decode", dec.hello)
            pm = hooks_of(w)
            assert write(pm, [Segment(0, 0, 4 * MiB)]) is Settlement.LANDED
            assert pm.hook.on_fence() is True
            assert w.last_fence_s < 5
            segs = [Segment(4 * MiB + i * PAGE, 4 * MiB + (255 - i) * PAGE, PAGE) for i in range(256)]
            assert write(pm, segs) is Settlement.LANDED
            assert dec.call("verify", 5, 8 * MiB, [*as_rows(segs), (0, 0, 4 * MiB)]) == 0
        finally:
            w.close()


def test_a_fence_whose_new_agent_fails_still_fences(monkeypatch: pytest.MonkeyPatch) -> None:
    """Partitioned, UCX refuses a new agent on the pinned interface (no
    carrier): the fence destroyed the old agent, so it still fenced (a
    fence that raised would keep the rank from ever acking); the next post
    makes the agent again and lands."""
    with children((decode_main, 8 * MiB, {})) as (dec,):
        w = backend.open_writer(8 * MiB, {})
        try:
            w.array()[:] = pattern(6, 8 * MiB)
            w.connect("decode", dec.hello)
            pm = hooks_of(w)
            assert write(pm, [Segment(0, 0, MiB)]) is Settlement.LANDED
            real = backend_module.make_agent

            def no_carrier(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("NIXL_ERR_BACKEND (no carrier)")

            monkeypatch.setattr(backend_module, "make_agent", no_carrier)
            assert pm.hook.on_fence() is True
            assert w._agent is None
            assert pm.hook.on_fence() is True  # nothing to destroy: still fenced
            with pytest.raises(RuntimeError, match="no carrier"):
                write(pm, [Segment(MiB, MiB, MiB)])  # no agent can be made yet: the post fails
            monkeypatch.setattr(backend_module, "make_agent", real)
            segs = [Segment(2 * MiB, 3 * MiB, MiB)]
            assert write(pm, segs) is Settlement.LANDED  # healed: the next post makes the agent
            assert dec.call("verify", 6, 8 * MiB, [*as_rows(segs), (0, 0, MiB)]) == 0
        finally:
            w.close()


def test_an_interface_this_host_lacks_is_refused_by_name(tmp_path: Any) -> None:
    """net_devices naming no interface here (a typo, another host's name): a
    clear OptionError before any agent exists, not UCX's NIXL_ERR_BACKEND."""
    from kvconn.options import OptionError
    from kvconn_nixl._nixl import check_net_devices

    with pytest.raises(
        OptionError, match=r"net_devices='nosuchif0': this host has no network interface 'nosuchif0'"
    ):
        backend.open_region(MiB, {"net_devices": "nosuchif0"})
    with pytest.raises(OptionError, match="no network interface 'eth9'"):
        backend.open_writer(MiB, {"net_devices": "lo,eth9"})
    (tmp_path / "eth1").mkdir()
    check_net_devices("eth1", str(tmp_path))  # present (carrier or not): UCX's to judge
    check_net_devices("all,mlx5_0:1", str(tmp_path))  # UCX's own words
    with pytest.raises(OptionError, match=r"it has: eth1\)"):
        check_net_devices("eth1,eth2", str(tmp_path))


def test_no_fence_claimed_without_tcp() -> None:
    w = backend.open_writer(MiB, {"ucx_tls": "default"})
    try:
        assert hooks_of(w).hook.on_fence() is None
    finally:
        w.close()


# ------------------------------------------------------------------ failures


def test_decode_killed_mid_transfer() -> None:
    """(c) the page owner dies with a write in flight: never LANDED, bounded."""
    n = 256 * MiB
    outcomes = []
    for _ in range(2):
        with children((decode_main, n, {})) as (dec,):
            w = backend.open_writer(n, {})
            try:
                w.array()[:] = 1
                w.connect("decode", dec.hello)
                pm = hooks_of(w)
                c = chunk()
                posted = pm.hook.on_post(
                    chunk=c, segments=[Segment(i * MiB, i * MiB, MiB) for i in range(256)]
                )
                dec.signal(signal.SIGKILL)
                dec.proc.join(5)
                t0 = time.monotonic()
                st = pm.hook.on_done_barrier(chunk=c, posted=posted, deadline=t0 + 5)
                elapsed = time.monotonic() - t0
                outcomes.append((st, elapsed))
                assert st in (Settlement.FAILED_SETTLED, Settlement.UNSETTLED), st
                assert elapsed < 6
            finally:
                w.close()
    print("killed decode:", [(s.value, round(e, 4)) for s, e in outcomes])


def test_frozen_decode_hits_writer_deadline() -> None:
    """(d) a frozen page owner leaves the write PROC: the writer's deadline
    turns it into UNSETTLED; the writer's fence then makes it quiescent."""
    n = 64 * MiB
    with children((decode_main, n, {})) as (dec,):
        w = backend.open_writer(n, {})
        try:
            w.array()[:] = 2
            w.connect("decode", dec.hello)
            pm = hooks_of(w)
            assert write(pm, [Segment(0, 0, PAGE)]) is Settlement.LANDED  # connected
            dec.signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                st = write(pm, [Segment(0, 0, n)], timeout=1.0)
                elapsed = time.monotonic() - t0
            finally:
                dec.signal(signal.SIGCONT)
            assert st is Settlement.UNSETTLED
            assert 0.9 < elapsed < 3
            assert pm.hook.on_fence() is True
            assert write(pm, [Segment(0, 0, MiB)]) is Settlement.LANDED
        finally:
            w.close()


def test_raw_nixl_write_matches() -> None:
    """kvconn_nixl.raw: the same chunked write through the raw nixl API."""
    from kvconn_nixl.raw import raw_write

    with children((decode_main, 16 * MiB, {})) as (dec,):
        src = pattern(9, 16 * MiB)
        segs = [(i * PAGE, (4095 - i) * PAGE, PAGE) for i in range(1024)] + [(8 * MiB, 0, 8 * MiB)]
        nbytes, secs = raw_write(dec.hello, segs, src, repeat=3)
        assert nbytes == 3 * 12 * MiB and secs > 0
        print(f"raw: {nbytes} B in {secs * 1e3:.2f} ms")
        assert dec.call("verify", 9, 16 * MiB, segs) == 0
        # a few segments take the other descriptor path (Python lists, no numpy)
        few = [(0, 12 * MiB, PAGE), (PAGE, 13 * MiB + 5, 3 * PAGE)]
        assert raw_write(dec.hello, few, src)[0] == 4 * PAGE
        assert dec.call("verify", 9, 16 * MiB, few) == 0


def test_a_region_fence_whose_new_agent_fails_holds_and_the_next_call_makes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode's own interface down at the owner fence: the old agent goes,
    UCX refuses the new one. The fence held (no agent: nothing can land), so
    it says so (``FencedWithoutEndpoint``, not ``OwnerFenceFailed``: issue
    40, counted as failed, decode was left with no endpoint for good); a
    later call, the interface back, makes the agent, and a writer connected
    with its metadata lands again."""
    region = backend.open_region(4 * MiB, {"ucx_tls": "tcp"})
    try:
        old = region.metadata
        real = backend_module.make_agent

        def no_device(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("NIXL_ERR_BACKEND (No such device)")

        monkeypatch.setattr(backend_module, "make_agent", no_device)
        with pytest.raises(FencedWithoutEndpoint, match="No such device"):
            region.owner_fence()
        assert region._agent is None  # the old agent is gone: the fence holds
        with pytest.raises(FencedWithoutEndpoint, match="No such device"):
            region.owner_fence()  # still no device: still none, nothing to tear down
        monkeypatch.setattr(backend_module, "make_agent", real)
        new = region.owner_fence()
        assert new != old and region.metadata == new
        w = backend.open_writer(4 * MiB, {"ucx_tls": "tcp"})
        try:
            w.array()[:] = pattern(7, 4 * MiB)
            w.connect("decode", new)
            assert write(hooks_of(w), [Segment(0, 0, MiB)]) is Settlement.LANDED
            assert bytes(region.read(0, MiB)) == bytes(pattern(7, 4 * MiB)[:MiB])
        finally:
            w.close()
    finally:
        region.close()


def test_a_region_fence_is_refused_while_an_earlier_agent_outlives_its_last_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fence that could not destroy the agent (something still holds it)
    proves nothing, and neither does the next call while it lives on: only
    once it is really gone does a call fence and make the new one."""
    region = backend.open_region(MiB, {"ucx_tls": "tcp"})
    held = region._agent.agent  # keeps the binding alive, as a traceback's frame would
    try:
        with pytest.raises(backend_module.OwnerFenceFailed, match="outlived"):
            region.owner_fence()
        with pytest.raises(backend_module.OwnerFenceFailed, match="still outlives"):
            region.owner_fence()  # no agent to tear down now, yet the old one still lives
        del held
        assert region.owner_fence() != b""
    finally:
        region.close()
