"""Resetting the TCP connections a fence closes, for transport plugins.

A TCP connection closed the usual way (``close()``, as a library does when
its endpoint is destroyed) hands the bytes still queued in it to the
kernel, which goes on sending them after the process let go: when the link
is down (a partition), it sends them once the link is back, seconds later,
into pages decode may have handed out by then. Measured between two hosts
(network namespaces): 1.28 MB queued in a socket closed during a cut
landed 0.3 s after the heal, after the sending process had exited; the
same socket reset (``SO_LINGER`` 0) landed nothing. A writer fence that
tears down connections must therefore reset them: run the teardown inside
:func:`resetting_closed_sockets`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from collections.abc import Iterator

__all__ = ["resetting_closed_sockets", "socket_fds"]

_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST and drops what is queued


def socket_fds() -> dict[int, int]:
    """This process's socket descriptors: fd -> inode (none where it cannot list its descriptors)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd")
    except OSError:
        return found
    for name in names:
        fd = int(name)
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            if stat.S_ISSOCK(st.st_mode):
                found[fd] = st.st_ino
    return found


@contextlib.contextmanager
def resetting_closed_sockets() -> Iterator[None]:
    """Every TCP connection of this process that code inside the block
    closes is reset instead (RST; its queued bytes dropped, never sent).

    Each socket open on entry is held by a duplicate descriptor, so a close
    inside the block leaves it open; on exit those whose descriptor the
    block closed are reset and let go, the others are left as they were.
    Connections opened and closed inside the block are not covered: a
    fence's teardown opens none that carried data. A socket another thread
    closes meanwhile is reset too (its close loses what it had queued).
    """
    held: dict[int, tuple[int, int]] = {}  # duplicate -> (fd, inode)
    for fd, inode in socket_fds().items():
        with contextlib.suppress(OSError):
            dup = os.dup(fd)
            if os.fstat(dup).st_ino == inode:
                held[dup] = (fd, inode)
            else:  # the fd was closed and reused between the listing and the dup
                os.close(dup)
    try:
        yield
    finally:
        still = socket_fds()
        for dup, (fd, inode) in held.items():
            if still.get(fd) == inode:
                os.close(dup)
                continue
            try:
                sock = socket.socket(fileno=dup)  # owns dup from here on
            except OSError:
                os.close(dup)
                continue
            with contextlib.suppress(OSError):
                if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            sock.close()
