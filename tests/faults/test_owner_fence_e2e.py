"""The owner-fence policy over a real transport (nixl, UCX tcp): a writer
frozen mid-room leaves decode's room quarantined; past the configured age
decode fences as the page owner, the pages come back by that proof, the
other rank re-bootstraps under the endpoint's new name and its next room
completes, and the frozen writer, resumed, lands nothing and serves again
after its own re-bootstrap. Same host (the policy is the subject here; the
fence across hosts is the conformance suite's
``test_owner_fence_stops_frozen_writer``)."""

from __future__ import annotations

import signal
import time

from kvconn.protocol.hold import Proof
from kvconn.protocol.ledger import KVPoll
from kvconn.testing.cluster import PROOFS, Cluster, total
from kvconn.testing.libraries import require_library
from kvconn.testing.waiting import wait_for

ROOM_PAGES = 32
AFTER_S = 0.5


def _up(c: Cluster, rank: int) -> bool:
    with c.dec._lock:
        return rank not in c.dec._state.down


def test_owner_fence_recovers_a_frozen_writers_pages_and_every_rank_re_bootstraps() -> None:
    require_library("nixl")
    c = Cluster(
        backend="nixl",
        page_bytes=256 << 10,
        num_pages=96,
        write_timeout_s=0.5,
        abort_timeout_s=1.5,
        chunk_pages=2,
        chunk_gap_s=0.05,  # the room stays in flight long enough to freeze its writer in it
        decode_config={"owner_fence_after_s": AFTER_S, "owner_fence_min_interval_s": 60.0},
    )
    try:
        first_name = c.dec._state.name
        rx, pages = c.open(21000, ROOM_PAGES, frozenset({0}))
        wait_for(lambda: c.landed_bytes(pages) > 0, 20, "first bytes of the room")
        c.ranks[0].signal(signal.SIGSTOP)
        assert rx.poll() is KVPoll.TRANSFERRING  # frozen mid-room
        t0 = time.monotonic()
        rx.abort()
        wait_for(lambda: c.released(21000) is not None, 15, "release by the owner fence")
        rel = c.released(21000)
        assert rel is not None and rel.proof is Proof.OWNER_FENCE, rel
        assert rel.quarantined_for >= AFTER_S - 0.05
        assert time.monotonic() - t0 >= c.config.abort_timeout_s + AFTER_S - 0.05  # never sooner
        assert c.metric("kvconn_quarantines_total") == 1
        assert c.metric("kvconn_owner_fences_total", outcome="ok") == 1
        assert c.metric("kvconn_owner_fences_total", outcome="failed") == 0
        assert c.metric("kvconn_owner_fence_pages_recovered_total") == ROOM_PAGES
        assert c.metric("kvconn_released_pages_total", proof="owner_fence") == ROOM_PAGES
        assert total(c.metric, "kvconn_releases_total", "proof", PROOFS) == 1
        assert c.metric("kvconn_pages_held") == 0 and rx.state() is None
        assert c.dec._state.name == f"{first_name}.f1"
        fence_s = getattr(c.dec.region, "last_owner_fence_s", 0.0)
        print(f"\nheld {rel.held_for:.2f} s, quarantined {rel.quarantined_for:.2f} s, fence {fence_s:.2f} s")
        # the other rank takes the new name and metadata, and its next room completes
        wait_for(lambda: _up(c, 1), 10, "rank 1 re-bootstrapped")
        rx1, pages1 = c.open(22000, ROOM_PAGES, frozenset({1}))
        wait_for(lambda: rx1.poll() is KVPoll.SUCCESS, 20, "rank 1's room after the fence")
        assert c.correct(22000, pages1, ranks=[1])
        c.finish(rx1)
        # the frozen writer resumes: whatever it had posted to the old agent lands nowhere
        c.ranks[0].signal(signal.SIGCONT)
        wait_for(lambda: _up(c, 0), 10, "rank 0 re-bootstrapped after it resumed")
        rx0, pages0 = c.open(23000, ROOM_PAGES, frozenset({0}))
        wait_for(lambda: rx0.poll() is KVPoll.SUCCESS, 20, "rank 0's room after it resumed")
        assert c.correct(23000, pages0, ranks=[0])
        c.finish(rx0)
        assert c.late_bytes() == 0 and c.late_pages(pages) == []
        assert c.metric("kvconn_pages_quarantined") == 0 and c.dec.tracker.state(21000) is None
    finally:
        c.close()
