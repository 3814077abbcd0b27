"""The owner-fence policy over a real transport (nixl, UCX tcp): a writer
frozen mid-room leaves decode's room quarantined; past the configured age
decode fences as the page owner, the pages come back by that proof, the
other rank re-bootstraps under the endpoint's new name and its next room
completes, and the frozen writer, resumed, lands nothing and serves again
after its own re-bootstrap. Same host (the policy is the subject here; the
fence across hosts is the conformance suite's
``test_owner_fence_stops_frozen_writer``)."""

from __future__ import annotations

import importlib
import signal
import time

import pytest

from kvconn.errors import UnavailableError
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


def test_a_fence_that_could_not_make_a_new_agent_refuses_rooms_and_gets_one_back_on_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 40: decode's interface down when the owner fence fires: the old
    agent goes, UCX refuses the new one ("No such device"). That fence still
    proves the pages free; until decode has an endpoint again, new rooms are
    refused at once with the reason (nothing asked, nothing pinned); decode
    retries on its own, with no room held, and once UCX can make the agent
    every rank re-bootstraps and rooms complete."""
    require_library("nixl")
    nixl_backend = importlib.import_module("kvconn_nixl.backend")  # the module (``backend`` is its object)

    c = Cluster(
        backend="nixl",
        page_bytes=256 << 10,
        num_pages=96,
        write_timeout_s=0.5,
        abort_timeout_s=1.5,
        chunk_pages=2,
        chunk_gap_s=0.05,
        decode_config={"owner_fence_after_s": AFTER_S, "owner_fence_min_interval_s": 60.0},
    )
    real = nixl_backend.make_agent
    try:
        rx, pages = c.open(31000, ROOM_PAGES, frozenset({0}))
        wait_for(lambda: c.landed_bytes(pages) > 0, 20, "first bytes of the room")
        c.ranks[0].signal(signal.SIGSTOP)

        def no_device(*args: object, **kwargs: object) -> object:
            raise RuntimeError("NIXL_ERR_BACKEND: No such device")

        monkeypatch.setattr(nixl_backend, "make_agent", no_device)  # decode's agents only: it runs here
        rx.abort()
        wait_for(lambda: c.released(31000) is not None, 15, "release by the owner fence")
        rel = c.released(31000)
        assert rel is not None and rel.proof is Proof.OWNER_FENCE
        assert c.metric("kvconn_owner_fences_total", outcome="no_endpoint") >= 1
        assert c.metric("kvconn_transport_endpoint_up") == 0
        with pytest.raises(UnavailableError, match="No such device") as refused:
            c.open(32000, ROOM_PAGES, frozenset({1}))
        assert refused.value.cause == "endpoint_down" and c.dec.held_pages() == 0
        assert c.metric("kvconn_requests_refused_total", reason="endpoint_down") == 1
        monkeypatch.setattr(nixl_backend, "make_agent", real)  # the interface is back
        wait_for(lambda: c.metric("kvconn_transport_endpoint_up") == 1, 30, "the endpoint made again")
        assert c.metric("kvconn_owner_fences_total", outcome="ok") == 1
        assert c.metric("kvconn_quarantines_total") == 1  # no room held since: retried all the same
        wait_for(lambda: _up(c, 1), 10, "rank 1 re-bootstrapped")
        rx1, pages1 = c.open(33000, ROOM_PAGES, frozenset({1}))
        wait_for(lambda: rx1.poll() is KVPoll.SUCCESS, 20, "rank 1's room after the endpoint came back")
        assert c.correct(33000, pages1, ranks=[1])
        c.finish(rx1)
        c.ranks[0].signal(signal.SIGCONT)
        wait_for(lambda: _up(c, 0), 10, "rank 0 re-bootstrapped after it resumed")
        assert c.late_bytes() == 0 and c.late_pages(pages) == []
    finally:
        monkeypatch.setattr(nixl_backend, "make_agent", real)
        c.close()
