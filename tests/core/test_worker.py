"""The transfer worker accounts for a landed chunk while the next one is in
flight: after the next post, never after the next barrier, and never not at
all (a failing post, a stop)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

from kvconn.bench.overhead import NullBackend, NullWriter
from kvconn.chunk import Chunk, Segment
from kvconn.config import Config
from kvconn.hookspecs import hookimpl
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.runtime.prefill import _STOP, PrefillRank
from kvconn.transport import Settlement

WAIT_S = 10.0


class _GatedWriter(NullWriter):
    """Every chunk's barrier waits until the test opens that chunk's gate."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.gates: dict[tuple[int, int], threading.Event] = {}
        self.posted: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.fail_post: set[tuple[int, int]] = set()
        #: called inside every on_post: what the test wants to see at that moment
        self.probe: Callable[[], object] = lambda: None
        self.probed: list[object] = []

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> object:
        self.probed.append(self.probe())
        if (chunk.room, chunk.index) in self.fail_post:
            raise RuntimeError("injected post failure")
        self.posted.put((chunk.room, chunk.index))
        return chunk

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement:
        opened = self.gates[chunk.room, chunk.index].wait(max(0.0, deadline - time.monotonic()))
        return Settlement.LANDED if opened else Settlement.UNSETTLED


class _GatedBackend(NullBackend):
    name = "gated"

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> _GatedWriter:
        return _GatedWriter(nbytes)


@pytest.fixture
def world() -> Iterator[tuple[PrefillRank, DecodeEndpoint, _GatedWriter]]:
    backend = _GatedBackend()
    rank = PrefillRank(backend, 0, 16 * 4096, Config())
    decode = DecodeEndpoint(backend, 16, 4096, [rank.address], Config())
    writer = rank.writer
    assert isinstance(writer, _GatedWriter)
    try:
        yield rank, decode, writer
    finally:
        for gate in writer.gates.values():
            gate.set()
        decode.close()
        rank.close()


def _until(what: str, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _one_chunk_rooms(
    rank: PrefillRank, decode: DecodeEndpoint, writer: _GatedWriter, rooms: Sequence[int]
) -> dict[int, Receiver]:
    """Request each room (one page, one chunk) and queue its only chunk."""
    receivers = {}
    for room in rooms:
        writer.gates[room, 0] = threading.Event()
        receivers[room] = decode.receiver(room, (room,))
    for room in rooms:
        _until(f"room {room}'s request", lambda r=room: rank.sender(r).poll() >= KVPoll.WAITING_FOR_INPUT)
    for room in rooms:
        rank.sender(room).send([room], last=True)
    return receivers


def _status(rank: PrefillRank, room: int) -> KVPoll | None:
    with rank._lock:
        return rank.ledger.status(room)


def test_landed_chunk_is_accounted_after_the_next_post_before_its_barrier(
    world: tuple[PrefillRank, DecodeEndpoint, _GatedWriter],
) -> None:
    rank, decode, writer = world
    writer.probe = lambda: _status(rank, 1)
    rx = _one_chunk_rooms(rank, decode, writer, (1, 2))
    assert writer.posted.get(timeout=WAIT_S) == (1, 0)
    writer.gates[1, 0].set()
    assert writer.posted.get(timeout=WAIT_S) == (2, 0)
    # Room 2 was posted before room 1's landing was accounted for: the
    # transport's next transfer did not wait for the ledger.
    assert writer.probed == [KVPoll.TRANSFERRING, KVPoll.TRANSFERRING]
    # ...and room 1 concludes while room 2 is still in flight: its status does
    # not wait for the next barrier.
    _until("room 1 to succeed at the rank", lambda: _status(rank, 1) is KVPoll.SUCCESS)
    _until("decode to see room 1 succeed", lambda: rx[1].poll() is KVPoll.SUCCESS)
    assert _status(rank, 2) is KVPoll.TRANSFERRING
    writer.gates[2, 0].set()
    _until("room 2 to succeed", lambda: _status(rank, 2) is KVPoll.SUCCESS)
    assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 2.0


def test_a_failing_next_post_does_not_lose_the_landed_chunk(
    world: tuple[PrefillRank, DecodeEndpoint, _GatedWriter],
) -> None:
    rank, decode, writer = world
    writer.fail_post.add((2, 0))
    _one_chunk_rooms(rank, decode, writer, (1, 2))
    assert writer.posted.get(timeout=WAIT_S) == (1, 0)
    writer.gates[1, 0].set()
    _until("room 1 to succeed", lambda: _status(rank, 1) is KVPoll.SUCCESS)
    _until("room 2 to fail", lambda: _status(rank, 2) is KVPoll.FAILED)
    assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 1.0
    assert rank.metrics.value("kvconn_chunks_total", outcome="plugin_error") == 1.0


def test_a_stop_behind_a_landed_chunk_accounts_for_it_first(
    world: tuple[PrefillRank, DecodeEndpoint, _GatedWriter],
) -> None:
    rank, decode, writer = world
    _one_chunk_rooms(rank, decode, writer, (1,))
    assert writer.posted.get(timeout=WAIT_S) == (1, 0)
    rank._queues[0].put(_STOP)  # queued behind the chunk in flight
    writer.gates[1, 0].set()
    rank._workers[0].join(WAIT_S)
    assert not rank._workers[0].is_alive()
    assert _status(rank, 1) is KVPoll.SUCCESS
    assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 1.0
