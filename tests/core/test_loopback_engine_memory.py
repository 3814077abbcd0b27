"""Loopback over engine-owned memory: decode's private arrays written by
process_vm_writev, with the fault injection and fence of the shared-memory path."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from kvconn.backends.loopback import backend
from kvconn.chunk import Chunk, SegmentTable
from kvconn.transport import Settlement, register_region, register_writer

PEER = "decode"


def _chunk(room: int = 1) -> Chunk:
    return Chunk(room, 0, True, 0, PEER, (), ())


def _layers(n: int, nbytes: int, fill: int = 0) -> list[np.ndarray]:
    return [np.full(nbytes, fill + i, dtype=np.uint8) for i in range(n)]


def test_segments_across_buffers_land_in_the_engines_arrays_and_nothing_else() -> None:
    dst = _layers(3, 4096, fill=0xA0)
    src = [np.arange(4096, dtype=np.uint32).view(np.uint8)[: 4096 * (i + 1) // 3].copy() for i in range(3)]
    region = register_region(backend, dst, {})
    writer = register_writer(backend, src, {"piece_bytes": "1000"})
    try:
        writer.connect(PEER, region.metadata)
        s0, s1 = len(src[0]), len(src[0]) + len(src[1])
        table = SegmentTable([(0, 10, 1365), (s0 + 5, 4096 + 100, 2000), (s1, 2 * 4096 + 4000, 96)])
        posted = writer.on_post(chunk=_chunk(), segments=table)
        assert writer.on_done_barrier(chunk=_chunk(), posted=posted, deadline=time.monotonic() + 5) is (
            Settlement.LANDED
        )
        want = [np.full(4096, 0xA0 + i, dtype=np.uint8) for i in range(3)]
        want[0][10:1375] = src[0][:1365]
        want[1][100:2100] = src[1][5:2005]
        want[2][4000:4096] = src[2][:96]
        for got, expected in zip(dst, want, strict=True):
            assert np.array_equal(got, expected)
        assert region.read(4096 + 100, 4) == bytes(src[1][5:9])
        with pytest.raises(ValueError, match="across two"):
            writer.on_post(chunk=_chunk(), segments=SegmentTable([(0, 4000, 200)]))
    finally:
        writer.close()
        region.close()
    assert dst[0][0] == 0xA0  # close() freed nothing: the engine's array is intact and usable


def test_injected_failure_settles_half_written_and_the_fence_stops_a_slow_writer() -> None:
    dst = _layers(2, 1 << 16)
    src = [np.full(1 << 16, 7, dtype=np.uint8) for _ in range(2)]
    region = register_region(backend, dst, {})
    writer = register_writer(backend, src, {"piece_bytes": "4096", "fail_chunks": "1:0"})
    slow = register_writer(backend, src, {"piece_bytes": "4096", "piece_delay_s": "0.01"})
    try:
        writer.connect(PEER, region.metadata)
        slow.connect(PEER, region.metadata)
        table = SegmentTable([(0, 0, 1 << 16)])
        posted = writer.on_post(chunk=_chunk(), segments=table)
        assert writer.on_done_barrier(chunk=_chunk(), posted=posted, deadline=time.monotonic() + 5) is (
            Settlement.FAILED_SETTLED
        )
        assert 0 < int((dst[0] == 7).sum()) < 1 << 16
        dst[0][:] = 0
        posted = slow.on_post(chunk=_chunk(2), segments=table)
        deadline = time.monotonic() + 5
        while not dst[0].any() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert slow.on_fence() is True
        landed = int((dst[0] == 7).sum())
        time.sleep(0.05)  # five piece delays: a writer still running would land more
        assert 0 < landed < 1 << 16 and int((dst[0] == 7).sum()) == landed
        assert slow.on_done_barrier(chunk=_chunk(2), posted=posted, deadline=time.monotonic()) is (
            Settlement.FAILED_SETTLED
        )
    finally:
        writer.close()
        slow.close()
        region.close()


def test_a_writer_refuses_a_region_whose_process_is_gone() -> None:
    region = register_region(backend, _layers(1, 64), {})
    meta = json.loads(region.metadata[len(b"pvm1:") :])
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    writer = register_writer(backend, _layers(1, 64), {})
    try:
        for pid, start_time in ((meta["pid"], meta["start_time"] + 1), (child.pid, meta["start_time"])):
            stale = b"pvm1:" + json.dumps({**meta, "pid": pid, "start_time": start_time}).encode()
            with pytest.raises((ValueError, ProcessLookupError)):
                writer.connect(PEER, stale)
        with pytest.raises(ValueError, match="malformed"):
            writer.connect(PEER, b"pvm1:{}")
    finally:
        writer.close()
        region.close()


_CHILD = """
import json, sys, time
import numpy as np
from kvconn.backends.loopback import backend
from kvconn.chunk import Chunk, SegmentTable
from kvconn.transport import register_writer
args = json.loads(sys.argv[1])
src = [np.full(n, 0x30 + i, dtype=np.uint8) for i, n in enumerate(args["sizes"])]
writer = register_writer(backend, src, {})
writer.connect("decode", bytes.fromhex(args["metadata"]))
chunk = Chunk(1, 0, True, 0, "decode", (), ())
posted = writer.on_post(chunk=chunk, segments=SegmentTable(args["rows"]))
print(writer.on_done_barrier(chunk=chunk, posted=posted, deadline=time.monotonic() + 10).value, flush=True)
writer.close()
"""


def test_a_writer_process_writes_into_decodes_private_memory() -> None:
    dst = _layers(2, 8192)
    region = register_region(backend, dst, {})
    try:
        # source buffer 0 into part of decode's buffer 1; source buffer 1 over all of decode's buffer 0
        rows = [(0, 8192 + 100, 512), (2048, 0, 8192)]
        args = {"sizes": [2048, 8192], "metadata": region.metadata.hex(), "rows": rows}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "landed"
        assert (dst[0] == 0x31).all()
        assert (dst[1][100:612] == 0x30).all()
        assert (dst[1][:100] == 1).all() and (dst[1][612:] == 1).all()
    finally:
        region.close()
