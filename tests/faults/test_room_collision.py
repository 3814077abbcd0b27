"""Two decode endpoints name the same room id at one prefill rank while it is
being written (a restarted decode counting its rooms from 1 again, or two
decodes with colliding ids).

Room ids are global at a rank: the first decode's request owns the room. The
second one's request is refused at once (a FAILED status naming the reason),
its pages are never written, and the engine is not asked to send the room
again: a duplicate send used to queue chunks behind the room's last one,
which landed in the first decode's pages after it had taken them back (this
test caught 256 KiB of such late bytes). An ABORT from either decode still
fails the room for both; the rank tells the other decode at once, and each
gets its pages back by acks.
"""

from __future__ import annotations

import time

import pytest

from kvconn.protocol.hold import Proof, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.testing.cluster import CANARY, Cluster, wait_for
from kvconn.testing.patterns import canary

ROOM, PAGES = 8100, 16


@pytest.mark.parametrize("when", ["after_first_completes", "while_first_writes"])
def test_a_second_decode_naming_a_live_room_gets_no_byte(when: str) -> None:
    c = Cluster(write_timeout_s=0.3, abort_timeout_s=1.5)
    second: DecodeEndpoint | None = None
    try:
        releases: list[Release] = []
        second = DecodeEndpoint(
            c.backend, 64, c.page_bytes, [r.address for r in c.ranks], c.config, on_release=releases.append
        )
        second.region.write(0, canary(64 * c.page_bytes))

        def second_dirty() -> int:
            assert second is not None
            data = second.region.read(0, PAGES * c.page_bytes)
            return len(data) - data.count(CANARY)

        rx1, pages1 = c.open(ROOM, PAGES)
        wait_for(lambda: c.landed_bytes(pages1) > 0, 10, "the first decode's first bytes")
        rx2 = second.receiver(ROOM, list(range(PAGES)))
        wait_for(lambda: rx2.poll() is KVPoll.FAILED, 5, "the second decode's refusal")
        assert rx2.failure() is not None and "in use by another decode" in rx2.failure()  # type: ignore[operator]
        if when == "after_first_completes":
            wait_for(lambda: rx1.poll() is KVPoll.SUCCESS, 10, "the first decode's room")
            assert c.correct(ROOM, pages1)
            c.finish(rx1)
            rx2.abort()
            wait_for(lambda: bool(releases), 5, "the second decode's release")
        else:
            rx2.abort()  # while the first decode's room is in flight: it fails the room for both
            wait_for(lambda: bool(releases), 5, "the second decode's release")
            wait_for(lambda: rx1.poll() is KVPoll.FAILED, 5, "the first decode told")
            assert "aborted by another decode" in (rx1.failure() or "")
            rx1.abort()
            wait_for(lambda: c.released(ROOM) is not None, 5, "the first decode's release")
            assert c.released(ROOM).proof is Proof.ACKS  # type: ignore[union-attr]
        assert [(r.room, r.proof) for r in releases] == [(ROOM, Proof.ACKS)]
        time.sleep(0.3)  # a late write would land now
        assert second_dirty() == 0
        assert c.late_bytes() == 0
        refused = sum(r.value("kvconn_dropped_messages_total", reason="room_in_use") for r in c.ranks)
        assert refused == c.num_ranks
    finally:
        if second is not None:
            second.close()
        c.close()
