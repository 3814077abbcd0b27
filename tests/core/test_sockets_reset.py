"""kvconn.sockets.resetting_closed_sockets: a TCP connection closed inside
the block is reset (its queued bytes dropped, the peer sees ECONNRESET);
one left open is untouched. Real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvconn.sockets import resetting_closed_sockets


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=5)
        peer, _ = server.accept()
        peer.settimeout(5)
        yield client, peer
        client.close()
        peer.close()


def test_a_connection_closed_inside_is_reset(pair: tuple[socket.socket, socket.socket]) -> None:
    client, peer = pair
    client.sendall(b"sent before")
    assert peer.recv(64) == b"sent before"
    with resetting_closed_sockets():
        client.close()
    with pytest.raises(ConnectionResetError):
        peer.recv(64)  # a plain close would read b"" (end of stream) here


def test_a_plain_close_outside_ends_the_stream(pair: tuple[socket.socket, socket.socket]) -> None:
    """The contrast the test above rests on: without the block, the peer reads end-of-stream."""
    client, peer = pair
    client.close()
    assert peer.recv(64) == b""


def test_a_connection_left_open_still_works(pair: tuple[socket.socket, socket.socket]) -> None:
    client, peer = pair
    with resetting_closed_sockets():
        pass
    client.sendall(b"after")
    assert peer.recv(64) == b"after"
    client.close()
    assert peer.recv(64) == b""  # closed later, outside the block: a plain close
