"""Failure detection at decode end to end, with real rank processes: what
``test_liveness.py`` shows on the state machine alone, here through
``DecodeEndpoint`` (its clock, ``/proc`` probes and listener). A killed rank
(its exit proven in ``/proc``), a stopped one (silent), one restarted at its
address, and a transfer deadline on an injected clock."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import attrs
import pytest

from kvconn.config import Config
from kvconn.errors import UnavailableError
from kvconn.protocol.hold import HoldState, Proof, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.cluster import Cluster, at_the_same_address, free_port
from kvconn.testing.null import NullBackend
from kvconn.testing.waiting import wait_for

WAIT_S = 10.0
#: Short liveness timers: a rank silent for 0.5 s is down.
FAST = dict(heartbeat_interval_s=0.05, peer_timeout_s=0.5)


def test_a_room_past_its_transfer_deadline_fails_and_is_held_until_proof() -> None:
    now = [0.0]
    short = Config(write_timeout_s=0.2, abort_timeout_s=30.0)
    rank = PrefillRank(NullBackend(), 0, 16 * 4096, attrs.evolve(short, acks_enabled=False))
    released: list[Release] = []
    decode = DecodeEndpoint(
        NullBackend(),
        16,
        4096,
        [rank.address],
        attrs.evolve(short, transfer_timeout_s=0.3),
        on_release=released.append,
        clock=lambda: now[0],
    )
    try:
        rx = decode.receiver(1, (0, 1, 2))  # the prefill engine never sends it
        decode._on_idle()
        assert rx.poll() is KVPoll.TRANSFERRING
        now[0] = 0.3
        decode._on_idle()
        assert rx.poll() is KVPoll.FAILED and "not complete within 0.3 s" in (rx.failure() or "")
        assert decode.metrics.value("kvconn_room_deadlines_total") == 1.0
        # the abort path: held (this rank never acks), never freed by the deadline
        assert rx.state() is HoldState.HELD and decode.held_pages() == 3 and not released
        assert decode.metrics.value("kvconn_aborts_sent_total") >= 1.0
        rx.abort()  # the engine's own abort after the deadline is harmless
        with pytest.raises(RuntimeError, match="aborted"):
            rx.finish()
    finally:
        decode.close()
        rank.close()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster(num_ranks=1, num_pages=32, page_bytes=16 << 10, abort_timeout_s=1.5, start_decode=False)
    c.config = attrs.evolve(c.config, **FAST)
    c.start_decode()
    yield c
    c.close()


def test_open_rooms_of_a_killed_rank_fail_and_new_ones_are_refused_at_once(cluster: Cluster) -> None:
    rx, _ = cluster.open(1, 4)
    cluster.ranks[0].signal(signal.SIGKILL)
    cluster.ranks[0].proc.wait(WAIT_S)
    wait_for(lambda: rx.poll() is KVPoll.FAILED, WAIT_S, "the open room's failure")
    assert "exited" in (rx.failure() or "")
    wait_for(lambda: cluster.released(1) is not None, WAIT_S, "the release by the exit proof")
    release = cluster.released(1)
    assert release is not None and release.proof is Proof.WRITER_EXIT
    assert cluster.metric("kvconn_ranks_down_total", cause="exited") == 1.0
    # a new room is refused at once: nothing is asked of a rank known down,
    # so none of its pages waits for a proof
    with pytest.raises(UnavailableError, match=r"rank 0 .* is down: its process .* exited"):
        cluster.open(2, 2)
    assert cluster.metric("kvconn_requests_refused_total", reason="rank_down") == 1.0
    assert cluster.decode.held_pages() == 0
    assert cluster.late_bytes() == 0


def test_open_rooms_of_a_silent_rank_fail_and_its_pages_wait_for_its_proof(cluster: Cluster) -> None:
    rx, _ = cluster.open(1, 4)
    rank = cluster.ranks[0]
    rank.signal(signal.SIGSTOP)  # alive, but answers nothing: a partition as decode sees it
    try:
        wait_for(lambda: rx.poll() is KVPoll.FAILED, WAIT_S, "the open room's failure")
        assert "no answer" in (rx.failure() or "")
        assert cluster.metric("kvconn_ranks_down_total", cause="silent") == 1.0
        wait_for(lambda: rx.state() is HoldState.QUARANTINED, WAIT_S, "quarantine at the abort deadline")
        assert cluster.released(1) is None  # a silent rank proves nothing
    finally:
        rank.signal(signal.SIGCONT)
    wait_for(lambda: cluster.released(1) is not None, WAIT_S, "the rank's proof after the heal")
    release = cluster.released(1)
    # The proof comes from the healed rank, out of quarantine. Which one depends
    # on where SIGSTOP caught it: before the request came, a plain late ack;
    # mid-write, the chunk outlived the rank's 0.5 s write deadline while it
    # was stopped, so the rank fenced its writer first and its ack says so.
    assert release is not None and release.proof in (Proof.LATE_ACKS, Proof.WRITER_FENCE)
    assert release.quarantined_for > 0
    # answering again, the rank is up: a new room completes
    wait_for(lambda: not cluster.dec._state.down, WAIT_S, "the rank up again")
    ok, pages = cluster.open(2, 2)
    wait_for(lambda: ok.poll() is KVPoll.SUCCESS, WAIT_S, "a room after the heal")
    assert cluster.correct(2, pages)
    assert cluster.late_bytes() == 0


def test_a_rank_restarted_at_its_address_is_rebootstrapped_and_owes_nothing_of_the_old_rooms() -> None:
    config = Config(port=free_port(), write_timeout_s=0.5, abort_timeout_s=30.0)
    rank = PrefillRank(NullBackend(), 0, 16 * 4096, config)
    released: list[Release] = []
    decode = DecodeEndpoint(
        NullBackend(), 16, 4096, [rank.address], Config(**FAST), on_release=released.append
    )
    restarted: PrefillRank | None = None
    try:
        old = decode.receiver(7, (3, 4))
        wait_for(lambda: rank.sender(7).poll() is KVPoll.WAITING_FOR_INPUT, WAIT_S, "room 7 at the rank")
        old_session = decode.session_of(0)
        rank.close()  # this process lives on (no exit proof), its address is free
        restarted = at_the_same_address(lambda: PrefillRank(NullBackend(), 0, 16 * 4096, config))
        wait_for(lambda: decode.session_of(0) != old_session, WAIT_S, "the re-bootstrap")
        assert decode.metrics.value("kvconn_rank_restarts_total") == 1.0
        # the old process's room: failed, held, and not released by the new process's ack
        wait_for(lambda: old.poll() is KVPoll.FAILED, WAIT_S, "the old room's failure")
        assert "restarted" in (old.failure() or "")
        wait_for(
            lambda: decode.metrics.value("kvconn_dropped_messages_total", reason="other_session") >= 1,
            WAIT_S,
            "the new process's ack for the old room",
        )
        assert not released and old.state() is HoldState.HELD
        # the new process takes new rooms
        new = decode.receiver(8, (5,))
        sender = restarted.sender(8)
        wait_for(lambda: sender.poll() is KVPoll.WAITING_FOR_INPUT, WAIT_S, "room 8 at the new process")
        sender.send([0], last=True)
        wait_for(lambda: new.poll() is KVPoll.SUCCESS, WAIT_S, "room 8's success")
        assert new.finish() == (5,)
    finally:
        decode.close()
        if restarted is not None:
            restarted.close()


def test_a_sender_whose_request_never_comes_fails_and_a_late_request_writes_nothing() -> None:
    now = [0.0]
    rank = PrefillRank(
        NullBackend(), 0, 16 * 4096, Config(room_bootstrap_timeout_s=5.0), clock=lambda: now[0]
    )
    decode = DecodeEndpoint(NullBackend(), 16, 4096, [rank.address], Config())
    try:
        tx = rank.sender(3)
        assert tx.poll() is KVPoll.BOOTSTRAPPING
        now[0] = 5.0  # the room's bootstrap deadline
        assert tx.poll() is KVPoll.FAILED
        assert rank.metrics.value("kvconn_room_bootstrap_timeouts_total") == 1.0
        rx = decode.receiver(3, (0, 1))  # decode's request, late
        wait_for(lambda: rx.poll() is KVPoll.FAILED, WAIT_S, "decode told at once")
        assert "gave up" in (rx.failure() or "")
        with pytest.raises(RuntimeError, match="room 3: this sender gave up"):
            tx.send([0, 1], last=True)
        assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 0.0
    finally:
        decode.close()
        rank.close()
