"""The control plane's own loops: the listener (its input handling is fuzzed
in tests/fuzz/test_wire_fuzz.py) and the outbox."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pytest
import zmq

from kvconn.config import Config
from kvconn.protocol import wire
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import Abort, RoomOutcome, RoomStatus
from kvconn.runtime.control import Listener, Outbox
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.cluster import free_port
from kvconn.testing.null import NullBackend, NullRegion


def test_listener_sleeps_through_sub_millisecond_waits() -> None:
    """An idle handler that asks to run again in 0.3 ms gets a 1 ms sleep
    (zmq's poll takes whole ms), not a busy loop of zero-timeout polls."""
    calls = 0

    def idle() -> float:
        nonlocal calls
        calls += 1
        return 0.0003

    listener = Listener("idle", "127.0.0.1", 0, lambda _m: None, lambda _r: None, idle=idle)
    listener.start()
    try:
        time.sleep(0.2)
    finally:
        listener.close()
    # each pass sleeps >= 1 ms: at most ~200 in 0.2 s (a spinning loop made
    # tens of thousands)
    assert 0 < calls <= 400, calls


def test_outbox_drops_and_counts_instead_of_raising_or_blocking() -> None:
    """Its callers hold the endpoint's lock: a bad address or a peer that
    stopped reading must neither raise nor block there."""
    dropped: list[str] = []
    outbox = Outbox(on_drop=dropped.append, queue_limit=8)
    status = RoomStatus(1, 0, RoomOutcome.SUCCESS, "")
    try:
        assert not outbox.reachable("garbage") and dropped == []
        assert outbox.send("not an endpoint", status) is False
        assert dropped == ["unsendable_address"]
        # Nobody listens there: frames queue up to the limit, then drop.
        silent = f"tcp://127.0.0.1:{free_port()}"
        sent = [outbox.send(silent, status) for _ in range(64)]
        assert sent[0] and not sent[-1]
        assert 8 <= sent.count(True) < 64
        assert dropped.count("send_queue_full") == sent.count(False)
    finally:
        outbox.close()


def test_an_abort_with_a_bad_reply_to_is_dropped_and_the_worker_lives() -> None:
    backend = NullBackend()
    rank = PrefillRank(backend, 0, 4 * 4096, Config())
    decode = DecodeEndpoint(backend, 4, 4096, [rank.address], Config())
    try:
        rx = decode.receiver(1, (0,))
        sender = rank.sender(1)
        deadline = time.monotonic() + 10
        while sender.poll() < KVPoll.WAITING_FOR_INPUT:
            assert time.monotonic() < deadline, "request never reached the rank"
            time.sleep(0.001)
        rank._listener.deliver(wire.encode(Abort(1, 7, decode.name, "garbage")))
        assert rank.metrics.value("kvconn_dropped_messages_total", reason="bad_reply_to") == 1
        assert sender.poll() is KVPoll.WAITING_FOR_INPUT  # the forged abort failed nothing
        sender.send([0], last=True)
        while rx.poll() is not KVPoll.SUCCESS:
            assert time.monotonic() < deadline, "the worker did not write the room"
            time.sleep(0.001)
    finally:
        decode.close()
        rank.close()


def test_a_request_decode_could_not_send_fails_the_room_at_once() -> None:
    """Nothing re-sends a request and an open room has no deadline: a dropped
    one must not leave the room Transferring for good."""
    backend = NullBackend()
    rank = PrefillRank(backend, 0, 4 * 4096, Config())
    decode = DecodeEndpoint(backend, 4, 4096, [rank.address], Config())
    try:
        decode._outbox.send = lambda address, message: False  # type: ignore[method-assign]
        rx = decode.receiver(1, (0,))
        assert rx.poll() is KVPoll.FAILED
        assert "dropped" in (rx.failure() or "")
    finally:
        decode.close()
        rank.close()


class _ClosingRegion(NullRegion):
    closed = False

    def close(self) -> None:
        self.closed = True


class _ClosingRegionBackend(NullBackend):
    def open_region(self, nbytes: int, options: Mapping[str, str]) -> _ClosingRegion:
        return _ClosingRegion(nbytes)


@pytest.mark.parametrize("held", [True, False], ids=["pages-held", "none-held"])
def test_decode_frees_its_region_at_close_only_with_no_page_held(held: bool) -> None:
    backend = _ClosingRegionBackend()
    rank = PrefillRank(backend, 0, 4 * 4096, Config())
    decode = DecodeEndpoint(backend, 4, 4096, [rank.address], Config())
    region = decode.region
    assert isinstance(region, _ClosingRegion)
    rx = decode.receiver(1, (0, 1))
    rank.close()  # no ack will come
    if held:
        rx.abort()
        assert decode.held_pages() == 2
    decode.close()
    assert region.closed is not held


def test_a_frame_of_another_wire_version_is_counted_and_logged_with_both_versions(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An older peer's frames are dropped unread: counted as bad_version, and
    logged once per version with both versions, so the side that dropped
    them says why its peer got no answer."""
    ours = wire.VERSION
    monkeypatch.setattr(wire, "VERSION", ours - 1)
    older = wire.encode(Abort(1, 2, "tcp://127.0.0.1:1", "x"))
    monkeypatch.setattr(wire, "VERSION", ours)
    drops: list[str] = []
    handled: list[object] = []
    listener = Listener("v", "127.0.0.1", 0, handled.append, lambda r: drops.append(str(r)))
    listener.start()
    try:
        with caplog.at_level("WARNING", logger="kvconn.runtime.control"):
            for _ in range(3):
                listener.deliver(older)
            listener.deliver(wire.encode(Abort(1, 2, "tcp://127.0.0.1:1", "x")))
    finally:
        listener.close()
    assert drops == ["bad_version"] * 3 and len(handled) == 1  # the listener goes on for other peers
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        f"kvconn dropping frames of wire version {ours - 1}: this side speaks wire version {ours}"
    ]


def test_closing_a_watching_outbox_as_its_peers_go_leaves_zmq_working() -> None:
    """A link's peer goes just as decode's outbox closes (a test's teardown,
    a rank killed at shutdown). libzmq's I/O thread writes the link's
    DISCONNECTED event to its monitor with a blocking send: with the
    monitor's reader closed before the probe, that send never returned and
    every socket of the process stopped moving (CI: each later bootstrap
    saw 0 of N ranks answer; 4 of 4 runs of this loop wedged)."""
    ctx = zmq.Context.instance()
    for _ in range(50):
        peer = ctx.socket(zmq.PULL)
        port = peer.bind_to_random_port("tcp://127.0.0.1")
        outbox = Outbox(watch=True, heartbeat=(0.1, 0.3))
        assert outbox.reachable(f"tcp://127.0.0.1:{port}")
        time.sleep(0.01)  # the probe's handshake
        peer.close(linger=0)
        outbox.close()
    # A fresh pair of sockets in the same context still talks.
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"x")
        assert pull.poll(5000), "the ZMQ I/O thread is stuck"
    finally:
        push.close(linger=0)
        pull.close(linger=0)
