"""Decode's two socket-level proofs, on real sockets of this process (issue 25).

* A writer's exit proves nothing while decode's end of a connection whose
  other end is gone still holds bytes the writer sent before it died: the
  kernel goes on delivering them. Only loopback-free transports have such
  sockets, so until now only the tcpdemo plugin's conformance run caught an
  exit counted without that drain.
* A fenced ack naming the connections the fence closed counts only once
  decode's ends of them drained (the ack hold-back).

Both are driven by hand, with decode's clock frozen (its idle loop never
checks exits on its own), and assert the consequence: the pages stay held
while a byte can still arrive, and are released, with the proof named, after.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from collections.abc import Iterator

import attrs
import pytest

from kvconn.config import Config
from kvconn.protocol.hold import HoldState, Proof, Release
from kvconn.protocol.messages import AbortAck, TcpConnection
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.runtime.procs import pid_namespace
from kvconn.testing.cluster import free_port
from kvconn.testing.null import NullBackend
from kvconn.testing.waiting import wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

ROOM = 7
WAIT_S = 30.0  # a bound for a loaded CI machine, not a timing: each wait ends on its event


@attrs.define
class Setup:
    decode: DecodeEndpoint
    rank: PrefillRank
    released: list[Release]


@pytest.fixture
def setup() -> Iterator[Setup]:
    # The rank sends no acks: only the proof under test can release.
    rank = PrefillRank(NullBackend(), 0, 16 * 4096, Config(port=free_port(), acks_enabled=False))
    released: list[Release] = []
    decode = DecodeEndpoint(
        NullBackend(), 16, 4096, [rank.address], Config(), on_release=released.append, clock=lambda: 0.0
    )
    try:
        yield Setup(decode, rank, released)
    finally:
        decode.close()
        rank.close()


@pytest.fixture
def dead_peer() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connection whose sending end is gone (as if its process died) with
    bytes still unread at our end: (our end, the listener)."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    ours, _ = server.accept()
    client.sendall(b"written before the writer died")
    client.close()
    try:
        yield ours, server
    finally:
        ours.close()
        server.close()


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _mark_gone(decode: DecodeEndpoint, rank: int, pid: int) -> None:
    """Rank ``rank``'s process is gone (an exited pid in our own pid
    namespace): the rank's identity, and the one each open request kept of
    the process it asked to write its room."""
    with decode._lock:
        gone = attrs.evolve(decode._state.writers[rank], pid_namespace=pid_namespace(), pid=pid)
        decode._state.writers[rank] = gone
        for request in decode._state.requests.values():
            if rank in request.writers:
                request.writers[rank] = gone
        # The writers held rooms owe proofs, counted as rooms are held: the
        # identities just swapped in count instead of the ones they replaced.
        owing: dict[object, int] = {}
        for request in decode._state._held.values():
            for writer in request.writers.values():
                owing[writer] = owing.get(writer, 0) + 1
        decode._state._owing = owing  # type: ignore[assignment]


def _check_exits(decode: DecodeEndpoint) -> None:
    """One pass of decode's exit check, as its idle loop runs it."""
    decode._check_exits()


def _released_after_check(decode: DecodeEndpoint, released: list[Release], count: int = 1) -> bool:
    _check_exits(decode)
    return len(released) >= count


