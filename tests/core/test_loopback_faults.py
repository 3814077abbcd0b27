"""loopback's fault injection and its DONE barrier, in one process."""

from __future__ import annotations

import time
from multiprocessing import resource_tracker

import pytest

from kvconn.backends.loopback import LoopbackOptions, LoopbackRegion, LoopbackWriter
from kvconn.chunk import Chunk, Segment
from kvconn.options import OptionError
from kvconn.plugins import get_backend
from kvconn.transport import Settlement

NBYTES = 1 << 16


def chunk(room: int = 1, index: int = 0, rank: int = 0) -> Chunk:
    return Chunk(room=room, index=index, last=True, rank=rank, peer="decode", src_pages=(0,), dst_pages=(0,))


def connect(writer: LoopbackWriter, region: LoopbackRegion) -> None:
    """The writer attaches the region as a rank would, which unregisters the
    segment from this process's resource tracker; the region (same process
    here) still unlinks it at close, so register it again."""
    writer.connect("decode", region.metadata)
    resource_tracker.register(region._shm._name, "shared_memory")  # type: ignore[attr-defined]


def test_a_chunk_that_settles_after_its_deadline_is_unsettled() -> None:
    """A rank frozen while its chunk was in flight finds it landed only after
    the deadline: LANDED would tell the core a late write was on time."""
    region = LoopbackRegion(NBYTES)
    writer = LoopbackWriter(NBYTES, {})
    try:
        connect(writer, region)
        posted = writer.on_post(chunk(), [Segment(0, 0, 4096)])
        assert posted.finished.wait(5)
        assert writer.on_done_barrier(chunk(), posted, posted.finished_at + 1) is Settlement.LANDED
        assert writer.on_done_barrier(chunk(), posted, posted.finished_at - 1e-3) is Settlement.UNSETTLED
    finally:
        writer.close()
        region.close()


def test_freeze_chunks_reads_rank_room_index() -> None:
    assert LoopbackOptions.parse({"freeze_chunks": " 0:3000:0, 1:7:2"}).freeze_chunks == frozenset(
        {(0, 3000, 0), (1, 7, 2)}
    )
    with pytest.raises(OptionError, match=r"freeze_chunks: expected rank:room:index triples, got '3000:0'"):
        get_backend("loopback").open_writer(4096, {"freeze_chunks": "3000:0"})


def test_a_late_chunk_is_unsettled_and_the_fence_waits_for_its_late_half() -> None:
    region = LoopbackRegion(NBYTES)
    options = {"piece_bytes": "1024", "late_chunks": "0:1:0", "late_delivery_s": "0.3"}
    writer = LoopbackWriter(NBYTES, options)
    try:
        connect(writer, region)
        writer.write(0, b"\x11" * 8192)
        t0 = time.monotonic()
        posted = writer.on_post(chunk(), [Segment(0, 0, 8192)])
        assert region.read(0, 4096) == b"\x11" * 4096  # the first half at once
        assert region.read(4096, 4096) == bytes(4096)
        assert writer.on_done_barrier(chunk(), posted, time.monotonic() + 0.05) is Settlement.UNSETTLED
        assert writer.on_fence() is True
        # the queued half was handed to hardware: the fence returned only once it landed
        assert time.monotonic() - t0 >= 0.3
        assert region.read(0, 8192) == b"\x11" * 8192
        other = writer.on_post(chunk(room=2), [Segment(0, 8192, 1024)])  # not a late chunk
        assert writer.on_done_barrier(chunk(room=2), other, time.monotonic() + 5) is Settlement.LANDED
    finally:
        writer.close()
        region.close()
