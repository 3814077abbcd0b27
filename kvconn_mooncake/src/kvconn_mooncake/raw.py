"""The same chunked writes through the raw Mooncake API, without kvconn (for benchmarks).

Usage: ``engine, src = open_source(n)`` (or any engine with the source
registered), then ``write_segments(engine, src.ctypes.data, region_metadata,
segments)`` -> (bytes, seconds).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvconn_mooncake._engine import new_engine, unpack_metadata

#: Requests per batch: the engine rejects more than ~1024 queued per peer.
MAX_BATCH = 512


def open_source(
    nbytes: int, host: str = "127.0.0.1", protocol: str = "tcp"
) -> tuple[Any, npt.NDArray[np.uint8]]:
    """A new engine with ``nbytes`` of zeroed source memory registered."""
    engine = new_engine(host, protocol, "")
    src = np.zeros(nbytes, dtype=np.uint8)
    if engine.register_memory(int(src.ctypes.data), nbytes) != 0:
        raise RuntimeError("register_memory failed")
    return engine, src


def write_segments(
    engine: Any, src_base: int, metadata: bytes, segments: Iterable[Any], max_batch: int = MAX_BATCH
) -> tuple[int, float]:
    """Write ``segments`` ((src, dst, nbytes) offsets, or kvconn Segments) and wait.

    One ``batch_transfer_async_write`` of at most ``max_batch`` requests at a
    time, each awaited with ``get_batch_transfer_status``. Returns (bytes,
    seconds); raises RuntimeError on a failed batch (whose bytes may still land).
    """
    session, dst_base, _ = unpack_metadata(metadata)
    segs: Sequence[tuple[int, int, int]] = [
        s if isinstance(s, tuple) else (s.src, s.dst, s.nbytes) for s in segments
    ]
    start = time.monotonic()
    for i in range(0, len(segs), max_batch):
        part = segs[i : i + max_batch]
        bid = engine.batch_transfer_async_write(
            session,
            [src_base + s for s, _, _ in part],
            [dst_base + d for _, d, _ in part],
            [n for _, _, n in part],
        )
        if bid == 0:  # get_batch_transfer_status([0]) would segfault
            raise RuntimeError("batch_transfer_async_write failed")
        if engine.get_batch_transfer_status([bid]) != 0:
            raise RuntimeError("batch failed or timed out (its bytes may still land)")
    return sum(n for _, _, n in segs), time.monotonic() - start
