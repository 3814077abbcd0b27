"""The writer's fence claims only what it did and never leaves the writer
without an agent; the page owner always progresses (found in review,
2026-11-30). Region and writer in this process, DRAM over tcp."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

import kvconn_nixl

kvconn_nixl.prepare_env()  # before anything imports nixl (UCX_MODULES=^ib)
pytest.importorskip("nixl")

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
    posted = writer.on_post(chunk=chunk, segments=[Segment(0, 0, 4 * MiB)])
    settled: Settlement = writer.on_done_barrier(chunk=chunk, posted=posted, deadline=time.monotonic() + 10)
    return settled


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


def test_no_fence_is_claimed_with_device_memory_at_the_other_end(pair: tuple[Any, Any]) -> None:
    region, writer = pair
    vram = attrs.evolve(RegionInfo.decode(region.metadata), mem="VRAM").encode()
    writer.connect("gpu-decode", vram)
    assert writer.on_fence() is None  # the teardown is no fence for an emulated PUT to VRAM
