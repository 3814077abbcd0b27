"""The writer's fence claims only what it did, and a closed writer stays
closed (found in review, 2026-11-30)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvconn.chunk import Chunk, Segment
from kvconn.testing.libraries import require_library
from kvconn.transport import Settlement
from kvconn_mooncake import MooncakeRegion, MooncakeWriter, backend

require_library("mooncake", module_level=True)  # by the library: the plugin installs without it

MiB = 1 << 20


@pytest.fixture
def writer() -> Iterator[MooncakeWriter]:
    w = backend.open_writer(MiB, {})
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def regions() -> Iterator[list[MooncakeRegion]]:
    rs = [backend.open_region(MiB, {}) for _ in range(2)]
    try:
        yield rs
    finally:
        for r in rs:
            r.close()


def _connect(writer: MooncakeWriter, regions: list[MooncakeRegion]) -> list[str]:
    peers = [f"d{i}" for i in range(len(regions))]
    for peer, region in zip(peers, regions, strict=True):
        writer.connect(peer, region.metadata)
    assert all(writer.wait_open(peer, 30) for peer in peers)
    return peers


def _chunk(peer: str) -> Chunk:
    return Chunk(room=1, index=0, last=True, rank=0, peer=peer, src_pages=(), dst_pages=())


def _rpc_port(writer: MooncakeWriter, peer: str) -> int | None:
    """Which engine a channel has (without holding it: that would stop a fence)."""
    engine = writer.channel(peer).engine
    return None if engine is None else int(engine.get_rpc_port())


def test_the_fence_is_claimed_over_tcp_only() -> None:
    assert backend.capabilities_for({}).writer_fence is True
    assert backend.capabilities_for({"protocol": "rdma"}).writer_fence is False


def test_the_handshake_writes_nothing(writer: MooncakeWriter, regions: list[MooncakeRegion]) -> None:
    """A channel opens with a write of 0 bytes to the region's first byte."""
    writer.array()[:] = 0xAB
    for region in regions:
        region.array()[:] = 0
    _connect(writer, regions)
    assert not any(region.array().any() for region in regions)


