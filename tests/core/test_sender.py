"""The engine's Sender refuses chunks the rank must not write."""

from __future__ import annotations

import time

import pytest

from kvconn.bench.overhead import NullBackend
from kvconn.config import Config
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.cluster import wait_for


def test_no_chunk_may_follow_the_last_one() -> None:
    """Once the last chunk landed, decode is told Success and may hand the
    pages out again: a further send is refused, not written."""
    backend = NullBackend()
    rank = PrefillRank(backend, 0, 16 * 4096, Config())
    decode = DecodeEndpoint(backend, 16, 4096, [rank.address], Config())
    try:
        decode.receiver(1, (0,))
        sender = rank.sender(1)
        with pytest.raises(RuntimeError, match="not bootstrapped yet"):
            rank.sender(2).send([0])
        deadline = time.monotonic() + 10
        while sender.poll() < KVPoll.WAITING_FOR_INPUT:
            assert time.monotonic() < deadline, "the request never reached the rank"
            time.sleep(0.001)
        sender.send([0], last=True)
        with pytest.raises(RuntimeError, match="room 1: its last chunk was sent"):
            sender.send([1])  # at once, before the room concluded
        while sender.poll() is not KVPoll.SUCCESS:
            assert time.monotonic() < deadline, "the room never succeeded"
            time.sleep(0.001)
        with pytest.raises(RuntimeError, match="room 1: complete at this rank"):
            rank.sender(1).send([1], last=True)  # another sender of the same room
        assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 1.0
    finally:
        decode.close()
        rank.close()


def test_a_late_clear_or_fail_of_a_concluded_request_leaves_the_reused_room_alone() -> None:
    """Decode reuses a room id once it took the room's pages. The engine's
    handle on the first request, cleared (or failed) late, must not forget or
    fail the second request: its sender would find the room not bootstrapped,
    and decode would wait for a transfer that never comes. Nor may the old
    handle send into the new request."""
    backend = NullBackend()
    rank = PrefillRank(backend, 0, 16 * 4096, Config())
    decode = DecodeEndpoint(backend, 16, 4096, [rank.address], Config())
    try:
        first = decode.receiver(1, (0, 1))
        old = rank.sender(1)
        wait_for(lambda: old.poll() >= KVPoll.WAITING_FOR_INPUT, 10, "the first request at the rank")
        old.send([0])
        old.send([1], last=True)
        wait_for(lambda: first.poll() is KVPoll.SUCCESS, 10, "the first request's success")
        assert first.finish() == (0, 1)
        incarnation = rank.ledger.incarnation(1)
        second = decode.receiver(1, (2, 3))
        wait_for(lambda: rank.ledger.incarnation(1) != incarnation, 10, "the second request at the rank")

        old.clear()
        old.fail("the engine gave up late on its first request")
        assert rank.ledger.status(1) is KVPoll.WAITING_FOR_INPUT
        with pytest.raises(RuntimeError, match="requested again"):
            old._last_sent = False  # even a handle that did not finish may not send into the new request
            old.send([2])
        new = rank.sender(1)
        new.send([2, 3], last=True)
        wait_for(lambda: second.poll() is KVPoll.SUCCESS, 10, "the second request's success")
        assert second.finish() == (2, 3)
        new.clear()
        assert rank.ledger.status(1) is None  # its own handle clears it
    finally:
        decode.close()
        rank.close()
