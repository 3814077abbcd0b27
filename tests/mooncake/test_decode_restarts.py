"""A prefill rank outlives its decodes: each restart is a new decode name,
and the core has no "decode gone" signal. The Mooncake writer's engines
(~3 threads and a port each) must not pile up with them (``max_engines``)."""

from __future__ import annotations

from kvconn.protocol.ledger import KVPoll
from kvconn.testing.cluster import Cluster
from kvconn.testing.libraries import require_library
from kvconn.testing.waiting import wait_for

require_library("mooncake", module_level=True)  # by the library: the plugin installs without it

ROOM_PAGES = 4


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _one_room(c: Cluster, room: int) -> None:
    rx, pages = c.open(room, ROOM_PAGES)
    wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 30, f"room {room}")
    assert c.correct(room, pages)
    c.finish(rx)


def test_decode_restarts_leave_the_ranks_engines_bounded() -> None:
    """max_engines=1: every restarted decode's channel takes the engine the
    previous decode's idle channel had, so the rank's threads stay flat.
    Before, each restart left an engine behind: ~3 threads more each time."""
    c = Cluster(
        backend="mooncake",
        num_ranks=1,
        num_pages=16,
        write_timeout_s=2.0,
        abort_timeout_s=12.0,  # longer than Mooncake's own 10 s write timeout
        backend_options={"max_engines": "1"},
    )
    try:
        pid = c.ranks[0].proc.pid
        _one_room(c, 1)
        before = _threads(pid)
        for restart in range(1, 4):
            c.dec.close()
            c.start_decode()
            _one_room(c, 1 + restart)
        # An opening thread ends just after its handshake: allow it to.
        wait_for(lambda: _threads(pid) <= before, 10, f"rank threads back to {before}")
        assert c.late_bytes() == 0
    finally:
        c.close()
