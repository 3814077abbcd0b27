"""runtime/sockets.py on real sockets of this process (127.0.0.1)."""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import termios
from collections.abc import Iterator

import pytest

from kvconn.protocol import wire
from kvconn.protocol.messages import AbortAck, TcpConnection
from kvconn.runtime.sockets import TcpTable, dead_peer_ends, fenced_connections, own_connections, undrained
from kvconn.testing.waiting import wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


@pytest.fixture
def server() -> Iterator[socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    yield srv
    srv.close()


def _writer_view(client: socket.socket) -> TcpConnection:
    (lh, lp), (rh, rp) = client.getsockname(), client.getpeername()
    return TcpConnection(lh, lp, rh, rp)


def test_a_closed_connection_drains_only_when_the_owner_closes_its_end(server: socket.socket) -> None:
    client = socket.create_connection(server.getsockname())
    conn = _writer_view(client)
    assert conn in own_connections()
    assert undrained([conn]) == [conn]  # not accepted yet: waits on our listener
    accepted, _ = server.accept()
    client.sendall(b"x" * 1000)
    client.close()  # the writer's fence
    assert conn not in own_connections()
    assert undrained([conn]) == [conn]  # FIN received, 1000 bytes unread: CLOSE_WAIT
    assert accepted.recv(4096)
    assert undrained([conn]) == [conn]  # read, but the owner has not closed its end
    accepted.close()
    assert undrained([conn]) == []


def test_connections_of_other_hosts_or_gone_are_not_waited_for() -> None:
    gone = TcpConnection("127.0.0.1", 1, "127.0.0.1", 2)
    elsewhere = TcpConnection("10.255.0.1", 40000, "10.255.0.2", 5000)
    assert undrained([gone, elsewhere]) == []
    assert undrained([]) == []


def test_an_ack_carries_its_closed_connections_on_the_wire() -> None:
    ack = AbortAck(7, 1, 3, True, "decode-a", 9, (TcpConnection("127.0.0.1", 5, "::1", 6),))
    assert wire.decode(wire.encode(ack, b"k"), b"k") == ack
    assert wire.decode(wire.encode(AbortAck(7, 1, 3, False))).closed == ()


def test_an_end_whose_peer_closed_is_waited_for_until_closed(server: socket.socket) -> None:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    ours = _writer_view(accepted)
    assert ours not in dead_peer_ends()  # the peer end is held (by us, here)
    client.sendall(b"late")
    client.close()  # the peer's process lets go (closed, or died)
    assert ours in dead_peer_ends()  # CLOSE_WAIT with 4 bytes unread
    assert accepted.recv(16) == b"late"
    assert ours in dead_peer_ends()  # read, but still open
    accepted.close()
    assert ours not in dead_peer_ends()


def test_a_connection_closed_before_the_fence_with_bytes_unread_is_named(server: socket.socket) -> None:
    """A transport that closes a connection once its bytes are queued (the
    owner frozen, reading nothing): the fence closes nothing of it, yet its
    bytes can still land, so the fence names it and decode waits for it."""
    client = socket.create_connection(server.getsockname())
    conn = _writer_view(client)
    accepted, _ = server.accept()
    client.sendall(b"x" * 1000)
    client.close()  # before the fence: an orphan in FIN_WAIT2, 1000 bytes in the owner's queue
    assert conn not in own_connections()
    # Named only with a connection to the same peer address held at the fence
    assert conn not in fenced_connections(own_connections())
    still = socket.create_connection(server.getsockname())
    held = own_connections()
    named = fenced_connections(held)
    assert conn in named
    assert undrained(named) == [conn]
    assert accepted.recv(4096)
    accepted.close()  # the owner read to the end and closed: the orphan goes to TIME_WAIT
    assert conn not in fenced_connections(held)
    assert undrained([conn]) == []
    still.close()
    server.accept()[0].close()


def _reset(client: socket.socket) -> None:
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()


def test_a_reset_connection_drains_only_once_its_unread_bytes_are_read(server: socket.socket) -> None:
    """A fence resets its connections (SO_LINGER 0): the RST drops what the
    writer had queued, but what reached the owner stays readable after its
    end left /proc's table, and would still land."""
    client = socket.create_connection(server.getsockname())
    conn = _writer_view(client)
    accepted, _ = server.accept()
    client.sendall(b"x" * 50_000)
    wait_for(lambda: _unread(accepted) == 50_000, 5, "the bytes reach the owner")
    _reset(client)
    wait_for(lambda: conn not in {r.conn for r in TcpTable().rows} and _reversed_gone(conn), 5, "the RST")
    assert undrained([conn]) == [conn]
    assert TcpConnection("127.0.0.1", conn.remote_port, "", 0) in dead_peer_ends()
    read = 0
    with pytest.raises(ConnectionResetError):
        while chunk := accepted.recv(65536):
            read += len(chunk)
    assert read == 50_000  # every byte was still there to land
    assert TcpConnection("127.0.0.1", conn.remote_port, "", 0) not in dead_peer_ends()  # nothing unread
    assert undrained([conn]) == [conn]  # read, but the transport may still be copying it
    accepted.close()
    assert undrained([conn]) == []


def _unread(sock: socket.socket) -> int:
    (n,) = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))
    return int(n)


def _reversed_gone(conn: TcpConnection) -> bool:
    reverse = TcpConnection(conn.remote_host, conn.remote_port, conn.local_host, conn.local_port)
    return reverse not in {r.conn for r in TcpTable().rows}
