"""The same writes through a transport's raw API, without kvconn.

The raw path of a backend is ``kvconn_<name>.raw.RawWriter`` where its plugin
ships one (nixl: ``initialize_xfer`` + ``transfer`` + ``check_xfer_state``;
Mooncake: ``batch_transfer_async_write`` + ``get_batch_transfer_status``);
otherwise (loopback, a third party's plugin) its writer's own post/barrier
hooks, called directly: no pluggy, ledger or control plane.

``kvconn bench --compare-raw`` runs one raw writer process per rank, as the
bench runs one kvconn prefill process per rank, all started together; each
fills its source pages with the pattern before every chunk, as the bench's
prefill processes do, then writes the chunk and waits for it. Run as
``python -m kvconn.bench.raw ARGS_JSON`` this file is that process
(a :class:`kvconn.testing.child.Child`).
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvconn.buffers import Buffer
from kvconn.chunk import Chunk, Segment, SegmentTable
from kvconn.plugins import get_backend
from kvconn.runtime.layout import PageLayout
from kvconn.testing.child import Child, ChildError, StderrLog, load_args, quiet_interrupts
from kvconn.testing.patterns import shard_bytes
from kvconn.transport import Backend, Settlement, register_writer

#: How long a bench child gets to report and exit once its stdin closes.
CLOSE_S = 90.0

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


class HookRaw:
    """A backend's own writer, its post/barrier hooks called directly: the raw
    path of a backend without a ``kvconn_<name>.raw`` module (loopback)."""

    def __init__(self, backend: Backend, source: int | Sequence[Buffer], options: Mapping[str, str]) -> None:
        if isinstance(source, int):
            self._w: Any = backend.open_writer(source, options)
        else:
            self._w = register_writer(backend, source, options)
        self.write = self._w.write

    def connect(self, peer: str, metadata: bytes) -> None:
        self._w.connect(peer, metadata)

    def transfer(self, peer: str, segments: Sequence[Segment]) -> int:
        self.transfer_prepared((peer, segments))
        return sum(s.nbytes for s in segments)

    def prepare(self, peer: str, segments: Any) -> tuple[str, SegmentTable]:
        """``segments`` (Segments or ``(n, 3)`` rows) as the table the hooks take."""
        return peer, SegmentTable(segments) if isinstance(segments, np.ndarray) else SegmentTable.of(segments)

    def transfer_prepared(
        self, prepared: tuple[str, Sequence[Segment]], clock: Callable[[], float] = time.perf_counter
    ) -> float:
        """Post and wait; ``on_post``'s time by ``clock``."""
        peer, segments = prepared
        chunk = Chunk(0, 0, True, 0, peer, (), ())
        t0 = clock()
        posted = self._w.on_post(chunk=chunk, segments=segments)
        seconds = clock() - t0
        settled = self._w.on_done_barrier(chunk=chunk, posted=posted, deadline=time.monotonic() + 60)
        if settled is not Settlement.LANDED:
            raise RuntimeError(f"raw write settled {settled}")
        return seconds

    def close(self) -> None:
        self._w.close()


