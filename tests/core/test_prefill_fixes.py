"""Issue 31's fixes on the prefill side, through the real endpoints: a
sender made after decode aborted, finish() before completion, the
incarnation tag on queued chunks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence

import pytest

from kvconn.chunk import Chunk, Segment
from kvconn.config import Config
from kvconn.errors import KvconnError, RoomStateError
from kvconn.hookspecs import hookimpl
from kvconn.protocol.ledger import RoomKey
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import KVPoll, PrefillRank
from kvconn.testing.null import NullBackend, NullWriter
from kvconn.testing.waiting import wait_for
from kvconn.transport import Settlement

WAIT_S = 10.0


class _HeldWriter(NullWriter):
    """Records every posted chunk; a chunk's barrier waits while its room is held."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.posted: list[tuple[int, int, tuple[int, ...]]] = []
        self.held: dict[int, threading.Event] = {}

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> object:
        self.posted.append((chunk.room, chunk.index, chunk.dst_pages))
        return chunk

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement:
        gate = self.held.get(chunk.room)
        if gate is not None and not gate.wait(max(0.0, deadline - time.monotonic())):
            return Settlement.UNSETTLED
        return Settlement.LANDED


class _HeldBackend(NullBackend):
    name = "held"

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> _HeldWriter:
        return _HeldWriter(nbytes)


@pytest.fixture
def world() -> Iterator[tuple[PrefillRank, DecodeEndpoint, _HeldWriter]]:
    backend = _HeldBackend()
    rank = PrefillRank(backend, 0, 16 * 4096, Config(workers=1))
    decode = DecodeEndpoint(backend, 16, 4096, [rank.address], Config())
    writer = rank.writer
    assert isinstance(writer, _HeldWriter)
    try:
        yield rank, decode, writer
    finally:
        for gate in writer.held.values():
            gate.set()
        decode.close()
        rank.close()


def _status(rank: PrefillRank, room: int) -> KVPoll | None:
    with rank._lock:
        return next((e.status for e in rank.ledger.decodes_of(room).values()), None)


def test_a_sender_made_after_decode_aborted_says_failed(
    world: tuple[PrefillRank, DecodeEndpoint, _HeldWriter],
) -> None:
    """Issue 31 (2): it said BOOTSTRAPPING, and for ever with
    room_bootstrap_timeout_s off (its default)."""
    rank, decode, _ = world
    assert rank.config.room_bootstrap_timeout_s is None
    rx = decode.receiver(1, (0, 1))
    wait_for(lambda: rank.requesting_tp(1) is not None, WAIT_S, "the request at the rank", poll=0.001)
    rx.abort()
    wait_for(lambda: _status(rank, 1) is KVPoll.FAILED, WAIT_S, "the abort at the rank", poll=0.001)
    sender = rank.sender(1)
    assert sender.poll() is KVPoll.FAILED
    verdict = sender.verdict()
    assert verdict is not None and verdict.status is KVPoll.FAILED and verdict.settled
    assert verdict.reason == "aborted by decode"
    assert sender.settled()


def test_finish_before_the_room_completed_is_still_a_value_error(
    world: tuple[PrefillRank, DecodeEndpoint, _HeldWriter],
) -> None:
    """Issue 31 (3): finish() raised ValueError before RoomStateError existed;
    errors.py promises engines catching that keep working."""
    _, decode, _ = world
    rx = decode.receiver(1, (0,))
    with pytest.raises(ValueError, match="not completed") as raised:
        rx.finish()
    assert isinstance(raised.value, RoomStateError) and isinstance(raised.value, KvconnError)
    assert isinstance(raised.value, RuntimeError)  # what it raised since, too


def test_an_earlier_requests_queued_chunk_is_never_written_into_the_request_that_reused_its_id(
    world: tuple[PrefillRank, DecodeEndpoint, _HeldWriter],
) -> None:
    """Issue 31 (4a). A chunk queued for room 1 waits behind room 2's; decode
    aborts room 1 (nothing of it counted: acked at once), takes its pages
    back and reuses the id with other pages. The old chunk, dequeued now,
    must be skipped: without its incarnation tag it meets a live room and is
    written, into pages decode has handed out again."""
    rank, decode, writer = world
    writer.held[2] = threading.Event()
    blocker = decode.receiver(2, (10,))
    wait_for(lambda: rank.requesting_tp(2) is not None, WAIT_S, "room 2's request", poll=0.001)
    rank.sender(2).send([0], last=True)
    wait_for(lambda: (2, 0, (10,)) in writer.posted, WAIT_S, "room 2's chunk in the transport", poll=0.001)

    first = decode.receiver(1, (0, 1))
    wait_for(lambda: rank.requesting_tp(1) is not None, WAIT_S, "room 1's request", poll=0.001)
    old = rank.sender(1)
    old.send([3])  # queued behind room 2's chunk: not dequeued, not counted
    first.abort()
    wait_for(lambda: first.state() is None, WAIT_S, "room 1's pages back at decode", poll=0.001)
    with rank._lock:
        incarnation = rank.ledger.incarnation(RoomKey(decode.name, 1))
    second = decode.receiver(1, (4, 5))
    wait_for(
        lambda: rank.ledger.incarnation(RoomKey(decode.name, 1)) not in (None, incarnation),
        WAIT_S,
        "the reused id at the rank",
        poll=0.001,
    )
    writer.held[2].set()  # the worker dequeues the old chunk now
    wait_for(
        lambda: rank.metrics.value("kvconn_chunks_total", outcome="skipped") == 1,
        WAIT_S,
        "the old chunk skipped",
        poll=0.001,
    )
    assert [p for p in writer.posted if p[0] == 1] == []
    assert _status(rank, 1) is KVPoll.WAITING_FOR_INPUT  # the new request, untouched

    new = rank.sender(1)
    new.send([6, 7], last=True)
    wait_for(lambda: second.poll() is KVPoll.SUCCESS, WAIT_S, "the new request's success", poll=0.001)
    assert [p for p in writer.posted if p[0] == 1] == [(1, 0, (4, 5))]
    assert blocker.poll() is KVPoll.SUCCESS
