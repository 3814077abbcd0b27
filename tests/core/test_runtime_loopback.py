"""One decode endpoint (this process) and two prefill rank processes over the
loopback transport: transfers, aborts mid-transfer, and a live listener fed
with bad frames."""

from __future__ import annotations

import random

import pytest
import zmq

from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.protocol import wire
from kvconn.protocol.hold import HoldState, Proof
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import AbortAck, RoomOutcome, RoomStatus
from kvconn.runtime.decode import BootstrapError, DecodeEndpoint, Receiver
from kvconn.testing.cluster import Cluster
from kvconn.testing.waiting import wait_for

PAGES = 8


@pytest.fixture
def cluster() -> Cluster:
    c = Cluster(num_ranks=2, num_pages=512, page_bytes=32 << 10, write_timeout_s=1.0, abort_timeout_s=5.0)
    yield c
    c.close()


def test_rooms_land_byte_for_byte_and_aborts_release_only_with_acks(cluster: Cluster) -> None:
    rng = random.Random(7)
    rooms = {}
    for room in range(1, 41):
        rooms[room] = cluster.open(room, PAGES)
        if rng.random() < 0.3:  # abort at a random point of the transfer
            rx, pages = rooms[room]
            point = rng.randrange(PAGES * cluster.page_bytes)

            def reached(rx: Receiver = rx, pages: list[int] = pages, point: int = point) -> bool:
                return cluster.landed_bytes(pages) >= point or rx.poll() is KVPoll.SUCCESS

            wait_for(reached, 10, "the abort point")
            rx.abort()
    wait_for(
        lambda: all(rx.poll() in (KVPoll.SUCCESS, KVPoll.FAILED) for rx, _ in rooms.values()), 20, "rooms"
    )
    aborted = [r for r, (rx, _) in rooms.items() if rx.poll() is KVPoll.FAILED]
    wait_for(lambda: all(cluster.released(r) for r in aborted), 10, "releases")
    for room, (rx, pages) in rooms.items():
        if room in aborted:
            release = cluster.released(room)
            assert release is not None and release.proof in (Proof.ACKS, Proof.COMPLETED)
        else:
            assert cluster.correct(room, pages), f"room {room} corrupted"
            cluster.finish(rx)
    assert aborted, "no room was aborted"
    # every released page was refilled with canary on release: a late write shows
    wait_for(lambda: cluster.dec.held_pages() == 0, 5, "nothing held")
    assert cluster.late_bytes() == 0
    assert all(rooms[r][0].poll() is KVPoll.FAILED for r in aborted)  # still, after the release
    assert not cluster.dec._state.requests  # released and finished rooms are forgotten
    assert cluster.metric("kvconn_quarantines_total") == 0
    assert cluster.metric("kvconn_acks_received_total") >= len(aborted)
    print(f"\n  {len(rooms)} rooms, {len(aborted)} aborted mid-transfer, 0 late bytes")


def test_abort_mid_transfer_holds_until_both_ranks_acked(cluster: Cluster) -> None:
    rx, pages = cluster.open(77, 64)
    wait_for(lambda: cluster.landed_bytes(pages) > 0, 10, "first bytes")
    rx.abort()
    assert rx.state() in (HoldState.HELD, None)
    wait_for(lambda: cluster.released(77) is not None, 5, "release")
    assert cluster.released(77).proof in (Proof.ACKS, Proof.COMPLETED)  # type: ignore[union-attr]
    assert cluster.late_bytes() == 0


def test_listener_survives_and_counts_every_bad_frame(cluster: Cluster) -> None:
    rx, pages = cluster.open(5, 64)
    wait_for(lambda: cluster.landed_bytes(pages) > 0, 10, "first bytes")
    rx.abort()
    room_gen = max(cluster.dec.tracker._rooms[5].generations) if cluster.dec.tracker.state(5) else 1
    me, session = cluster.dec.name, cluster.dec.session_of(0)
    good = wire.encode(AbortAck(5, 0, room_gen, False, me, session))
    frames = {
        "short": b"K",
        "bad_magic": b"XX" + good[2:],
        "bad_version": good[:2] + bytes([9]) + good[3:],
        "unknown_tag": good[:3] + bytes([200]) + good[4:],
        "bad_body": good[:-3],  # truncated
        "trailing_bytes": good + b"\x00",
    }
    late_duplicate = [
        wire.encode(AbortAck(5, 0, room_gen + 100, False, me, session)),  # a generation never issued
        wire.encode(AbortAck(999, 0, room_gen, False, me, session)),  # a room not held
        wire.encode(AbortAck(5, 0, room_gen, False, "decode-elsewhere", session)),  # for another decode
        wire.encode(AbortAck(5, 0, room_gen, False, me, session ^ 1)),  # another process at rank 0's address
        wire.encode(RoomStatus(5, 0, RoomOutcome.SUCCESS, "", me, session ^ 1)),
        wire.encode(RoomStatus(999, 0, RoomOutcome.FAILED, "stranger", me, session)),
    ]
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(cluster.dec.address)
    for frame in [*frames.values(), *late_duplicate]:
        sock.send(frame)
    sock.close()
    # One socket delivers in order: once the last frame (the stranger's
    # status) is counted, every frame before it was handled.
    wait_for(
        lambda: cluster.metric("kvconn_dropped_messages_total", reason="stranger_status") == 1, 5, "drops"
    )
    for reason in frames:
        assert cluster.metric("kvconn_dropped_messages_total", reason=reason) == 1, reason
    assert cluster.metric("kvconn_dropped_messages_total", reason="not_held") >= 1
    assert cluster.metric("kvconn_dropped_messages_total", reason="other_decode") == 1
    assert cluster.metric("kvconn_dropped_messages_total", reason="other_session") == 2
    # the real acks still get through afterwards and release room 5 only
    wait_for(lambda: cluster.released(5) is not None, 5, "release of room 5")
    assert [r.room for r in cluster.releases] == [5]
    assert cluster.late_bytes() == 0


def test_bootstrap_refuses_a_writer_deadline_not_shorter_than_decodes(cluster: Cluster) -> None:
    # The ranks were started with write_timeout_s=1.0; a decode with a 0.8 s
    # abort deadline would quarantine before a live writer gives up.
    with pytest.raises(ValueError, match="shorter"):
        Config(write_timeout_s=1.0, abort_timeout_s=0.8)
    config = Config(write_timeout_s=0.5, abort_timeout_s=0.8, bootstrap_timeout_s=5)
    with pytest.raises(BootstrapError, match="shorter than decode's abort_timeout_s"):
        DecodeEndpoint(get_backend("loopback"), 8, 32 << 10, [r.address for r in cluster.ranks], config)
