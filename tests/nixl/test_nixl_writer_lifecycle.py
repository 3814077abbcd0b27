"""The writer's fence claims only what it did and never leaves the writer
without an agent; the page owner always progresses (found in review,
2026-11-30). Region and writer in this process, DRAM over tcp."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

import kvconn_nixl
from kvconn.testing.libraries import require_library

kvconn_nixl.prepare_env()  # before anything imports nixl (UCX_MODULES=^ib)
require_library("nixl", module_level=True)  # by the library: the plugin installs without it

from kvconn.chunk import Chunk, Segment  # noqa: E402
from kvconn.transport import Settlement  # noqa: E402
from kvconn_nixl import backend  # noqa: E402
from kvconn_nixl._nixl import RegionInfo  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any]]:
    region = backend.open_region(4 * MiB, {"progress_thread": "false"})  # the owner's threads go on anyway
    writer = backend.open_writer(4 * MiB, {})
    try:
        writer.array()[:] = 0xAB
        writer.connect("decode", region.metadata)
        yield region, writer
    finally:
        writer.close()
        region.close()


def _write(writer: Any, peer: str = "decode") -> Settlement:
    chunk = Chunk(room=1, index=0, last=True, rank=0, peer=peer, src_pages=(), dst_pages=())
    return _barrier(writer, chunk, writer.on_post(chunk=chunk, segments=[Segment(0, 0, 4 * MiB)]))


def test_the_page_owner_progresses_whatever_progress_thread_says(pair: tuple[Any, Any]) -> None:
    region, writer = pair
    assert _write(writer) is Settlement.LANDED
    assert region.read(4 * MiB - 1, 1) == b"\xab"


def test_a_fence_that_cannot_destroy_the_agent_keeps_the_writer_working(pair: tuple[Any, Any]) -> None:
    """Something else holds the agent (a raising hook's frames, say): no fence,
    but the writer keeps its agent and writes on; a later fence succeeds."""
    _, writer = pair
    held = writer._agent
    assert writer.on_fence() is False
    assert writer._agent is held
    assert _write(writer) is Settlement.LANDED
    del held
    assert writer.on_fence() is True
    assert _write(writer) is Settlement.LANDED


def _post(writer: Any) -> tuple[Chunk, Any]:
    chunk = Chunk(room=2, index=0, last=True, rank=0, peer="decode", src_pages=(), dst_pages=())
    return chunk, writer.on_post(chunk=chunk, segments=[Segment(0, 0, 4 * MiB)])


def _barrier(writer: Any, chunk: Chunk, posted: Any) -> Settlement:
    settled: Settlement = writer.on_done_barrier(chunk=chunk, posted=posted, deadline=time.monotonic() + 10)
    return settled


def test_a_chunk_posted_before_a_failed_fence_is_not_claimed_settled(pair: tuple[Any, Any]) -> None:
    """The failed fence dropped its handle but destroyed no agent: the chunk
    may still write, so its barrier must not say FAILED_SETTLED."""
    _, writer = pair
    chunk, posted = _post(writer)
    held = writer._agent
    assert writer.on_fence() is False
    assert _barrier(writer, chunk, posted) is Settlement.UNSETTLED
    del held
    assert writer.on_fence() is True
    assert _write(writer) is Settlement.LANDED


def test_the_fence_is_proven_by_the_agent_being_gone_not_by_reference_counts(
    pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where reference counts read low (CPython 3.14 borrows references), a
    holder the count misses must still make the fence fail, and the writer
    must keep writing on a new agent."""
    _, writer = pair
    chunk, posted = _post(writer)
    held = writer._agent.agent
    monkeypatch.setattr(sys, "getrefcount", lambda _obj: 1)
    assert writer.on_fence() is False
    monkeypatch.undo()
    assert writer._agent is not None and writer._agent.agent is not held
    assert _barrier(writer, chunk, posted) is Settlement.UNSETTLED
    assert _write(writer) is Settlement.LANDED
    del held
    assert writer.on_fence() is True
    assert _write(writer) is Settlement.LANDED


def test_no_fence_is_claimed_with_device_memory_at_the_other_end(pair: tuple[Any, Any]) -> None:
    region, writer = pair
    vram = attrs.evolve(RegionInfo.decode(region.metadata), mem="VRAM").encode()
    writer.connect("gpu-decode", vram)
    assert writer.on_fence() is None  # the teardown is no fence for an emulated PUT to VRAM
