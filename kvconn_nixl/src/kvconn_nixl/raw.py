"""The same chunked writes through the raw nixl API, without kvconn (no hooks,
no ledger, no control plane, no handle table), for side-by-side benchmarks.

The API matches :mod:`kvconn_mooncake.raw`::

    w = RawWriter(nbytes, options)     # source memory + its own agent
    w.write(offset, data)              # fill the source
    w.connect(peer, region_metadata)   # a kvconn-nixl region's metadata
    w.transfer(peer, segments)         # post every segment, wait until DONE
    w.close()

``prepare(peer, segments)`` then ``transfer_prepared(prepared)`` split the
same write in two: the descriptor arrays a raw API user holds (addresses,
lengths, device), built once, then only the library's calls, each time.

``segments`` are ``(src, dst, nbytes)`` byte offsets (tuples, kvconn
``Segment`` s, or an ``(n, 3)`` integer array). ``options`` are the nixl
backend's own (``ucx_tls`` etc.), so the raw path runs on the same UCX
transport as kvconn's writer.
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
from kvconn_nixl import _nixl
from kvconn_nixl._nixl import Options, RegionInfo, make_agent, open_memory, options_for, register, write_xfer

__all__ = ["Prepared", "RawWriter", "open_source", "raw_write", "segment_rows"]


def segment_rows(segments: Iterable[Any]) -> npt.NDArray[np.int64]:
    """``(n, 3)`` int64 rows (src, dst, nbytes) from tuples, Segments or an array."""
    if isinstance(segments, np.ndarray):
        return segments.astype(np.int64, copy=False).reshape(-1, 3)
    return _rows_of(_triples(segments))


def _triples(segments: Iterable[Any]) -> list[tuple[int, int, int]]:
    return [s if isinstance(s, tuple) else (s.src, s.dst, s.nbytes) for s in segments]


def _rows_of(triples: list[tuple[int, int, int]]) -> npt.NDArray[np.int64]:
    return np.array(triples, dtype=np.int64).reshape(-1, 3)


@attrs.frozen
class Prepared:
    """One write's descriptors as nixl takes them: ``(n, 3)`` uint64 rows of
    address, bytes and device id, for each side."""

    agent_name: str
    local: npt.NDArray[np.uint64]
    remote: npt.NDArray[np.uint64]
    remote_mem: str
    nbytes: int


class RawWriter:
    """Source memory (DRAM, or VRAM with ``memory=vram``) registered with its
    own nixl agent (no progress thread unless ``progress_thread`` is set:
    progress happens inside ``check_xfer_state``, as in kvconn's writer)."""

    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str] | None = None) -> None:
        """``source``: bytes to allocate, or engine buffers to register."""
        if isinstance(source, int) and source <= 0:
            raise ValueError("nbytes must be positive")
        self.options = options_for(source, Options.parse(options or {}))
        self._mem = open_memory(source, self.options)
        self.nbytes = self._mem.nbytes
        self.base = self._mem.addr
        self._agent: Any = make_agent("raw", self.options, progress_thread=bool(self.options.progress_thread))
        self._reg: Any = register(self._agent, self._mem, self.options)
        self._peers: dict[str, RegionInfo] = {}
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
        info = RegionInfo.decode(metadata)
        known = {i.agent_name for i in self._peers.values()}
        if info.agent_name not in known:
            self._agent.add_remote_agent(info.agent_md)
        self._peers[peer] = info
        self._spaces[peer] = info.space()

    def transfer(self, peer: str, segments: Iterable[Any], timeout_s: float = 60.0) -> int:
        """One WRITE transfer of every segment; poll ``check_xfer_state`` until
        DONE. Returns the bytes written; raises on an error or the timeout."""
        info = self._peers[peer]
        rows: npt.NDArray[np.int64] | list[tuple[int, int, int]]
        if isinstance(segments, np.ndarray):
            rows = segment_rows(segments)
        else:
            triples = _triples(segments)
            # the same descriptor path as kvconn's writer
            rows = triples if len(triples) <= _nixl.LIST_MAX_ROWS else _rows_of(triples)
        if not len(rows):
            return 0
        nbytes = sum(n for _, _, n in rows) if isinstance(rows, list) else int(rows[:, 2].sum())
        handle = write_xfer(self._agent, self.options, self._mem, info, rows, self._spaces[peer])
        self._finish(handle, self._agent.transfer(handle), timeout_s)
        return nbytes

    def prepare(self, peer: str, segments: Iterable[Any]) -> Prepared:
        """``segments``' descriptors, each side's addresses resolved: what
        :meth:`transfer_prepared` hands the library."""
        info = self._peers[peer]
        rows = segment_rows(segments)
        local = np.empty((len(rows), 3), dtype=np.uint64)
        remote = np.empty((len(rows), 3), dtype=np.uint64)
        local[:, 0] = self._mem.flat.locate(rows[:, 0], rows[:, 2])[0]
        remote[:, 0] = self._spaces[peer].locate(rows[:, 1], rows[:, 2])[0]
        local[:, 1] = remote[:, 1] = rows[:, 2]
        local[:, 2], remote[:, 2] = self._mem.dev_id, info.dev_id
        return Prepared(info.agent_name, local, remote, info.mem, int(rows[:, 2].sum()))

    def transfer_prepared(
        self, prepared: Prepared, clock: Callable[[], float] = time.perf_counter, timeout_s: float = 60.0
    ) -> float:
        """Write ``prepared`` (descriptor lists, ``initialize_xfer``,
        ``transfer``) and wait until DONE. Returns the post's time by
        ``clock``: until ``transfer`` returned."""
        t0 = clock()
        agent = self._agent
        handle = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(prepared.local, self._mem.mem_type),
            agent.get_xfer_descs(prepared.remote, prepared.remote_mem),
            prepared.agent_name,
        )
        state = agent.transfer(handle)
        posted = clock() - t0
        self._finish(handle, state, timeout_s)
        return posted

    def _finish(self, handle: Any, state: str, timeout_s: float) -> None:
        """Poll ``check_xfer_state`` until DONE, then release the handle."""
        agent = self._agent
        try:
            deadline = time.monotonic() + timeout_s
            spins = 0
            while state == "PROC":
                state = agent.check_xfer_state(handle)
                spins += 1
                if spins % 4096 == 0 and time.monotonic() > deadline:
                    raise TimeoutError(f"nixl transfer still PROC after {timeout_s} s")
            if state != "DONE":
                raise RuntimeError(f"nixl transfer ended {state}")
        finally:
            agent.release_xfer_handle(handle)
            del handle

    def close(self) -> None:
        if self._agent is None:
            return
        try:
            self._agent.deregister_memory(self._reg)
        finally:
            self._reg = None
            self._agent = None
            self._peers.clear()
            gc.collect()


def open_source(nbytes: int, options: Mapping[str, str] | None = None) -> RawWriter:
    """A :class:`RawWriter` with ``nbytes`` of zeroed source memory."""
    return RawWriter(nbytes, options)


def raw_write(
    region_metadata: bytes,
    segments: Sequence[tuple[int, int, int]],
    source: np.ndarray,
    options: Mapping[str, str] | None = None,
    repeat: int = 1,
) -> tuple[int, float]:
    """Write ``segments`` from ``source`` (a contiguous uint8 DRAM array) into
    the region ``repeat`` times, one transfer each. Returns (bytes written,
    seconds spent posting and waiting); setup is not timed."""
    writer = RawWriter(source.nbytes, options)
    try:
        writer.array()[:] = source.reshape(-1).view(np.uint8)
        writer.connect("region", region_metadata)
        total, seconds = 0, 0.0
        for _ in range(repeat):
            t0 = time.perf_counter()
            total += writer.transfer("region", segments)
            seconds += time.perf_counter() - t0
        return total, seconds
    finally:
        writer.close()
