"""One decode endpoint (one region, one page pool) serving any number of
prefill instances of any TP size, each named per request
(``receiver(room, pages, prefill=[its ranks' addresses])``), bootstrapped on
first use and kept, with heartbeats, restarts and exit proofs per rank.
Real loopback rank processes write into the decode's own memory."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from kvconn.config import Config
from kvconn.errors import BootstrapError
from kvconn.plugins import get_backend
from kvconn.protocol.hold import HoldState, Proof, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.testing.cluster import LOOPBACK_SLOW, Rank, free_port
from kvconn.testing.patterns import canary, shard_bytes
from kvconn.testing.waiting import wait_for

PAGE_BYTES, NUM_PAGES = 16 << 10, 64
CONFIG = Config(
    write_timeout_s=0.5,
    abort_timeout_s=3.0,
    resend_interval_s=0.1,
    bootstrap_timeout_s=20.0,
    heartbeat_interval_s=0.1,
    peer_timeout_s=5.0,
    backend_options=dict(LOOPBACK_SLOW),
)


def _rank(rank: int, tp: int, port: int = 0) -> Rank:
    return Rank(
        {
            "backend": "loopback",
            "rank": rank,
            "page_bytes": PAGE_BYTES,
            "num_ranks": tp,
            "chunk_pages": 2,
            "source_pages": NUM_PAGES,
            "write_timeout_s": CONFIG.write_timeout_s,
            "abort_timeout_s": CONFIG.abort_timeout_s,
            "backend_options": dict(LOOPBACK_SLOW),
            "port": port,
        }
    )


@contextmanager
def instance(tp: int) -> Iterator[list[Rank]]:
    """A prefill instance: ``tp`` self-driving rank processes."""
    ranks = [_rank(r, tp) for r in range(tp)]
    try:
        for r in ranks:
            r.ready()
        yield ranks
    finally:
        for r in ranks:
            r.close()


@pytest.fixture
def decode() -> Iterator[tuple[DecodeEndpoint, list[Release]]]:
    releases: list[Release] = []
    dec = DecodeEndpoint(
        get_backend("loopback"), NUM_PAGES, PAGE_BYTES, config=CONFIG, on_release=releases.append
    )
    dec.region.write(0, canary(NUM_PAGES * PAGE_BYTES))
    try:
        yield dec, releases
    finally:
        dec.close()


def _written(dec: DecodeEndpoint, room: int, pages: Sequence[int], tp: int) -> bool:
    """Every page holds each of the instance's ``tp`` ranks' shard of the room."""
    shard = PAGE_BYTES // tp
    return all(
        dec.region.read(p * PAGE_BYTES + r * shard, shard) == shard_bytes(room, r, i, shard)
        for i, p in enumerate(pages)
        for r in range(tp)
    )


def _succeeds(rx: Receiver) -> None:
    wait_for(lambda: rx.poll() is not KVPoll.TRANSFERRING, 30, f"room {rx.room}")
    assert rx.poll() is KVPoll.SUCCESS, rx.failure()


def test_one_decode_serves_two_prefill_instances_of_other_tp_sizes_named_per_request(
    decode: tuple[DecodeEndpoint, list[Release]],
) -> None:
    dec, releases = decode
    assert dec.ranks == frozenset() and dec.instances() == []
    with instance(2) as tp2, instance(1) as tp1:
        a, b = [r.address for r in tp2], [r.address for r in tp1]
        rx_a = dec.receiver(1, [0, 1, 2, 3], prefill=a)  # bootstraps the TP-2 instance
        rx_b = dec.receiver(2, [10, 11, 12], prefill=b)  # and the TP-1 one, into the same pool
        for rx in (rx_a, rx_b):
            _succeeds(rx)
        assert _written(dec, 1, [0, 1, 2, 3], 2) and _written(dec, 2, [10, 11, 12], 1)
        assert dec.instances() == [tuple(a), tuple(b)]
        rx_a.finish()
        rx_b.finish()
        # kept: the next requests reuse both, ranks= counts in the instance's own ranks
        rx_a2 = dec.receiver(3, [4, 5], prefill=a, ranks=frozenset({1}))
        rx_b2 = dec.receiver(4, [20, 21, 22, 23, 24, 25], prefill=b)
        wait_for(lambda: dec.region.read(24 * PAGE_BYTES, 64) != canary(64), 10, "instance b's first bytes")
        rx_b2.abort()  # one instance's room aborted while the other's completes
        _succeeds(rx_a2)
        shard = PAGE_BYTES // 2
        assert dec.region.read(4 * PAGE_BYTES + shard, shard) == shard_bytes(3, 1, 0, shard)
        assert dec.region.read(4 * PAGE_BYTES, shard) == canary(shard)  # rank 0 of a was not asked
        wait_for(lambda: bool(releases), 10, "room 4's release")
        assert [(r.room, r.proof) for r in releases] in ([(4, Proof.ACKS)], [(4, Proof.COMPLETED)])
        assert dec.instances() == [tuple(a), tuple(b)]
        assert dec.metrics.value("kvconn_dropped_messages_total", reason="other_session") == 0
        with pytest.raises(ValueError, match="unknown ranks"):
            dec.receiver(5, [30], prefill=b, ranks=frozenset({1}))
        with pytest.raises(ValueError, match="another prefill instance"):
            dec.receiver(5, [30], prefill=[b[0], a[1]])
    with pytest.raises(ValueError, match="no prefill instance"):
        dec.receiver(6, [31])


def test_a_room_id_is_unique_per_decode_endpoint_across_instances(
    decode: tuple[DecodeEndpoint, list[Release]],
) -> None:
    dec, _ = decode
    with instance(1) as one, instance(1) as other:
        rx = dec.receiver(7, [0, 1], prefill=[one[0].address])
        with pytest.raises(ValueError, match="still tracked"):
            dec.receiver(7, [2, 3], prefill=[other[0].address])
        _succeeds(rx)


def test_an_instance_that_does_not_answer_is_refused_and_tried_again_later() -> None:
    config = Config(bootstrap_timeout_s=0.5, resend_interval_s=0.05)
    dec = DecodeEndpoint(get_backend("loopback"), NUM_PAGES, PAGE_BYTES, config=config)
    try:
        silent = f"tcp://127.0.0.1:{free_port()}"
        with pytest.raises(BootstrapError, match="0 of 1 prefill ranks answered"):
            dec.receiver(1, [0], prefill=[silent])
        assert dec.instances() == [] and dec.tracker.state(1) is None
        with instance(1) as one:
            rx = dec.receiver(1, [0], prefill=[one[0].address])
            _succeeds(rx)
    finally:
        dec.close()


def test_a_restarted_instance_is_rebootstrapped_and_serves_new_rooms(
    decode: tuple[DecodeEndpoint, list[Release]],
) -> None:
    dec, _ = decode
    port = free_port()
    first = _rank(0, 1, port)
    restarted: Rank | None = None
    try:
        address = [first.ready()]
        with instance(2) as tp2:
            a = [r.address for r in tp2]
            rx = dec.receiver(1, [0, 1], prefill=address)
            _succeeds(rx)
            rx.finish()
            session = dec.session_of(0, prefill=address)
            first.signal(signal.SIGKILL)
            first.proc.wait(10)
            for _ in range(50):  # the port frees once the killed process is gone
                restarted = _rank(0, 1, port)
                try:
                    assert restarted.ready(10) == address[0]
                    break
                except (AssertionError, ValueError):
                    restarted.close()
                    restarted = None
            assert restarted is not None, "no rank came back at the address"
            # Idle for this decode, the rank is not heartbeaten, but its control
            # link was lost and came back: decode asks who answers there before
            # the next room goes to it (issue 40, finding 3; before, that room
            # went to the old session, the new process dropped it, and it failed).
            # (Asked before decode's link to the new process is up, with the old
            # process proven gone, the rank is down and the room refused at once.)
            wait_for(lambda: not dec.unavailable(address), 20, "the new process's link")
            first_after = dec.receiver(2, [2, 3, 4], prefill=address)
            _succeeds(first_after)
            assert _written(dec, 2, [2, 3, 4], 1)
            assert dec.session_of(0, prefill=address) != session
            assert dec.metrics.value("kvconn_rank_restarts_total") == 1
            rx = dec.receiver(4, [7, 8, 9], prefill=address)
            rx_a = dec.receiver(3, [5, 6], prefill=a)  # the other instance is untouched
            for r in (rx, rx_a):
                _succeeds(r)
            assert _written(dec, 4, [7, 8, 9], 1) and _written(dec, 3, [5, 6], 2)
            assert dec.instances() == [tuple(address), tuple(a)]
    finally:
        first.close()
        if restarted is not None:
            restarted.close()


def test_the_constructor_form_still_bootstraps_its_instance_eagerly() -> None:
    with instance(2) as tp2:
        addresses = [r.address for r in tp2]
        dec = DecodeEndpoint(get_backend("loopback"), NUM_PAGES, PAGE_BYTES, addresses, CONFIG)
        try:
            assert dec.ranks == {0, 1} and dec.instances() == [tuple(addresses)]
            dec.region.write(0, canary(NUM_PAGES * PAGE_BYTES))
            rx = dec.receiver(1, [3, 4])
            _succeeds(rx)
            assert _written(dec, 1, [3, 4], 2)
            # naming the same instance per request is the same instance
            rx = dec.receiver(2, [5], prefill=addresses)
            _succeeds(rx)
            assert dec.instances() == [tuple(addresses)]
        finally:
            dec.close()


def test_a_killed_rank_of_an_instance_named_per_request_frees_its_rooms_only_by_its_exit(
    decode: tuple[DecodeEndpoint, list[Release]],
) -> None:
    """The exit proof works per rank of every instance: a frozen rank's
    aborted room stays held (no ack can come), another instance's rooms go
    on, and the rank's proven exit releases it."""
    dec, releases = decode
    with instance(1) as one, instance(2) as two:
        pages = list(range(48))
        rx = dec.receiver(1, pages, prefill=[one[0].address])
        wait_for(lambda: dec.region.read(0, 64) != canary(64), 10, "the room's first bytes")
        one[0].signal(signal.SIGSTOP)
        assert rx.poll() is KVPoll.TRANSFERRING  # 48 slow pages: not done before the freeze
        rx.abort()
        assert rx.state() is HoldState.HELD
        other = dec.receiver(2, [50, 51], prefill=[r.address for r in two])
        _succeeds(other)
        assert _written(dec, 2, [50, 51], 2)
        assert not releases and rx.state() in (HoldState.HELD, HoldState.QUARANTINED)
        one[0].signal(signal.SIGKILL)
        wait_for(lambda: bool(releases), 30, "the release by the rank's exit")
        assert [(r.room, r.proof) for r in releases] == [(1, Proof.WRITER_EXIT)]


