"""The transfer worker accounts for a landed chunk while the next one is in
flight: after the next post, never after the next barrier, and never not at
all (a failing post, a stop). A room's last chunk is accounted for at once:
nothing queued behind it is posted while decode hears SUCCESS."""

from __future__ import annotations

import gc
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import pytest

from kvconn.chunk import Chunk, Segment
from kvconn.config import Config
from kvconn.hookspecs import hookimpl
from kvconn.protocol.ledger import KVPoll, RoomKey
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.runtime.prefill import _STOP, PrefillRank
from kvconn.testing.null import NullBackend, NullWriter
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
        #: per chunk: when it was posted, and the deadline its barrier got
        self.post_at: dict[tuple[int, int], float] = {}
        self.deadlines: dict[tuple[int, int], float] = {}

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> object:
        self.probed.append(self.probe())
        if (chunk.room, chunk.index) in self.fail_post:
            raise RuntimeError("injected post failure")
        self.post_at[chunk.room, chunk.index] = time.monotonic()
        self.posted.put((chunk.room, chunk.index))
        return chunk

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement:
        self.deadlines[chunk.room, chunk.index] = deadline
        opened = self.gates[chunk.room, chunk.index].wait(max(0.0, deadline - time.monotonic()))
        return Settlement.LANDED if opened else Settlement.UNSETTLED


class _GatedBackend(NullBackend):
    name = "gated"

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> _GatedWriter:
        return _GatedWriter(nbytes)


@contextmanager
def _endpoints(backend: NullBackend, pages: int = 16) -> Iterator[tuple[PrefillRank, DecodeEndpoint]]:
    rank = PrefillRank(backend, 0, pages * 4096, Config())
    decode = DecodeEndpoint(backend, pages, 4096, [rank.address], Config())
    try:
        yield rank, decode
    finally:
        decode.close()
        rank.close()


@pytest.fixture
def world() -> Iterator[tuple[PrefillRank, DecodeEndpoint, _GatedWriter]]:
    with _endpoints(_GatedBackend()) as (rank, decode):
        writer = rank.writer
        assert isinstance(writer, _GatedWriter)
        try:
            yield rank, decode, writer
        finally:
            for gate in writer.gates.values():
                gate.set()