def test_no_fence_is_claimed_while_something_holds_the_engine(
    writer: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    """A raising hook's frames, kept by a traceback, would keep the engine
    and its writes alive: the engine was not destroyed, so no fence; the next
    fence destroys it once nothing else holds it."""
    (peer, _) = _connect(writer, regions)
    writer.on_post(_chunk(peer), [Segment(0, 0, MiB)])  # in flight: the fence must destroy its engine
    held = writer.channel(peer).engine
    assert writer.on_fence() is False
    assert writer.on_fence() is False  # still held
    del held
    assert writer.on_fence() is True


def test_a_fence_destroys_only_the_engines_that_may_carry_writes(
    writer: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    """Every batch of d0's channel completed: nothing of it can land later, so
    it keeps its engine (a teardown holds the GIL ~1 s). d1 has a chunk in
    flight: its engine is destroyed, and the channel opens a new one."""
    d0, d1 = _connect(writer, regions)
    tok = writer.on_post(_chunk(d0), [Segment(0, 0, MiB)])
    assert writer.on_done_barrier(_chunk(d0), tok, time.monotonic() + 10) is Settlement.LANDED
    writer.on_post(_chunk(d1), [Segment(0, 0, MiB)])
    ports = _rpc_port(writer, d0), _rpc_port(writer, d1)
    assert writer.on_fence() is True
    assert _rpc_port(writer, d0) == ports[0] and writer.channel(d0).opened
    assert writer.wait_open(d1, 30)
    assert _rpc_port(writer, d1) not in (None, ports[1])
    regions[1].array()[:] = 0
    tok = writer.on_post(_chunk(d1), [Segment(0, 0, MiB)])  # the new engine writes
    assert writer.on_done_barrier(_chunk(d1), tok, time.monotonic() + 10) is Settlement.LANDED


def test_a_closed_writer_neither_writes_nor_reopens(
    writer: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    (peer, _) = _connect(writer, regions)
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.on_post(_chunk(peer), [Segment(0, 0, 4096)])
    with pytest.raises(RuntimeError, match="closed"):
        writer.connect("late", regions[1].metadata)
    assert writer.on_fence() is True
    assert all(c.engine is None and not c.opening for c in writer._channels.values())


class _RaisingEngine:
    """An engine whose batch call raises (after, perhaps, queueing part of it)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def transfer_submit_write(self, *args: Any) -> Any:
        if args[-1] == 0:
            time.sleep(0.3)  # a slow handshake: the chunk queues meanwhile
        return self._engine.transfer_submit_write(*args)

    def batch_transfer_async_write(self, *args: Any) -> Any:
        raise RuntimeError("injected: the engine call raised")


def _a_suspect_channel(writer: MooncakeWriter, peer: str, region: MooncakeRegion) -> None:
    """``peer``'s channel opens on the spare engine, made to raise in its
    batch call: its first chunk is UNSETTLED and the channel suspect."""
    engine, poller = writer._spare or (None, None)
    assert poller is not None, "needs the batch path"
    writer._spare = (_RaisingEngine(engine), poller)
    del engine
    writer.connect(peer, region.metadata)
    tok = writer.on_post(_chunk(peer), [Segment(0, 0, MiB)])
    assert writer.on_done_barrier(_chunk(peer), tok, time.monotonic() + 5) is Settlement.UNSETTLED
    assert writer.channel(peer).suspect


def test_a_raising_engine_call_never_lands_a_chunk(
    writer: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    """The chunk waits for the handshake, and the opening thread submits it:
    the call raises there, after taking the chunk's pieces. The chunk may have
    been handed over in part: UNSETTLED (before: LANDED, with 0 bytes written),
    and the fence destroys that engine."""
    _a_suspect_channel(writer, "d", regions[0])
    port = _rpc_port(writer, "d")
    assert writer.on_fence() is True
    assert writer.wait_open("d", 30) and _rpc_port(writer, "d") != port


def test_a_chunk_in_flight_on_a_replaced_channel_still_settles(
    writer: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    """connect() names another region for a peer: the old channel's chunk in
    flight is still polled (it landed: LANDED, not a deadline's UNSETTLED).
    Idle then, its engine outlives a fence (nothing of it can land): kept for
    the next channel that needs one."""
    (peer,) = _connect(writer, regions[:1])
    writer.array()[:] = 7
    regions[0].array()[:] = 0
    tok = writer.on_post(_chunk(peer), [Segment(0, 0, MiB)])
    writer.connect(peer, regions[1].metadata)
    assert writer.on_done_barrier(_chunk(peer), tok, time.monotonic() + 10) is Settlement.LANDED
    assert (regions[0].array() == 7).all()
    assert writer.on_fence() is True and not writer._zombies
    (old,) = writer._retired
    assert old.engine is not None


@pytest.fixture
def one_engine() -> Iterator[MooncakeWriter]:
    """A writer that keeps one engine before channels take each other's."""
    w = backend.open_writer(MiB, {"max_engines": "1"})
    try:
        yield w
    finally:
        w.close()


def _lands(writer: MooncakeWriter, peer: str, region: MooncakeRegion, fill: int) -> None:
    writer.array()[:] = fill
    tok = writer.on_post(_chunk(peer), [Segment(0, 0, MiB)])
    assert writer.on_done_barrier(_chunk(peer), tok, time.monotonic() + 30) is Settlement.LANDED
    assert (region.array() == fill).all()


def test_past_max_engines_a_channel_takes_an_idle_channels_engine(
    one_engine: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    """A decode that left would keep its engine (threads, a port) for the
    writer's lifetime: past ``max_engines`` the next channel takes the least
    recently used idle one's, and the one it left reopens on its next post."""
    w = one_engine
    (d0,) = _connect(w, regions[:1])
    port = _rpc_port(w, d0)
    _lands(w, d0, regions[0], 1)
    w.connect("d1", regions[1].metadata)
    assert w.wait_open("d1", 30)
    assert _rpc_port(w, "d1") == port and _rpc_port(w, d0) is None
    _lands(w, "d1", regions[1], 2)
    assert (regions[0].array() == 1).all()
    _lands(w, d0, regions[0], 3)  # d0 reopens on d1's engine, idle again
    assert _rpc_port(w, d0) == port and _rpc_port(w, "d1") is None
    assert (regions[1].array() == 2).all()
    w.on_post(_chunk(d0), [Segment(0, 0, MiB)])  # in flight on the handed-on engine
    assert w.on_fence() is True  # destroyed: d0's writes are its only ones
    assert w.wait_open(d0, 30) and _rpc_port(w, d0) not in (None, port)
    _lands(w, d0, regions[0], 4)


def test_past_max_engines_a_hello_takes_no_engine_until_the_first_post(
    one_engine: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    """A burst of Hellos past the limit would pass engines around among
    channels that never write (a handshake each): the channel opens at its
    first post instead, and until then the live channel keeps its engine."""
    w = one_engine
    (d0,) = _connect(w, regions[:1])
    port = _rpc_port(w, d0)
    w.connect("d1", regions[1].metadata)
    assert not w.channel("d1").opening and _rpc_port(w, "d1") is None
    assert w.channel(d0).opened and _rpc_port(w, d0) == port
    _lands(w, d0, regions[0], 8)  # no handshake in between: d0 kept its engine
    _lands(w, "d1", regions[1], 9)  # the first post opens d1 on d0's idle engine
    assert _rpc_port(w, "d1") == port and _rpc_port(w, d0) is None


def test_a_replaced_channel_hands_on_its_idle_engine(
    one_engine: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    """The decode registers a new region after the engine first talked to it
    (a stale descriptor cached in the engine would fail this write)."""
    w = one_engine
    (peer,) = _connect(w, regions[:1])
    port = _rpc_port(w, peer)
    _lands(w, peer, regions[0], 4)
    later = backend.open_region(MiB, {})
    try:
        w.connect(peer, later.metadata)
        assert w.wait_open(peer, 30) and _rpc_port(w, peer) == port
        assert not w._retired
        _lands(w, peer, later, 5)
    finally:
        later.close()


def test_an_engine_that_may_carry_writes_is_never_handed_on(
    one_engine: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    """d0's chunk is in flight (not yet polled at a barrier): its engine is
    not idle, so d1 makes one of its own past the limit, and d0's chunk lands
    on d0's engine."""
    w = one_engine
    (d0,) = _connect(w, regions[:1])
    port = _rpc_port(w, d0)
    w.array()[:] = 6
    tok = w.on_post(_chunk(d0), [Segment(0, 0, MiB)])
    w.connect("d1", regions[1].metadata)
    assert w.wait_open("d1", 30)
    assert _rpc_port(w, d0) == port and _rpc_port(w, "d1") not in (None, port)
    assert w.on_done_barrier(_chunk(d0), tok, time.monotonic() + 30) is Settlement.LANDED
    assert (regions[0].array() == 6).all()
    _lands(w, "d1", regions[1], 7)


def test_a_suspect_engine_is_never_handed_on(
    one_engine: MooncakeWriter, regions: list[MooncakeRegion]
) -> None:
    """A failed batch may have queued part of itself in the engine: only a
    fence may end that engine, never another channel's writes."""
    w = one_engine
    _a_suspect_channel(w, "d0", regions[0])
    w.connect("d1", regions[1].metadata)
    assert w.wait_open("d1", 30)
    assert w.channel("d0").engine is not None  # still its own, for the fence
    assert not isinstance(w.channel("d1").engine, _RaisingEngine)
    _lands(w, "d1", regions[1], 8)
    assert w.on_fence() is True and not w._zombies  # the fence destroyed it
    assert not any(isinstance(c.engine, _RaisingEngine) for c in w._channels.values())


def test_a_replaced_channel_gives_first_then_the_least_recently_used(regions: list[MooncakeRegion]) -> None:
    third = backend.open_region(MiB, {})
    w = backend.open_writer(MiB, {"max_engines": "2"})
    try:
        d0, d1 = _connect(w, regions)
        ports = _rpc_port(w, d0), _rpc_port(w, d1)
        _lands(w, d0, regions[0], 1)
        _lands(w, d1, regions[1], 2)  # d0 is now the least recently used
        w.connect("d2", third.metadata)
        assert w.wait_open("d2", 30) and _rpc_port(w, "d2") == ports[0]
        w.connect(d1, regions[0].metadata)  # d1's region replaced: its idle engine goes first,
        assert w.wait_open(d1, 30)  # though d2 (never posted) is less recently used
        assert _rpc_port(w, d1) == ports[1] and _rpc_port(w, "d2") == ports[0]
    finally:
        w.close()
        third.close()


def test_a_fence_hands_a_replaced_channels_idle_engine_on(regions: list[MooncakeRegion]) -> None:
    """The fence takes a busy channel's engine, and that channel reopens on
    the idle engine of a replaced one, which it neither destroys (~1 s, GIL
    held) nor passes over for a live channel's."""
    third = backend.open_region(MiB, {})
    w = backend.open_writer(MiB, {"max_engines": "2"})
    try:
        d0, d1 = _connect(w, regions)
        port0 = _rpc_port(w, d0)
        _lands(w, d1, regions[1], 1)
        tok = w.on_post(_chunk(d0), [Segment(0, 0, MiB)])  # in flight: d0 is busy
        w.connect(d0, third.metadata)  # the old d0 channel is replaced; d1 is idle
        assert w.wait_open(d0, 30) and _rpc_port(w, d1) is None  # the new d0 took d1's
        assert len(w._retired) == 1  # busy: not a donor
        assert w.on_done_barrier(_chunk(d0), tok, time.monotonic() + 30) is Settlement.LANDED
        w.on_post(_chunk(d0), [Segment(0, 0, MiB)])  # in flight on the new channel
        assert w.on_fence() is True
        assert w.wait_open(d0, 30) and _rpc_port(w, d0) == port0 and not w._retired
        _lands(w, d0, third, 3)
    finally:
        w.close()
        third.close()
