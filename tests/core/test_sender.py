"""The engine's Sender refuses chunks the rank must not write."""

from __future__ import annotations

import time

import pytest

from kvconn.bench.overhead import NullBackend
from kvconn.config import Config
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank


def test_no_chunk_may_follow_the_last_one() -> None:
    """Once the last chunk landed, decode is told Success and may hand the
    pages out again: a further send is refused, not written."""
    backend = NullBackend()
    rank = PrefillRank(backend, 0, 16 * 4096, Config())
    decode = DecodeEndpoint(backend, 16, 4096, [rank.address], Config())
    try:
        decode.receiver(1, (0, 1))
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
        with pytest.raises(RuntimeError, match="room 1 is complete at this rank"):
            rank.sender(1).send([1], last=True)  # another sender of the same room
        assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 1.0
    finally:
        decode.close()
        rank.close()
