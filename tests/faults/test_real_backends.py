"""The same faults over the real transports, where their plugins load:
abort mid-transfer (acks), and a rank SIGKILLed mid-transfer (proven exit).
Skipped with the reason when a plugin or its library does not import here."""

from __future__ import annotations

import signal
import time

import pytest

from kvconn.protocol.ledger import KVPoll
from kvconn.testing.cluster import PROOFS, Cluster, total
from kvconn.testing.libraries import require_library
from kvconn.testing.waiting import wait_for

ROOM_PAGES = 32
# mooncake may take 10 s to fail a write: decode's deadline must be longer
TIMEOUTS = {"nixl": (0.5, 2.0), "mooncake": (0.5, 12.0)}


def _cluster(backend: str) -> Cluster:
    require_library(backend)
    wt, at = TIMEOUTS[backend]
    return Cluster(
        backend=backend,
        page_bytes=256 << 10,
        num_pages=128,
        write_timeout_s=wt,
        abort_timeout_s=at,
        chunk_pages=2,
    )


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_abort_and_sigkill_real_transport(backend: str) -> None:
    c = _cluster(backend)
    try:
        rooms = {11000 + i: c.open(11000 + i, ROOM_PAGES) for i in range(3)}
        wait_for(lambda: c.landed_bytes(rooms[11000][1]) > 0, 20, "first bytes")
        for rx, _ in rooms.values():
            rx.abort()
        wait_for(lambda: all(c.released(r) for r in rooms), 10, "releases by acks")
        assert {c.released(r).proof.value for r in rooms} <= {"acks", "completed", "writer_fence"}  # type: ignore[union-attr]
        # a rank killed mid-transfer
        more = {12000 + i: c.open(12000 + i, ROOM_PAGES) for i in range(3)}
        wait_for(lambda: c.landed_bytes(more[12000][1]) > 0, 20, "first bytes")
        c.ranks[0].signal(signal.SIGKILL)
        t0 = time.monotonic()
        for rx, _ in more.values():
            rx.abort()
        wait_for(lambda: all(c.released(r) for r in more), 10, "releases by proven exit")
        assert time.monotonic() - t0 < c.config.abort_timeout_s
        assert {c.released(r).proof.value for r in more} <= {"writer_exit", "completed", "acks"}  # type: ignore[union-attr]
        assert total(c.metric, "kvconn_releases_total", "proof", PROOFS) == 6
        assert c.metric("kvconn_quarantines_total") == 0
        rx, pages = c.open(13000, ROOM_PAGES, frozenset({1}))
        wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 20, "room on the survivor")
        assert c.correct(13000, pages, ranks=[1])
        c.finish(rx)
        time.sleep(0.2)
        assert c.late_bytes() == 0
    finally:
        c.close()
