"""The same chunked writes through the raw Mooncake API, without kvconn (no
hooks, no ledger, no control plane), for side-by-side benchmarks.

The API matches :mod:`kvconn_nixl.raw`::

    w = RawWriter(nbytes, options)     # source memory + its own engine
    w.write(offset, data)              # fill the source
    w.connect(peer, region_metadata)   # a kvconn-mooncake region's metadata
    w.transfer(peer, segments)         # batched async writes, wait for each batch
    w.close()

``prepare(peer, segments)`` then ``transfer_prepared(prepared)`` split the
same write in two: the address lists a raw API user holds, built once and
cut into batches, then only the library's calls, each time.

``segments`` are ``(src, dst, nbytes)`` byte offsets (tuples, kvconn
``Segment`` s, or an ``(n, 3)`` integer array). ``options`` are the backend's
(``host``, ``protocol``, ``device``, ``memory``, ``gpu_device``).

The older functional form stays: ``engine, src = open_engine(n)`` then
``write_segments(engine, src_base, region_metadata, segments)``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvconn.buffers import Buffer, FlatSpace
from kvconn_mooncake._engine import engine_settings, new_engine, unpack_buffers, unpack_metadata
from kvconn_mooncake._memory import MemoryOptions, open_space, register_space, unregister_space
from kvconn_mooncake._options import read as read_options

__all__ = [
    "MAX_BATCH",
    "Prepared",
    "RawWriter",
    "open_engine",
    "open_source",
    "segment_lists",
    "write_segments",
]

#: Requests per batch: the engine rejects more than ~1024 queued per peer.
MAX_BATCH = 512


def segment_lists(segments: Iterable[Any]) -> tuple[list[int], list[int], list[int]]:
    """(srcs, dsts, lens) from tuples, Segments or an ``(n, 3)`` array."""
    if isinstance(segments, np.ndarray):
        rows = segments.reshape(-1, 3)
        return rows[:, 0].tolist(), rows[:, 1].tolist(), rows[:, 2].tolist()
    segs: Sequence[tuple[int, int, int]] = [
        s if isinstance(s, tuple) else (s.src, s.dst, s.nbytes) for s in segments
    ]
    return [s for s, _, _ in segs], [d for _, d, _ in segs], [n for _, _, n in segs]


#: One batch's source addresses, destination addresses and lengths.
Batch = tuple[list[int], list[int], list[int]]


@attrs.frozen
class Prepared:
    """One write as the engine takes it: a session and batches of at most
    ``max_batch`` requests, addresses resolved."""

    session: str
    batches: tuple[Batch, ...]
    nbytes: int


def _batches(
    src_base: int, dst_base: int, segments: Iterable[Any], max_batch: int
) -> tuple[list[Batch], int]:
    srcs, dsts, lens = segment_lists(segments)
    batches = [
        (
            [src_base + s for s in srcs[i : i + max_batch]],
            [dst_base + d for d in dsts[i : i + max_batch]],
            lens[i : i + max_batch],
        )
        for i in range(0, len(lens), max_batch)
    ]
    return batches, sum(lens)


def _run(engine: Any, session: str, batches: Iterable[Batch]) -> None:
    """Each batch submitted, then waited for, before the next."""
    for srcs, dsts, lens in batches:
        bid = engine.batch_transfer_async_write(session, srcs, dsts, lens)
        if bid == 0:  # get_batch_transfer_status([0]) would segfault
            raise RuntimeError("batch_transfer_async_write failed")
        if engine.get_batch_transfer_status([bid]) != 0:
            raise RuntimeError("batch failed or timed out (its bytes may still land)")


def _write(
    engine: Any, session: str, src_base: int, dst_base: int, segments: Iterable[Any], max_batch: int
) -> int:
    batches, nbytes = _batches(src_base, dst_base, segments, max_batch)
    _run(engine, session, batches)
    return nbytes


class RawWriter:
    """Source memory (DRAM, or VRAM with ``memory=vram``) registered with its
    own engine (P2P handshake)."""

    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str] | None = None) -> None:
        """``source``: bytes to allocate, or engine buffers to register."""
        if isinstance(source, int) and source <= 0:
            raise ValueError("nbytes must be positive")
        host, protocol, device = engine_settings(options or {})
        self.max_batch = read_options(options or {}).integer("max_batch", MAX_BATCH, low=1)
        self._mem = open_space(source, MemoryOptions.parse(options or {}))
        self.nbytes = self._mem.nbytes
        self.base = self._mem.addr
        self._engine: Any = new_engine(host, protocol, device)
        register_space(self._engine, self._mem)
        self._peers: dict[str, tuple[str, int, int]] = {}
        self._spaces: dict[str, FlatSpace] = {}

    def array(self) -> npt.NDArray[np.uint8]:
        """The DRAM source itself (no copy); DRAM only. A method, as on the
        plugins' writers: a property that raises for VRAM trips attribute scans."""
        return self._mem.array()

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._mem.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self._mem.write(offset, data)

    def connect(self, peer: str, metadata: bytes) -> None:
        self._peers[peer] = unpack_metadata(metadata)
        self._spaces[peer] = FlatSpace([Buffer(a, n) for a, n in unpack_buffers(metadata)])

    def transfer(self, peer: str, segments: Iterable[Any]) -> int:
        """``batch_transfer_async_write`` of at most ``max_batch`` requests at a
        time, each awaited with ``get_batch_transfer_status``. Returns the bytes
        written; raises RuntimeError on a failed batch (whose bytes may land)."""
        session, dst_base, _ = self._peers[peer]
        if self._mem.single and len(self._spaces[peer].buffers) == 1:
            return _write(self._engine, session, self.base, dst_base, segments, self.max_batch)
        return _write(self._engine, session, 0, 0, self._addresses(peer, segments), self.max_batch)

    def prepare(self, peer: str, segments: Iterable[Any]) -> Prepared:
        """``segments`` as :meth:`transfer` would submit them, in batches."""
        session, dst_base, _ = self._peers[peer]
        if self._mem.single and len(self._spaces[peer].buffers) == 1:
            batches, nbytes = _batches(self.base, dst_base, segments, self.max_batch)
        else:
            batches, nbytes = _batches(0, 0, self._addresses(peer, segments), self.max_batch)
        return Prepared(session, tuple(batches), nbytes)

    def transfer_prepared(self, prepared: Prepared, clock: Callable[[], float] | None = None) -> None:
        """Submit and wait for ``prepared``'s batches, one after another. The
        engine's calls post and wait in turn: there is no post on its own to
        time (None; ``clock`` is not read)."""
        _run(self._engine, prepared.session, prepared.batches)

    def _addresses(self, peer: str, segments: Iterable[Any]) -> npt.NDArray[np.int64]:
        """Several buffers on a side: rows of addresses (vectorised), bases 0."""
        srcs, dsts, lens = (np.asarray(c, dtype=np.int64) for c in segment_lists(segments))
        rows = np.empty((len(lens), 3), dtype=np.int64)
        rows[:, 0] = self._mem.flat.locate(srcs, lens)[0]
        rows[:, 1] = self._spaces[peer].locate(dsts, lens)[0]
        rows[:, 2] = lens
        return rows

    def close(self) -> None:
        if self._engine is None:
            return
        unregister_space(self._engine, self._mem)
        self._engine = None
        self._peers.clear()
        gc.collect()  # engine teardown: ~1 s


def open_source(nbytes: int, options: Mapping[str, str] | None = None) -> RawWriter:
    """A :class:`RawWriter` with ``nbytes`` of zeroed source memory."""
    return RawWriter(nbytes, options)


def open_engine(
    nbytes: int, host: str = "127.0.0.1", protocol: str = "tcp"
) -> tuple[Any, npt.NDArray[np.uint8]]:
    """A new bare engine with ``nbytes`` of zeroed source memory registered."""
    engine = new_engine(host, protocol, "")
    src = np.zeros(nbytes, dtype=np.uint8)
    if engine.register_memory(int(src.ctypes.data), nbytes) != 0:
        raise RuntimeError("register_memory failed")
    return engine, src


def write_segments(
    engine: Any, src_base: int, metadata: bytes, segments: Iterable[Any], max_batch: int = MAX_BATCH
) -> tuple[int, float]:
    """Write ``segments`` through ``engine`` and wait. Returns (bytes, seconds)."""
    session, dst_base, _ = unpack_metadata(metadata)
    start = time.monotonic()
    nbytes = _write(engine, session, src_base, dst_base, segments, max_batch)
    return nbytes, time.monotonic() - start