def _until(what: str, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _rooms(
    rank: PrefillRank, decode: DecodeEndpoint, writer: _GatedWriter, chunks: Mapping[int, int]
) -> dict[int, Receiver]:
    """Request each room (``chunks[room]`` pages, one per chunk, from page
    ``4 * room``) and queue every chunk of it, rooms in order."""
    receivers = {}
    for room, n in chunks.items():
        for i in range(n):
            writer.gates[room, i] = threading.Event()
        receivers[room] = decode.receiver(room, tuple(range(4 * room, 4 * room + n)))
    for room in chunks:
        _until(f"room {room}'s request", lambda r=room: rank.sender(r).poll() >= KVPoll.WAITING_FOR_INPUT)
    for room, n in chunks.items():
        sender = rank.sender(room)
        for i in range(n):
            sender.send([i], last=i == n - 1)
    return receivers


def _status(rank: PrefillRank, room: int) -> KVPoll | None:
    with rank._lock:
        entries = rank.ledger.decodes_of(room)  # one decode here
        return next(iter(entries.values())).status if entries else None


def _in_flight(rank: PrefillRank, room: int) -> int:
    """Chunks of ``room`` counted (dequeued) and not yet accounted for."""
    with rank._lock:
        return sum(rank.ledger.in_flight(RoomKey(decode, room)) for decode in rank.ledger.decodes_of(room))


def test_landed_chunk_is_accounted_after_the_next_post_before_its_barrier(
    world: tuple[PrefillRank, DecodeEndpoint, _GatedWriter],
) -> None:
    rank, decode, writer = world
    writer.probe = lambda: _in_flight(rank, 1)
    _rooms(rank, decode, writer, {1: 2})
    assert writer.posted.get(timeout=WAIT_S) == (1, 0)
    writer.gates[1, 0].set()
    assert writer.posted.get(timeout=WAIT_S) == (1, 1)
    # Chunk 1 was posted before chunk 0's landing was accounted for: the
    # transport's next transfer did not wait for the ledger...
    assert writer.probed == [1, 2]
    # ...and chunk 0 is accounted for while chunk 1 is still in flight.
    _until("chunk 0 to be accounted for", lambda: _in_flight(rank, 1) == 1)
    assert _status(rank, 1) is KVPoll.TRANSFERRING
    writer.gates[1, 1].set()
    _until("room 1 to succeed", lambda: _status(rank, 1) is KVPoll.SUCCESS)
    assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 2.0


def test_a_rooms_last_chunk_is_accounted_before_the_next_post(
    world: tuple[PrefillRank, DecodeEndpoint, _GatedWriter],
) -> None:
    rank, decode, writer = world
    writer.probe = lambda: _status(rank, 1)
    rx = _rooms(rank, decode, writer, {1: 1, 2: 1})
    assert writer.posted.get(timeout=WAIT_S) == (1, 0)
    writer.gates[1, 0].set()
    assert writer.posted.get(timeout=WAIT_S) == (2, 0)
    # Room 1 concluded before room 2 was posted: its SUCCESS waits for no
    # other room's on_post.
    assert writer.probed == [KVPoll.TRANSFERRING, KVPoll.SUCCESS]
    _until("decode to see room 1 succeed", lambda: rx[1].poll() is KVPoll.SUCCESS)
    writer.gates[2, 0].set()
    _until("room 2 to succeed", lambda: _status(rank, 2) is KVPoll.SUCCESS)


def test_a_chunk_queued_behind_the_last_one_is_skipped_not_posted(
    world: tuple[PrefillRank, DecodeEndpoint, _GatedWriter],
) -> None:
    rank, decode, writer = world
    rx = _rooms(rank, decode, writer, {1: 1})
    assert writer.posted.get(timeout=WAIT_S) == (1, 0)
    # A second Sender of the room while its last chunk is in flight: the room
    # is still Transferring, so send() takes it; the ledger must skip it.
    rank.sender(1).send([1], last=True)
    writer.gates[1, 0].set()
    _until("decode to see room 1 succeed", lambda: rx[1].poll() is KVPoll.SUCCESS)
    _until(
        "the second chunk to be dequeued",
        lambda: rank.metrics.value("kvconn_chunks_total", outcome="skipped") == 1.0,
    )
    assert writer.posted.empty(), "a chunk behind the room's last one was written after SUCCESS"
    assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 1.0


def test_a_chunk_that_waited_for_a_fence_gets_its_whole_write_budget(
    world: tuple[PrefillRank, DecodeEndpoint, _GatedWriter],
) -> None:
    """A fence holds the gate until every running barrier is over (up to
    write_timeout_s): a chunk waiting at the gate must not spend its own
    deadline there, or one frozen peer fails healthy rooms too (found in
    review, 2026-11-30)."""
    rank, decode, writer = world
    held_s = 0.2  # how long the fence holds the gate: a gap to measure, not a timeout
    with rank._gate.exclusive():
        _rooms(rank, decode, writer, {1: 1})
        _until("the chunk to be counted (before the gate)", lambda: _in_flight(rank, 1) == 1)
        time.sleep(held_s)
        assert writer.posted.empty()
    assert writer.posted.get(timeout=WAIT_S) == (1, 0)
    writer.gates[1, 0].set()
    _until("room 1 to succeed", lambda: _status(rank, 1) is KVPoll.SUCCESS)
    budget = writer.deadlines[1, 0] - writer.post_at[1, 0]
    assert budget > rank.config.write_timeout_s - held_s / 2


def test_a_failing_next_post_does_not_lose_the_landed_chunk(
    world: tuple[PrefillRank, DecodeEndpoint, _GatedWriter],
) -> None:
    rank, decode, writer = world
    writer.fail_post.add((1, 1))
    _rooms(rank, decode, writer, {1: 2})
    assert writer.posted.get(timeout=WAIT_S) == (1, 0)
    writer.gates[1, 0].set()
    _until("room 1 to fail", lambda: _status(rank, 1) is KVPoll.FAILED)
    _until("both chunks to be accounted for", lambda: _in_flight(rank, 1) == 0)
    assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 1.0
    assert rank.metrics.value("kvconn_chunks_total", outcome="plugin_error") == 1.0


def test_a_stop_behind_a_landed_chunk_accounts_for_it_first(
    world: tuple[PrefillRank, DecodeEndpoint, _GatedWriter],
) -> None:
    rank, decode, writer = world
    writer.gates[1, 0] = threading.Event()
    decode.receiver(1, (4, 5))
    _until("room 1's request", lambda: rank.sender(1).poll() >= KVPoll.WAITING_FOR_INPUT)
    rank.sender(1).send([0])  # not the last chunk: its accounting waits for the next item
    assert writer.posted.get(timeout=WAIT_S) == (1, 0)
    rank._queues[0].put(_STOP)  # that next item
    writer.gates[1, 0].set()
    rank._workers[0].join(WAIT_S)
    assert not rank._workers[0].is_alive()
    assert _in_flight(rank, 1) == 0 and _status(rank, 1) is KVPoll.TRANSFERRING
    assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 1.0


class _Held:
    """What a raising hook held (for nixl: the agent its fence destroys)."""


class _RaisingPostWriter(NullWriter):
    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.held: list[weakref.ref[_Held]] = []
        self.freed_at_fence: list[bool] = []

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> object:
        agent = _Held()
        self.held.append(weakref.ref(agent))
        try:
            raise ConnectionError("peer gone")  # as nixl raises from transfer()
        except ConnectionError as exc:
            raise RuntimeError(f"transfer failed holding {agent!r}") from exc

    @hookimpl
    def on_fence(self) -> bool:
        gc.collect()
        self.freed_at_fence.append(all(ref() is None for ref in self.held))
        return True


class _RaisingPostBackend(NullBackend):
    name = "raising-post"

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> _RaisingPostWriter:
        return _RaisingPostWriter(nbytes)


def test_a_raising_hooks_frames_are_gone_before_the_fence() -> None:
    with _endpoints(_RaisingPostBackend(), pages=4) as (rank, decode):
        writer = rank.writer
        assert isinstance(writer, _RaisingPostWriter)
        decode.receiver(1, (0,))
        _until("room 1's request", lambda: rank.sender(1).poll() >= KVPoll.WAITING_FOR_INPUT)
        rank.sender(1).send([0], last=True)
        _until("the fence", lambda: bool(writer.freed_at_fence))
        assert writer.freed_at_fence == [True], "the core kept the raising hook's frames alive"
        assert _status(rank, 1) is KVPoll.FAILED
