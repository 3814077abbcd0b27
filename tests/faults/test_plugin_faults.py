"""A plugin (an observer registered with PrefillRank(observers=[...])) that
raises from each hook: the core fails the room safe (Failed, poisoned,
fenced or held until the writer's proven exit), keeps its workers and
listener, and decode hands back no page without proof."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from kvconn.protocol.ledger import KVPoll
from kvconn.testing.cluster import PROOFS, Cluster, total
from kvconn.testing.waiting import wait_for

ROOM_PAGES = 16
BAD, GOOD, AFTER = 8000, 8001, 8002

CASES: dict[str, list[dict[str, Any]]] = {
    "on_dequeue": [{"hook": "on_dequeue", "rooms": [BAD]}],
    "on_skip": [{"hook": "on_skip", "rooms": [BAD]}],
    "on_post": [{"hook": "on_post", "rooms": [BAD]}],
    "on_done_barrier": [{"hook": "on_done_barrier", "rooms": [BAD]}],
    "on_abort_notification": [{"hook": "on_abort_notification", "rooms": [BAD]}],
    # a fence that raises leaves the poisoned room unproven: quarantine, then exit
    "on_fence": [{"hook": "on_post", "rooms": [BAD]}, {"hook": "on_fence"}],
}


@pytest.mark.parametrize("hook", list(CASES))
def test_plugin_raises(hook: str) -> None:
    c = Cluster(write_timeout_s=0.3, abort_timeout_s=1.0, observers=[CASES[hook]])
    try:
        rx, pages = c.open(BAD, ROOM_PAGES)
        if hook in ("on_skip", "on_abort_notification"):
            wait_for(lambda: c.landed_bytes(pages) > 0, 10, "first bytes")
            rx.abort()  # the queued chunks are skipped, the ABORT reaches the hook
        else:
            wait_for(lambda: rx.poll() is KVPoll.FAILED, 10, "room failed by the core")
            assert rx.failure() is not None and "raised" in (rx.failure() or "")
            rx.abort()
        if hook == "on_fence":
            wait_for(lambda: c.metric("kvconn_pages_quarantined") == ROOM_PAGES, 5, "quarantine")
            assert c.released(BAD) is None
            assert c.ranks[0].value("kvconn_fences_total", result="failed") >= 1
            assert c.ranks[0].value("kvconn_poisoned_rooms") == 1
            c.ranks[0].signal(signal.SIGKILL)  # the only proof left: the writer's exit
        wait_for(lambda: c.released(BAD) is not None, 10, "release of the faulty room")
        rel = c.released(BAD)
        assert rel is not None
        if hook not in ("on_skip", "on_abort_notification"):
            assert "raised" in (rx.failure() or "")  # the receiver keeps the reason past the release
        expected = {
            "on_fence": {"writer_exit"},
            "on_abort_notification": {"writer_fence"},
        }.get(hook, {"writer_fence"})
        if hook == "on_skip":
            expected = {"writer_fence", "acks"}  # nothing may have been skipped if it all landed first
        assert rel.proof.value in expected, rel
        if hook != "on_fence":
            m = c.ranks[0].metrics()
            label = "on_dequeue/on_skip" if hook in ("on_dequeue", "on_skip") else hook  # the core's label
            errors = m.get(("kvconn_plugin_errors_total", frozenset({("hook", label)})), 0.0)
            # on_skip may raise only after the ack (chunks queued behind it): still safe
            assert errors >= 1 or hook == "on_skip"
            # later chunks of the room may raise (and be fenced) after its ack: the
            # gauge settles at 0 once the driver stops feeding the room
            wait_for(lambda: c.ranks[0].value("kvconn_poisoned_rooms") == 0, 10, "no poisoned room left")
            # workers and listener alive: the next room is written and correct
            rx2, pages2 = c.open(GOOD, ROOM_PAGES)
            wait_for(lambda: rx2.poll() is KVPoll.SUCCESS, 30, "good room")  # 10 s missed once at load 36
            assert c.correct(GOOD, pages2)
            c.finish(rx2)
        else:
            assert rel.quarantined_for > 0
            rx2, pages2 = c.open(AFTER, ROOM_PAGES, frozenset({1}))
            wait_for(lambda: rx2.poll() is KVPoll.SUCCESS, 10, "room on the surviving rank")
            assert c.correct(AFTER, pages2, ranks=[1])
            c.finish(rx2)
        assert total(c.metric, "kvconn_releases_total", "proof", PROOFS) == 1
        assert c.metric("kvconn_pages_held") == 0
        assert c.late_bytes() == 0
    finally:
        c.close()
