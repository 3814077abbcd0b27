"""The engine's Sender refuses chunks the rank must not write."""

from __future__ import annotations

import time

import pytest

from kvconn.config import Config
from kvconn.protocol.ledger import KVPoll, RoomKey
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.null import NullBackend
from kvconn.testing.waiting import wait_for


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
        incarnation = rank.ledger.incarnation(RoomKey(decode.name, 1))
        second = decode.receiver(1, (2, 3))
        wait_for(
            lambda: rank.ledger.incarnation(RoomKey(decode.name, 1)) != incarnation,
            10,
            "the second request at the rank",
        )

        old.clear()
        old.fail("the engine gave up late on its first request")
        assert rank.ledger.status(RoomKey(decode.name, 1)) is KVPoll.WAITING_FOR_INPUT
        with pytest.raises(RuntimeError, match="requested again"):
            # even a handle that did not finish may not send into the new request
            old._state.last_sent = False
            old.send([2])
        new = rank.sender(1)
        new.send([2, 3], last=True)
        wait_for(lambda: second.poll() is KVPoll.SUCCESS, 10, "the second request's success")
        assert second.finish() == (2, 3)
        new.clear()
        assert rank.ledger.status(RoomKey(decode.name, 1)) is None  # its own handle clears it
    finally:
        decode.close()
        rank.close()


def test_a_fan_out_sender_writes_each_chunk_to_every_decode_that_asked() -> None:
    """rank.sender(room, decodes=2): prefill TP smaller than decode TP. It
    waits for both decodes' requests, then each send() queues the chunk to
    both, into each decode's own pages; one decode's abort fails only its
    room, the other completes."""
    backend = NullBackend()
    rank = PrefillRank(backend, 0, 16 * 4096, Config())
    a = DecodeEndpoint(backend, 16, 4096, [rank.address], Config())
    b = DecodeEndpoint(backend, 16, 4096, [rank.address], Config())
    try:
        tx = rank.sender(1, decodes=2)
        rx_a = a.receiver(1, (0, 1))
        wait_for(lambda: a.name in rank.ledger.decodes_of(1), 10, "a's request")
        assert tx.poll() is KVPoll.BOOTSTRAPPING  # one of two decodes asked
        with pytest.raises(RuntimeError, match="1 of 2 decodes requested it"):
            tx.send([0])
        rx_b = b.receiver(1, (5, 6))
        wait_for(lambda: tx.poll() is KVPoll.WAITING_FOR_INPUT, 10, "b's request")
        tx.send([3])
        landed = lambda: rank.metrics.value("kvconn_chunks_total", outcome="landed")  # noqa: E731
        wait_for(lambda: landed() == 2.0, 10, "the first chunk in both decodes")
        rx_a.abort()
        wait_for(lambda: tx.statuses().get(a.name) is KVPoll.FAILED, 10, "a's abort at the rank")
        tx.send([4], last=True)
        wait_for(lambda: rx_b.poll() is KVPoll.SUCCESS, 10, "b's room")
        assert rx_b.finish() == (5, 6)
        assert tx.statuses() == {a.name: KVPoll.FAILED, b.name: KVPoll.SUCCESS}
        assert tx.poll() is KVPoll.FAILED  # not every decode got the room
        wait_for(tx.settled, 10, "the sender settled")
        assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 3.0  # a's 1st, b's both
        assert rank.metrics.value("kvconn_chunks_total", outcome="skipped") == 1.0  # a's last
        with pytest.raises(ValueError, match="at least one decode"):
            rank.sender(2, decodes=0)
    finally:
        a.close()
        b.close()
        rank.close()
