"""The writer's fence claims only what it did, and a closed writer stays
closed (found in review, 2026-11-30)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconn.chunk import Chunk, Segment
from kvconn_mooncake import MooncakeWriter, backend


@pytest.fixture
def writer() -> Iterator[MooncakeWriter]:
    w = backend.open_writer(1 << 20, {})
    try:
        yield w
    finally:
        w.close()


def test_the_fence_is_claimed_over_tcp_only() -> None:
    assert backend.capabilities_for({}).writer_fence is True
    assert backend.capabilities_for({"protocol": "rdma"}).writer_fence is False


def test_no_fence_is_claimed_while_something_holds_the_engine(writer: MooncakeWriter) -> None:
    """A raising hook's frames, kept by a traceback, would keep the engine
    and its writes alive: the engine was not destroyed, so no fence."""
    held = writer._engine
    assert writer.on_fence() is False
    del held
    assert writer.on_fence() is True  # nothing else holds the new one


def test_a_closed_writer_neither_writes_nor_reopens(writer: MooncakeWriter) -> None:
    writer.close()
    chunk = Chunk(room=1, index=0, last=True, rank=0, peer="d", src_pages=(), dst_pages=())
    with pytest.raises(RuntimeError, match="closed"):
        writer.on_post(chunk, [Segment(0, 0, 4096)])
    assert writer.on_fence() is True and writer._engine is None
