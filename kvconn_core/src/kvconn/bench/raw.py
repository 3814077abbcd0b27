"""The same writes through a transport's raw API, without kvconn.

loopback: the writer's own post/barrier path (its NIC thread and memmove),
called directly, no ledger, no hooks manager, no control plane.
nixl / mooncake: the plugin's ``kvconn_<name>.raw.RawWriter``, if it has one.
Either way each rank fills its source pages with the pattern before every
chunk, as the bench's prefill processes do, so both sides do the same work.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import resource_tracker
from typing import Any

import attrs

from kvconn.chunk import Chunk, SegmentTable
from kvconn.runtime.layout import PageLayout
from kvconn.testing.patterns import shard_bytes
from kvconn.transport import Backend, PageRegion

#: One room of the raw run: (room id, destination pages).
RawRoom = tuple[int, Sequence[int]]


@attrs.frozen
class RawResult:
    available: bool
    detail: str
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Unavailable(Exception):
    pass


# A per-rank writer: (chunk, segments) -> None, writing and waiting; plus fill and close.
WriteFn = Callable[[Chunk, SegmentTable], None]


@attrs.define
class _RankIO:
    fill: Callable[[int, bytes], None]
    write: WriteFn
    close: Callable[[], None]


def _loopback_io(
    backend: Backend, region: PageRegion, source_bytes: int, options: Mapping[str, str]
) -> _RankIO:
    writer: Any = backend.open_writer(source_bytes, options)
    writer.connect("raw", region.metadata)
    # The loopback writer unregisters the segment from this process's resource
    # tracker (meant for a writer in another process); here the owner is this
    # process, so register it back or the owner's unlink warns.
    resource_tracker.register("/" + region.metadata.decode().lstrip("/"), "shared_memory")

    def write(chunk: Chunk, segments: SegmentTable) -> None:
        handle = writer.on_post(chunk=chunk, segments=segments)
        writer.on_done_barrier(chunk=chunk, posted=handle, deadline=time.monotonic() + 30)

    return _RankIO(writer.write, write, writer.close)


def _module_io(
    name: str, backend: Backend, region: PageRegion, source_bytes: int, options: Mapping[str, str]
) -> _RankIO:
    try:
        mod = importlib.import_module(f"kvconn_{name}.raw")
    except ImportError as exc:
        raise Unavailable(f"kvconn_{name}.raw is not available ({exc})") from exc
    if not hasattr(mod, "RawWriter"):
        raise Unavailable(f"kvconn_{name}.raw has no RawWriter")
    # The plugins' shared raw API: RawWriter(nbytes, options) with write (fill),
    # connect(peer, metadata), transfer(peer, segments) and close.
    writer = mod.RawWriter(source_bytes, options)
    writer.connect("raw", region.metadata)

    def write(chunk: Chunk, segments: SegmentTable) -> None:
        writer.transfer("raw", segments.rows)  # the array a raw API user holds

    return _RankIO(writer.write, write, writer.close)


def run_raw(
    name: str,
    backend: Backend,
    rooms: Sequence[RawRoom],
    page_bytes: int,
    num_ranks: int,
    chunk_pages: int,
    pool_pages: int,
    options: Mapping[str, str],
) -> RawResult:
    """Write ``rooms`` with ``num_ranks`` writer threads; time the whole run."""
    layout = PageLayout(page_bytes, num_ranks)
    shard = layout.shard
    max_pages = max((len(p) for _, p in rooms), default=1)
    source_bytes = max_pages * shard
    region = backend.open_region(pool_pages * page_bytes, options)
    ios: list[_RankIO] = []
    try:
        for _ in range(num_ranks):
            if name == "loopback":
                ios.append(_loopback_io(backend, region, source_bytes, options))
            else:
                ios.append(_module_io(name, backend, region, source_bytes, options))
    except Unavailable as exc:
        for io in ios:
            io.close()
        region.close()
        return RawResult(False, str(exc))
    errors: list[BaseException] = []

    def rank_loop(rank: int) -> None:
        io = ios[rank]
        try:
            for room, dst in rooms:
                for first in range(0, len(dst), chunk_pages):
                    n = min(chunk_pages, len(dst) - first)
                    src = tuple(range(first, first + n))
                    for i in src:
                        io.fill(i * shard, shard_bytes(room, rank, i, shard))
                    part = tuple(dst[first : first + n])
                    chunk = Chunk(room, first // chunk_pages, first + n == len(dst), rank, "raw", src, part)
                    io.write(chunk, layout.segments(rank, src, part))
        except BaseException as exc:  # reported, not raised from a thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(num_ranks)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    bad = 0
    for room, dst in rooms[:4]:  # spot-check that the raw path really wrote
        for i, page in enumerate(dst):
            data = region.read(page * page_bytes, page_bytes)
            for rank in range(num_ranks):
                if data[rank * shard : (rank + 1) * shard] != shard_bytes(room, rank, i, shard):
                    bad += 1
    for io in ios:
        io.close()
    region.close()
    if errors:
        return RawResult(False, f"raw path failed: {errors[0]!r}")
    nbytes = sum(len(p) for _, p in rooms) * page_bytes
    detail = "raw writer path" + (f" ({bad} spot-checked shards WRONG)" if bad else ", spot-checked")
    return RawResult(True, detail, nbytes, seconds)