def test_connect_bootstraps_an_instance_ahead_of_its_first_receiver() -> None:
    config = Config(bootstrap_timeout_s=0.5, resend_interval_s=0.05)
    dec = DecodeEndpoint(get_backend("loopback"), NUM_PAGES, PAGE_BYTES, config=config)
    try:
        with pytest.raises(BootstrapError, match="0 of 1 prefill ranks answered"):
            dec.connect([f"tcp://127.0.0.1:{free_port()}"])
        assert dec.instances() == []
        with instance(1) as one:
            dec.connect([one[0].address])
            assert dec.instances() == [(one[0].address,)]
            session = dec.session_of(0, [one[0].address])
            dec.connect([one[0].address])  # known: kept, not bootstrapped again
            rx = dec.receiver(1, [0], prefill=[one[0].address])
            assert dec.session_of(0, [one[0].address]) == session
            _succeeds(rx)
    finally:
        dec.close()


def test_an_unreachable_instance_does_not_hold_up_the_bootstrap_of_another() -> None:
    config = Config(bootstrap_timeout_s=60.0, resend_interval_s=0.05)
    dec = DecodeEndpoint(get_backend("loopback"), NUM_PAGES, PAGE_BYTES, config=config)
    outcome: list[BaseException] = []

    def connect_silent() -> None:
        try:
            dec.connect([f"tcp://127.0.0.1:{free_port()}"])
        except BootstrapError as exc:
            outcome.append(exc)

    silent = threading.Thread(target=connect_silent, daemon=True)
    try:
        silent.start()
        wait_for(lambda: bool(dec._state.pending), timeout=10)
        with instance(1) as one:
            # Before: every bootstrap took one lock, so this waited the
            # silent instance's 60 s out.
            rx = dec.receiver(1, [0], prefill=[one[0].address])
            _succeeds(rx)
            assert silent.is_alive() and not outcome
    finally:
        dec.close()
