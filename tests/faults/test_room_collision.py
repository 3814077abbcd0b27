"""Two decode endpoints name the same room id at one prefill rank (prefill
TP smaller than decode TP: every decode rank asks the one prefill rank for
the room; or two decodes whose ids collide).

A room is keyed per decode at a rank: (decode, room). Each decode's request
is its own room there, with its own pages, counts, acks and status. The
rank writes the room into both (one sender per request, as the engine
learns of each through ``on_request``); an ABORT from one decode fails only
its room, which is acked once that decode's own writes are over, while the
other decode's room completes byte for byte. Before, the second decode's
request was refused ("room id in use by another decode at this rank").
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvconn.protocol.hold import Proof, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.testing.cluster import Cluster
from kvconn.testing.patterns import CANARY, canary, shard_bytes
from kvconn.testing.waiting import wait_for

ROOM, PAGES = 8100, 16


def _correct(dec: DecodeEndpoint, c: Cluster, room: int, pages: Sequence[int]) -> bool:
    return all(
        dec.region.read(p * c.page_bytes + r * c.shard, c.shard) == shard_bytes(room, r, i, c.shard)
        for i, p in enumerate(pages)
        for r in range(c.num_ranks)
    )


@pytest.mark.parametrize("abort", ["none", "second", "first"])
def test_one_room_id_served_to_two_decodes(abort: str) -> None:
    # The write deadline is generous: the rank's one NIC serves both decodes'
    # chunks in turn, and CI runs this beside other heavy tests (0.3 s once ran
    # out on an idle 2-core runner and the first decode's room failed).
    c = Cluster(num_ranks=1, write_timeout_s=3.0, abort_timeout_s=6.0, chunk_pages=2)
    second: DecodeEndpoint | None = None
    try:
        releases: list[Release] = []
        second = DecodeEndpoint(
            c.backend, 64, c.page_bytes, [r.address for r in c.ranks], c.config, on_release=releases.append
        )
        second.region.write(0, canary(64 * c.page_bytes))
        pages2 = list(range(8, 8 + PAGES))  # not the first decode's page numbers

        def dirty2() -> int:
            assert second is not None
            data = b"".join(second.region.read(p * c.page_bytes, c.page_bytes) for p in pages2)
            return len(data) - data.count(CANARY)

        rx1, pages1 = c.open(ROOM, PAGES)
        rx2 = second.receiver(ROOM, pages2)
        if abort == "second":
            wait_for(lambda: dirty2() > 0, 10, "the second decode's first bytes")
            rx2.abort()
            wait_for(lambda: bool(releases), 10, "the second decode's release")
            assert releases[0].proof in (Proof.ACKS, Proof.COMPLETED)
            # handed back: canary again, and no write of the room may land there now
            second.region.write(0, canary(64 * c.page_bytes))
        elif abort == "first":
            wait_for(lambda: c.landed_bytes(pages1) > 0, 10, "the first decode's first bytes")
            rx1.abort()
            wait_for(lambda: c.released(ROOM) is not None, 10, "the first decode's release")
            assert c.released(ROOM).proof in (Proof.ACKS, Proof.COMPLETED)  # type: ignore[union-attr]
        survivors = [(rx2, second, pages2)] if abort != "second" else []
        if abort != "first":
            survivors.append((rx1, c.dec, pages1))
        for rx, dec, pages in survivors:
            wait_for(lambda rx=rx: rx.poll() is not KVPoll.TRANSFERRING, 20, "the room's outcome")  # type: ignore[misc]
            assert rx.poll() is KVPoll.SUCCESS, rx.failure()
            assert _correct(dec, c, ROOM, pages)
            assert rx.finish() == tuple(pages)
        if abort == "second":
            # the first decode's last chunk landed after every chunk queued
            # for the second (one worker, in order): none of those wrote
            assert dirty2() == 0
        assert c.late_bytes() == 0
        assert sum(r.value("kvconn_dropped_messages_total", reason="room_in_use") for r in c.ranks) == 0
    finally:
        if second is not None:
            second.close()
        c.close()
