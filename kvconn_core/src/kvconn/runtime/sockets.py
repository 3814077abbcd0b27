"""Which TCP connections a fence closed, and whether decode's ends drained.

A writer's fence (destroying its NIXL agent or Mooncake engine) closes its
TCP connections, but the bytes it had already sent stay on their way: in the
writer's send queue, in flight, in decode's receive queue, or in a connection
decode's transport has not even accepted yet. If decode was frozen (SIGSTOP,
a swap or GC stall) or cut off, its transport writes them into the pages when
it runs again. TCP delivers a connection's FIN after all of its data, so once
decode's end of every connection the fence closed has seen the FIN and been
closed by decode's transport (which reads up to end-of-stream first), nothing
sent before the fence can land. A fence that resets its connections sends an
RST instead: that drops the writer's queue but not what reached decode, and
takes decode's end out of ``/proc``'s table, so decode's own descriptors are
asked too. Read from ``/proc`` (Linux); elsewhere no connection is named and
a fence is taken as it is.
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import logging
import os
import socket
import struct
import termios
from collections.abc import Iterable

import attrs

from kvconn.protocol.messages import TcpConnection
from kvconn.sockets import socket_fds

log = logging.getLogger(__name__)

# /proc/net/tcp state codes
_LISTEN = 0x0A
#: Decode's end can still receive or still be read: ESTABLISHED, SYN_SENT,
#: SYN_RECV, CLOSE_WAIT (FIN received, but the transport has not read to the
#: end and closed). Every other state means decode's transport closed it.
_UNDRAINED = frozenset({0x01, 0x02, 0x03, 0x08})
#: Ends that can still take bytes in: ESTABLISHED, SYN_RECV, CLOSE_WAIT.
_RECEIVING = frozenset({0x01, 0x03, 0x08})
#: Closed ends whose bytes may not be read yet at the other end: FIN_WAIT1
#: (bytes or the FIN not acknowledged yet), FIN_WAIT2 (all acknowledged, so
#: waiting in the peer's receive queue until its transport reads them).
_SENT_UNREAD = frozenset({0x04, 0x05})


@attrs.frozen(slots=True)
class _Row:
    conn: TcpConnection
    state: int
    inode: int


def _host(hex_ip: str) -> str:
    if len(hex_ip) == 8:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_ip, 16)))
    raw = b"".join(struct.pack("<I", int(hex_ip[i : i + 8], 16)) for i in range(0, 32, 8))
    ip = ipaddress.IPv6Address(raw)
    return str(ip.ipv4_mapped or ip)


def _endpoint(field: str) -> tuple[str, int]:
    hex_ip, hex_port = field.split(":")
    return _host(hex_ip), int(hex_port, 16)


def _rows() -> list[_Row]:
    """This network namespace's TCP sockets (the calling thread's: a thread
    may run in another network than the process's first thread)."""
    rows = []
    for table in ("/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            (lh, lp), (rh, rp) = _endpoint(fields[1]), _endpoint(fields[2])
            rows.append(_Row(TcpConnection(lh, lp, rh, rp), int(fields[3], 16), int(fields[9])))
    return rows


def _plain(host: str) -> str:
    """An address as the table spells it (an IPv4-mapped IPv6 one as IPv4)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _unread_bytes(fd: int, inode: int) -> tuple[tuple[str, int], int] | None:
    """The local endpoint of this process's TCP socket ``fd`` (``inode``) and
    the bytes it holds unread; None for another kind of socket, or one closed
    meanwhile. A duplicate is asked, so the owner's descriptor is never touched."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != inode:  # closed, and the number reused
            return None
        sock = socket.socket(fileno=dup)  # owns the duplicate from here on
        dup = -1
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            (unread,) = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))
            host, port = sock.getsockname()[:2]
            return (_plain(host), port), unread
    except OSError:
        return None
    finally:
        if dup >= 0:
            os.close(dup)


def _reversed(conn: TcpConnection) -> TcpConnection:
    """The same connection seen from its other end."""
    return TcpConnection(conn.remote_host, conn.remote_port, conn.local_host, conn.local_port)


