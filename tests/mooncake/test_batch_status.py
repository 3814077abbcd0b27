"""The many-task batch path (``_batch_status``: getBatchTransferStatus through
ctypes) and the choice between it and the one-transfer-per-segment fallback."""

from __future__ import annotations

import gc
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvconn.chunk import Chunk, Segment
from kvconn.testing.libraries import require_library
from kvconn.transport import Settlement
from kvconn_mooncake import _batch_status as bs
from kvconn_mooncake import backend as be
from kvconn_mooncake._channel import Posted
from kvconn_mooncake._engine import new_engine
from kvconn_mooncake._options import DEFAULT_HOT_POLL_S

require_library("mooncake", module_level=True)  # by the library: the plugin installs without it

MiB = 1 << 20
PAGE = 4096
REGION = 64 * MiB


def _chunk(peer: str = "d") -> Chunk:
    return Chunk(room=1, index=0, last=False, rank=0, peer=peer, src_pages=(), dst_pages=())


def _scattered(n: int, seed: int, span: int = 32 * MiB) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    srcs = rng.sample(range(span // PAGE), n)
    dsts = rng.sample(range(span // PAGE), n)
    return [(s * PAGE, d * PAGE, PAGE) for s, d in zip(srcs, dsts, strict=True)]


def _wait(poller: bs.BatchPoller, bid: int, timeout_s: float) -> int:
    end = time.monotonic() + timeout_s
    while (rc := poller.poll(bid)) == bs.PENDING:
        assert time.monotonic() < end, "batch never settled"
        time.sleep(0.0005)
    return rc


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Any]]:
    """A target engine with a registered region and a source engine, in this process."""
    dst_e, src_e = new_engine("127.0.0.1", "tcp", ""), new_engine("127.0.0.1", "tcp", "")
    dst = np.zeros(REGION, np.uint8)
    src = np.random.default_rng(3).integers(1, 256, REGION, dtype=np.uint8)
    assert dst_e.register_memory(int(dst.ctypes.data), REGION) == 0
    assert src_e.register_memory(int(src.ctypes.data), REGION) == 0
    yield {
        "dst_e": dst_e,
        "src_e": src_e,
        "dst": dst,
        "src": src,
        "session": f"127.0.0.1:{dst_e.get_rpc_port()}",
    }
    src_e.unregister_memory(int(src.ctypes.data))
    dst_e.unregister_memory(int(dst.ctypes.data))


@pytest.fixture
def reset_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the process's cached guard result, restored after the test."""
    monkeypatch.setattr(bs, "_api", None)
    monkeypatch.setattr(bs, "_api_problem", None)


def test_guards_pass_on_this_install() -> None:
    assert bs.api_problem() is None, bs.api_problem()


def test_poller_completes_a_many_task_batch(engines: dict[str, Any]) -> None:
    src_e, src, dst = engines["src_e"], engines["src"], engines["dst"]
    poller = bs.bind(src_e)
    assert poller is not None
    dst[:] = 0
    segs = _scattered(500, 1)
    sb, db = int(src.ctypes.data), int(dst.ctypes.data)
    bid = src_e.batch_transfer_async_write(
        engines["session"], [sb + s for s, _, _ in segs], [db + d for _, d, _ in segs], [n for *_, n in segs]
    )
    assert bid not in (0, 2**64 - 1)
    first = poller.status(bid)  # non-blocking: answers while the batch may still run
    assert first[0] in (0, 1, 4)
    assert _wait(poller, bid, 10.0) == bs.DONE  # freed: never passed again
    for s, d, n in segs:
        assert np.array_equal(dst[d : d + n], src[s : s + n])
    assert int(np.count_nonzero(dst)) == 500 * PAGE


def test_poller_reports_a_failed_batch_and_leaves_it(engines: dict[str, Any]) -> None:
    """A batch to a peer that went away reads FAILED; the id is not freed."""
    src_e = engines["src_e"]
    victim = new_engine("127.0.0.1", "tcp", "")
    mem = np.zeros(MiB, np.uint8)
    assert victim.register_memory(int(mem.ctypes.data), MiB) == 0
    session = f"127.0.0.1:{victim.get_rpc_port()}"
    poller = bs.bind(src_e)
    assert poller is not None
    sb, db = int(engines["src"].ctypes.data), int(mem.ctypes.data)
    ok = src_e.batch_transfer_async_write(session, [sb], [db], [PAGE])  # opens the segment
    assert _wait(poller, ok, 10.0) == bs.DONE
    del victim
    gc.collect()
    bid = src_e.batch_transfer_async_write(
        session, [sb + i * PAGE for i in range(64)], [db + i * PAGE for i in range(64)], [PAGE] * 64
    )
    if bid in (0, 2**64 - 1):
        pytest.skip("the engine refused the batch at submission (nothing to poll)")
    assert _wait(poller, bid, 15.0) == bs.FAILED


def test_self_test_failure_means_fallback(engines: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bs.BatchPoller, "self_test", lambda self, port: "simulated")
    assert bs.bind(engines["src_e"]) is None


@pytest.mark.parametrize(
    "problem",
    ["version", "symbol", "prologue"],
)
def test_guard_failure_means_fallback(
    engines: dict[str, Any], reset_api: None, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    if problem == "version":
        monkeypatch.setattr(bs, "_installed_version", lambda: "0.3.14")
    elif problem == "symbol":
        monkeypatch.setattr(bs, "_SYM_FREE", "_ZN8mooncake14TransferEngine11noSuchThingEm")
    else:
        monkeypatch.setitem(bs._PROLOGUES, bs._SYM_BATCH_STATUS, bytes.fromhex("55"))
    problem_text = bs.api_problem()
    assert problem_text, problem
    assert bs.bind(engines["src_e"]) is None


def test_writer_mode_choice(reset_api: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: batches when the guards pass, else per segment; on: required; off: never."""
    w = be.open_writer(MiB, {})
    assert w.batched
    w.close()
    w = be.open_writer(MiB, {"batch_status": "off"})
    assert not w.batched
    w.close()
    with pytest.raises(ValueError, match="batch_status"):
        be.open_writer(MiB, {"batch_status": "maybe"})
    with pytest.raises(ValueError, match="hot_poll_s"):
        be.open_writer(MiB, {"hot_poll_s": "-1"})
    # a typo fails before any engine starts, on both sides and up front
    with pytest.raises(ValueError, match="did you mean 'max_inflight'"):
        be.open_writer(MiB, {"max_inflght": "8"})
    with pytest.raises(ValueError, match="did you mean 'poll_interval_s'"):
        be.open_region(MiB, {"poll_interval": "0.001"})
    with pytest.raises(ValueError, match=r"max_inflight='2000': expected at most 1000"):
        be.capabilities_for({"max_inflight": "2000"})
    with pytest.raises(ValueError, match=r"max_engines='0'"):
        be.capabilities_for({"max_engines": "0"})
    # Bound to a host's address: the class-level claims; to loopback (the default host): this host only.
    assert (
        be.capabilities_for({"max_inflight": "8", "protocol": "TCP", "host": "10.1.2.3"}) == be.capabilities
    )
    assert be.capabilities_for({"max_inflight": "8", "protocol": "TCP"}).cross_host is False
    monkeypatch.setattr(bs, "_installed_version", lambda: "9.9.9")
    monkeypatch.setattr(bs, "_api", None)
    monkeypatch.setattr(bs, "_api_problem", None)
    w = be.open_writer(MiB, {"batch_status": "auto"})
    assert not w.batched  # the fallback
    w.close()
    with pytest.raises(RuntimeError, match="batch_status=on"):
        be.open_writer(MiB, {"batch_status": "on"})


def test_hot_poll_default() -> None:
    """The barrier polls hot until the chunk settles (as the raw API's status
    call spins) unless told a limit."""
    assert DEFAULT_HOT_POLL_S is None
    assert be.open_writer(MiB, {}).options.hot_poll_s is None
    assert be.open_writer(MiB, {"hot_poll_s": "none"}).options.hot_poll_s is None
    assert be.open_writer(MiB, {"hot_poll_s": "0.25"}).options.hot_poll_s == 0.25


@pytest.mark.parametrize(("mode", "hot_poll_s"), [("on", "none"), ("off", "none"), ("on", "0")])
def test_writer_respects_inflight_cap(mode: str, hot_poll_s: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """1000 pages through a cap of 300 in flight, batches of at most 128: all
    land, whether the barrier polls hot or (hot_poll_s=0) sleeps between polls.
    It never sleeps while pieces wait for the cap: only its polls submit them."""
    region = be.open_region(REGION, {})
    options = {"batch_status": mode, "max_inflight": "300", "max_batch": "128", "hot_poll_s": hot_poll_s}
    w = be.open_writer(REGION, options)
    real_sleep = time.sleep
    slept_while_queued: list[int] = []

    def sleep(seconds: float) -> None:
        queued = [t for c in w._channels.values() for t in c.queued]
        if queued:
            slept_while_queued.append(sum(len(t.pending) for t in queued))
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)  # the time module the backend calls
    try:
        w.connect("d", region.metadata)
        assert w.wait_open("d", 30)
        w.array()[:] = np.random.default_rng(5).integers(1, 256, REGION, dtype=np.uint8)
        region.array()[:] = 0
        segs = _scattered(1000, 9)
        chunk = _chunk()
        tok = w.on_post(chunk, [Segment(*s) for s in segs])
        assert isinstance(tok, Posted)
        channel = w.channel("d")
        counts = [n for _, n, _ in channel.inflight]
        assert sum(counts) == tok.inflight <= 300
        assert max(counts) <= (128 if mode == "on" else 1)
        assert w.on_done_barrier(chunk, tok, time.monotonic() + 20) == Settlement.LANDED
        assert channel.inflight_n == 0
        assert slept_while_queued == []
        src, dst = w.array(), region.array()
        for s, d, n in segs:
            assert np.array_equal(dst[d : d + n], src[s : s + n])
    finally:
        monkeypatch.undo()
        w.close()
        region.close()


# -- across processes: both paths, success and failure ------------------------


@pytest.fixture(scope="module")
def pair(spawn: Any) -> dict[str, Any]:
    decode, w_on, w_off = spawn(3)
    md = decode.call("region_open", 256 * MiB)
    for seed, w, mode in ((1, w_on, "on"), (2, w_off, "off")):
        w.call("writer_open", 256 * MiB, seed, {"batch_status": mode})
        w.call("connect", "d1", md)
    assert w_on.call("writer_batched") is True
    assert w_off.call("writer_batched") is False
    return {"decode": decode, "on": w_on, "off": w_off}


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("shape", ["2000 scattered pages", "64 MiB in 16"])
def test_both_paths_land_exactly(pair: dict[str, Any], mode: str, shape: str) -> None:
    d, w = pair["decode"], pair[mode]
    if shape == "2000 scattered pages":
        segs = _scattered(2000, 17, span=128 * MiB)
    else:
        segs = [(i * 4 * MiB, 128 * MiB + i * 4 * MiB, 4 * MiB) for i in range(16)]
    d.call("fill", 0)
    res, _ = w.call("transfer", "d1", segs, 30.0)
    assert res == "landed"
    seed = 1 if mode == "on" else 2
    assert d.call("verify", seed, 256 * MiB, segs) == 0
    assert d.call("count_nonzero")[1] == sum(n for *_, n in segs)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_both_paths_decode_killed_is_unsettled(pair: dict[str, Any], spawn: Any, mode: str) -> None:
    (d2,) = spawn(1)
    w = pair[mode]
    w.call("connect", "d2", d2.call("region_open", 256 * MiB))
    w.call("post", "d2", _scattered(3000, 23, span=256 * MiB), 11)
    d2.signal(signal.SIGKILL)
    res, secs = w.call("barrier", 11, 20.0)
    assert res == "unsettled"
    assert secs < 12.0
    # the writer still serves its other peer
    assert w.call("transfer", "d1", [(0, 0, MiB)], 10.0)[0] == "landed"