def open_raw(name: str, nbytes: int | Sequence[Buffer], options: Mapping[str, str]) -> tuple[Any, str]:
    """Backend ``name``'s raw writer of ``nbytes`` source bytes (or over the
    engine buffers ``nbytes`` lists), and how it writes. Both kinds have ``write(offset, data)`` (fill the source),
    ``connect(peer, metadata)``, ``transfer(peer, segments)`` (write and wait;
    the bytes written), ``prepare(peer, segments)`` then
    ``transfer_prepared(prepared)`` (the same write, its descriptors built
    first; returns the post's seconds, or None where the library posts and
    waits in one) and ``close()``; a ``RawWriter`` takes the segments'
    ``rows`` array, the form a raw API user holds."""
    try:
        mod = importlib.import_module(f"kvconn_{name}.raw")
    except ImportError:
        mod = None
    if mod is not None and hasattr(mod, "RawWriter"):
        return mod.RawWriter(nbytes, options), f"kvconn_{name}.raw.RawWriter"
    return HookRaw(get_backend(name), nbytes, options), f"{name} writer's post/barrier, called directly"


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
    """Write ``rooms`` with ``num_ranks`` raw writer processes; time the whole
    run, from the command to every process's reply."""
    shard = PageLayout(page_bytes, num_ranks).shard
    max_pages = max((len(p) for _, p in rooms), default=1)
    region = backend.open_region(pool_pages * page_bytes, options)
    children: list[Child] = []
    how, bad = "", 0
    try:
        common = {
            "backend": name,
            "options": dict(options),
            "metadata": region.metadata.hex(),
            "page_bytes": page_bytes,
            "num_ranks": num_ranks,
            "chunk_pages": chunk_pages,
            "source_bytes": max_pages * shard,
            "rooms": [[room, list(dst)] for room, dst in rooms],
        }
        for rank in range(num_ranks):
            child = Child(
                "kvconn.bench.raw",
                {**common, "rank": rank},
                log=StderrLog(),
                name="bench rank child",
                failure=ChildError,
            )
            children.append(child)
            how = str(child.next_with("ready", 120, "the raw writer's start")["ready"])
        t0 = time.perf_counter()
        for child in children:
            child.send_line(json.dumps({"op": "run"}))
        replies = [child.next_with("done", 600, "the raw writer's run") for child in children]
        seconds = time.perf_counter() - t0
        bad = _spot_check(region, rooms, page_bytes, num_ranks)
    except (RuntimeError, OSError) as exc:  # a child that could not start, or died
        return RawResult(False, f"raw path could not run: {exc}")
    finally:
        for child in children:
            child.close(CLOSE_S)
        region.close()
    errors = [r["error"] for r in replies if r.get("error")]
    if errors:
        return RawResult(False, f"raw path failed: {errors[0]}")
    nbytes = sum(len(p) for _, p in rooms) * page_bytes
    checked = f" ({bad} spot-checked shards WRONG)" if bad else ", spot-checked"
    return RawResult(True, f"{how}, {num_ranks} processes{checked}", nbytes, seconds)


def _spot_check(region: Any, rooms: Sequence[RawRoom], page_bytes: int, num_ranks: int) -> int:
    """The wrong shards among the pages of the first and last four rooms,
    each checked against the last room that wrote it (rooms reuse pages)."""
    last: dict[int, tuple[int, int]] = {}  # page -> (room, index in the room)
    for room, dst in rooms:
        for i, page in enumerate(dst):
            last[page] = (room, i)
    shard = PageLayout(page_bytes, num_ranks).shard
    bad = 0
    for page in sorted({page for _, dst in [*rooms[:4], *rooms[-4:]] for page in dst}):
        room, i = last[page]
        data = region.read(page * page_bytes, page_bytes)
        for rank in range(num_ranks):
            if data[rank * shard : (rank + 1) * shard] != shard_bytes(room, rank, i, shard):
                bad += 1
    return bad


def _rank_main() -> None:
    """One raw writer process: every room's chunks, filled then written."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = load_args(sys.argv[1])
    rank, cp = int(cfg["rank"]), int(cfg["chunk_pages"])
    layout = PageLayout(int(cfg["page_bytes"]), int(cfg["num_ranks"]))
    shard = layout.shard
    writer, how = open_raw(cfg["backend"], int(cfg["source_bytes"]), dict(cfg["options"]))
    native = not isinstance(writer, HookRaw)
    writer.connect("raw", bytes.fromhex(cfg["metadata"]))
    print(json.dumps({"ready": how}), flush=True)
    if sys.stdin.readline().strip():  # {"op": "run"}; an empty line: stdin closed
        error = ""
        try:
            for room, dst in cfg["rooms"]:
                for first in range(0, len(dst), cp):
                    src = range(first, min(first + cp, len(dst)))
                    for i in src:
                        writer.write(i * shard, shard_bytes(room, rank, i, shard))
                    lowered = layout.segments(rank, tuple(src), tuple(dst[first : first + cp]))
                    writer.transfer("raw", lowered.rows if native else lowered)
        except Exception as exc:  # reported to the parent, which says so
            error = repr(exc)
        print(json.dumps({"done": True, "error": error}), flush=True)
    sys.stdin.read()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m kvconn.bench.raw ARGS_JSON")
    quiet_interrupts()
    _rank_main()
