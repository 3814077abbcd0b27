"""The runtime's own per-chunk cost, over a transport that does nothing.

A null backend (posting returns at once, every barrier says LANDED) isolates
what kvconn adds to every chunk: the ledger under its lock, the pluggy hook
calls, segment lowering and metrics. Measured two ways: the worker's
``_transfer`` called directly (hooks + ledger), and through ``Sender.send``
and the worker queue (adds the thread hand-off). The control plane is per
room, not per chunk: its round trip is measured separately.
"""

from __future__ import annotations

import statistics
import time

import attrs

from kvconn.chunk import Chunk
from kvconn.config import Config
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.null import NullBackend


@attrs.frozen
class Overhead:
    chunks: int
    direct_us: float  #: per chunk: ledger + hooks + lowering + metrics
    queued_us: float  #: per chunk through Sender.send and the worker thread
    control_rtt_ms: float  #: p50, one-chunk room: request -> SUCCESS at decode
    #: CPU of one one-page ``Sender.send`` on the calling (the engine's) thread
    send_us: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return attrs.asdict(self)


def _wait_requested(rank: PrefillRank, room: int) -> None:
    deadline = time.monotonic() + 10
    while rank.sender(room).poll() < KVPoll.WAITING_FOR_INPUT:
        if time.monotonic() > deadline:
            raise TimeoutError(f"room {room} never reached the prefill rank")
        time.sleep(0.0005)


def measure(chunks: int = 20000, rooms: int = 100) -> Overhead:
    backend = NullBackend()
    page_bytes = 4096
    # rooms 3.. of step 3 each take the page of their own number, on both
    # sides: fewer chunks than 3 + rooms still need that many pages.
    npages = max(chunks, 3 + rooms)
    rank = PrefillRank(backend, 0, npages * page_bytes, Config())
    # Rooms 1 and 2 share their pages on purpose (room 1 is written by calling
    # the worker directly and never finished): no page-ownership check.
    decode = DecodeEndpoint(backend, npages, page_bytes, [rank.address], Config(check_pages=False))
    try:
        pages = tuple(range(chunks))
        # 1. the worker's path, called directly
        decode.receiver(1, pages)
        _wait_requested(rank, 1)
        work = [Chunk(1, i, i == chunks - 1, 0, decode.name, (i,), (i,)) for i in range(chunks)]
        t0 = time.perf_counter()
        layout = rank._peers[decode.name].layout
        for chunk in work:
            rank._transfer(chunk, layout.segments(0, chunk.src_pages, chunk.dst_pages))
        direct = (time.perf_counter() - t0) / chunks
        # 2. through the sender and the worker queue
        decode.receiver(2, pages)
        _wait_requested(rank, 2)
        sender = rank.sender(2)
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(chunks):
            sender.send([i], last=i == chunks - 1)
        send = (time.thread_time() - c0) / chunks
        while sender.poll() is not KVPoll.SUCCESS:
            time.sleep(0.0001)
        queued = (time.perf_counter() - t0) / chunks
        # 3. the control plane's per-room round trip
        rtts = []
        for room in range(3, 3 + rooms):
            t0 = time.perf_counter()
            rx = decode.receiver(room, (room,))
            _wait_requested(rank, room)
            rank.sender(room).send([room], last=True)
            while rx.poll() is not KVPoll.SUCCESS:
                time.sleep(0.00005)
            rtts.append(time.perf_counter() - t0)
            rx.finish()
        return Overhead(chunks, direct * 1e6, queued * 1e6, statistics.median(rtts) * 1e3, send * 1e6)
    finally:
        decode.close()
        rank.close()