def test_a_writers_exit_waits_for_its_connections_to_drain(
    setup: Setup, dead_peer: tuple[socket.socket, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    decode = setup.decode
    rx = decode.receiver(ROOM, (3, 4))
    pid = _exited_pid()
    _mark_gone(decode, 0, pid)
    rx.abort()
    with caplog.at_level(logging.WARNING, logger="kvconn.runtime.decode"):
        _check_exits(decode)
        _check_exits(decode)
    assert rx.state() is HoldState.HELD and setup.released == []  # its bytes may still arrive
    ours, _ = dead_peer
    # the wait is said once, naming the end it waits for
    [said] = [r.getMessage() for r in caplog.records if "wait for" in r.getMessage()]
    port = ours.getsockname()[1]
    assert f"writer exit proven (pids {pid})" in said and f"127.0.0.1:{port} from" in said, said
    assert ours.recv(64)
    ours.close()
    wait_for(lambda: _released_after_check(decode, setup.released), WAIT_S, "the exit proof")
    [release] = setup.released
    assert release.proof is Proof.WRITER_EXIT and release.pages == (3, 4)


def test_a_live_writer_is_not_proven_gone(setup: Setup) -> None:
    rx = setup.decode.receiver(ROOM, (3, 4))
    rx.abort()
    _check_exits(setup.decode)
    assert rx.state() is HoldState.HELD and setup.released == []


def test_a_fenced_ack_counts_only_once_the_closed_connections_drained(setup: Setup) -> None:
    decode = setup.decode
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    ours, _ = server.accept()
    (lh, lp), (rh, rp) = client.getsockname(), client.getpeername()
    closed = TcpConnection(lh, lp, rh, rp)  # as the writer's fence saw it
    client.sendall(b"posted before the fence")
    client.close()  # the fence closed it; the bytes are still on their way
    try:
        rx = decode.receiver(ROOM, (5,))
        rx.abort()
        with decode._lock:
            generation = max(decode.tracker._rooms[ROOM].generations)
        ack = AbortAck(ROOM, 0, generation, True, decode.name, decode.session_of(0), (closed,))
        decode._on_message(ack)
        decode._on_idle()
        assert rx.state() is HoldState.HELD and setup.released == []
        assert ours.recv(64)
        ours.close()  # drained and closed at our end
        wait_for(lambda: (decode._on_idle(), bool(setup.released))[1], WAIT_S, "the drained ack")
        [release] = setup.released
        assert release.proof is Proof.WRITER_FENCE
    finally:
        ours.close()
        server.close()


def test_every_gone_writer_releases_its_rooms_held_or_quarantined() -> None:
    """Two writers gone in one check, one of whose rooms is quarantined
    already: both rooms come back (none lost between two ranks' releases,
    none left out for being past its deadline)."""
    now = [0.0]
    ranks = [
        PrefillRank(NullBackend(), r, 16 * 4096, Config(port=free_port(), acks_enabled=False)) for r in (0, 1)
    ]
    released: list[Release] = []
    decode = DecodeEndpoint(
        NullBackend(),
        16,
        4096,
        [r.address for r in ranks],
        Config(abort_timeout_s=30.0),
        on_release=released.append,
        clock=lambda: now[0],
    )
    try:
        first = decode.receiver(1, (1,), frozenset({0}))
        first.abort()
        now[0] = 100.0  # past its deadline
        decode.step(lambda state, now: (None, state.carry(state.tracker.tick(now))))
        assert first.state() is HoldState.QUARANTINED
        second = decode.receiver(2, (2,), frozenset({1}))
        second.abort()
        gone = _exited_pid()
        for rank_id in (0, 1):
            _mark_gone(decode, rank_id, gone)
        wait_for(lambda: _released_after_check(decode, released, 2), WAIT_S, "both exit proofs")
        assert sorted((r.room, r.proof) for r in released) == [(1, Proof.WRITER_EXIT), (2, Proof.WRITER_EXIT)]
    finally:
        decode.close()
        for rank in ranks:
            rank.close()


def _fenced_ack(decode: DecodeEndpoint, room: int, closed: TcpConnection) -> AbortAck:
    with decode._lock:
        generation = max(decode.tracker._rooms[room].generations)
    return AbortAck(room, 0, generation, True, decode.name, decode.session_of(0), (closed,))


def _undrained_connection() -> tuple[socket.socket, socket.socket, TcpConnection]:
    """(our end, listener, the writer's view) of a connection its writer
    closed with bytes unread at our end."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    ours, _ = server.accept()
    (lh, lp), (rh, rp) = client.getsockname(), client.getpeername()
    client.sendall(b"posted before the fence")
    client.close()
    return ours, server, TcpConnection(lh, lp, rh, rp)


def test_held_back_acks_of_several_rooms_all_count_once_drained(setup: Setup) -> None:
    decode = setup.decode
    ours, server, closed = _undrained_connection()
    try:
        receivers = [decode.receiver(room, (room,)) for room in (1, 2)]
        for rx in receivers:
            rx.abort()
        for room in (1, 2):
            decode._on_message(_fenced_ack(decode, room, closed))
        decode._on_idle()
        assert all(rx.state() is HoldState.HELD for rx in receivers)
        ours.recv(64)
        ours.close()
        wait_for(lambda: (decode._on_idle(), len(setup.released) == 2)[1], WAIT_S, "both drained acks")
        assert sorted(r.room for r in setup.released) == [1, 2]
    finally:
        ours.close()
        server.close()


def test_a_full_drain_backlog_drops_new_acks_and_counts_them(setup: Setup) -> None:
    decode = setup.decode
    decode._state.MAX_DRAINING = 1
    ours, server, closed = _undrained_connection()
    try:
        for room in (1, 2):
            decode.receiver(room, (room,)).abort()
        first, second = (_fenced_ack(decode, room, closed) for room in (1, 2))
        decode._on_message(first)
        decode._on_message(first)  # the same ack again: already held back, not a new one
        assert decode.metrics.value("kvconn_dropped_messages_total", reason="drain_backlog_full") == 0
        decode._on_message(second)
        assert decode.metrics.value("kvconn_dropped_messages_total", reason="drain_backlog_full") == 1
        ours.recv(64)
        ours.close()
        wait_for(lambda: (decode._on_idle(), bool(setup.released))[1], WAIT_S, "the held-back ack")
        assert [r.room for r in setup.released] == [1]  # the dropped one proves nothing
        assert decode.tracker.state(2) is HoldState.HELD
    finally:
        ours.close()
        server.close()


def test_an_exit_proves_only_the_rooms_asked_of_that_process(setup: Setup) -> None:
    """A process restarted at the rank's address: room 1 was asked of the
    earlier process, now gone; room 2 of the live one. The earlier one's exit
    releases room 1 only; room 2 stays held (its writer can still write)."""
    decode = setup.decode
    first = decode.receiver(1, (1,))
    with decode._lock:
        live = decode._state.writers[0]
        decode._state.requests[1].writers[0] = attrs.evolve(
            live, pid_namespace=pid_namespace(), pid=_exited_pid()
        )
    second = decode.receiver(2, (2,))
    first.abort()
    second.abort()
    wait_for(
        lambda: _released_after_check(decode, setup.released), WAIT_S, "the earlier process's exit proof"
    )
    _check_exits(decode)
    assert [(r.room, r.proof) for r in setup.released] == [(1, Proof.WRITER_EXIT)]
    assert second.state() is HoldState.HELD