def _is_local(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TcpTable:
    """One reading of this network namespace's TCP sockets, seen from this
    process: read once, then asked as often as needed."""

    def __init__(self) -> None:
        self.rows = _rows()
        self._fds = socket_fds()
        self._inodes = set(self._fds.values())
        self._listening = {
            r.conn.local_port for r in self.rows if r.state == _LISTEN and r.inode in self._inodes
        }

    def _ours(self, row: _Row) -> bool:
        """Held by this process, or waiting unaccepted on one of its listening
        sockets (the transport reads it once it accepts it)."""
        return row.inode in self._inodes or (row.inode == 0 and row.conn.local_port in self._listening)

    def own_connections(self) -> frozenset[TcpConnection]:
        """The TCP connections this process holds open (listening sockets aside)."""
        return frozenset(r.conn for r in self.rows if r.inode in self._inodes and r.state != _LISTEN)

    def orphans_unread(self) -> frozenset[TcpConnection]:
        """Connections of this network namespace that no process holds any
        more and whose bytes the other end may not have read yet. A transport
        that closes a connection once its bytes are queued (before the peer
        read them) leaves them there, out of any process's sockets: a fence
        after that close does not close them, yet they can still land."""
        return frozenset(r.conn for r in self.rows if r.inode == 0 and r.state in _SENT_UNREAD)

    @functools.cached_property
    def reset_ends(self) -> dict[tuple[str, int], int]:
        """This process's TCP sockets that a reset took out of the table,
        still open: local endpoint (host, port) -> the most bytes one of them
        holds unread. A fence resets its connections
        (:func:`kvconn.sockets.resetting_closed_sockets`): the RST drops what
        the writer still had queued, but what already reached this end stays
        readable, and the transport writes it into the pages when it reads
        it; the end, closed by the RST, is no longer listed in ``/proc``, so
        only its descriptor tells."""
        listed = {r.inode for r in self.rows}
        found: dict[tuple[str, int], int] = {}
        for fd, inode in self._fds.items():
            if inode in listed:
                continue
            end = _unread_bytes(fd, inode)
            if end is not None:
                found[end[0]] = max(found.get(end[0], 0), end[1])
        return found

    def undrained(self, closed: Iterable[TcpConnection]) -> list[TcpConnection]:
        """Of the connections a writer's fence ``closed`` (the writer's view),
        those whose end in this process may still deliver bytes to it: open,
        or reset and not closed yet (a reset end is known by its address
        alone: every connection to that address is listed). A connection
        whose other end is not here (another host, another process, or gone)
        is not listed."""
        wanted = {_reversed(c): c for c in closed}
        if not wanted:
            return []
        found = [
            wanted[r.conn] for r in self.rows if r.conn in wanted and r.state in _UNDRAINED and self._ours(r)
        ]
        # Until the transport closes it: it may still be copying what it read.
        reset = self.reset_ends
        if reset:
            listed = set(found)
            found += [
                c
                for c in wanted.values()
                if c not in listed and (_plain(c.remote_host), c.remote_port) in reset
            ]
        return found

    def dead_peer_ends(self) -> list[TcpConnection]:
        """This process's ends, still open, of same-host connections whose
        other end no process holds any more (it closed, or its process died):
        what that process sent before it went may still be on its way here.

        The writer-exit proof waits for these: a killed writer's kernel goes
        on delivering its send queue. Only peers on this host are judged
        (loopback, or the connection's own address at both ends); a peer
        elsewhere is invisible here and not waited for. An end a reset took
        out of the table with bytes unread (:attr:`reset_ends`) is listed
        too, as its local address alone, whoever its peer was.
        """
        owner = {r.conn: r.inode for r in self.rows}
        ends = [
            r.conn
            for r in self.rows
            if r.state in _RECEIVING
            and self._ours(r)
            and (_is_local(r.conn.remote_host) or r.conn.remote_host == r.conn.local_host)
            and not owner.get(_reversed(r.conn))
        ]
        # A killed process's kernel resets a connection it had bytes unread
        # in: this end leaves the table, its unread bytes stay (its peer
        # cannot be named any more, so any such end counts).
        unread = sorted(end for end, n in self.reset_ends.items() if n > 0)
        return ends + [TcpConnection(host, port, "", 0) for host, port in unread]


def own_connections() -> frozenset[TcpConnection]:
    """The TCP connections this process holds open (listening sockets aside)."""
    return TcpTable().own_connections()


def fenced_connections(held_before: frozenset[TcpConnection]) -> frozenset[TcpConnection]:
    """What a writer's fence names for decode to wait on, read after the
    fence: the connections this process held before it (``held_before``,
    from :func:`own_connections`) and holds no more, and the closed ones
    still carrying bytes (:meth:`TcpTable.orphans_unread`) to an address
    one of those went to (a transport's peer: an unrelated connection in
    this network, whose other end decode may keep half-closed for long,
    would hold the pages with it)."""
    table = TcpTable()
    closed = held_before - table.own_connections()
    peers = {(c.remote_host, c.remote_port) for c in held_before}
    unread = frozenset(c for c in table.orphans_unread() if (c.remote_host, c.remote_port) in peers)
    log.info(
        "fence: %d connections closed by it, %d closed before it with bytes still unread",
        len(closed),
        len(unread),
    )
    return closed | unread


def undrained(closed: Iterable[TcpConnection]) -> list[TcpConnection]:
    """:meth:`TcpTable.undrained` on a fresh reading."""
    return TcpTable().undrained(closed)


def dead_peer_ends() -> list[TcpConnection]:
    """:meth:`TcpTable.dead_peer_ends` on a fresh reading."""
    return TcpTable().dead_peer_ends()
