"""The fleet simulator (kvconn.bench.fleet) at a tiny size: it drives the
real ledgers and decode endpoints, and its counts add up."""

from __future__ import annotations

from kvconn.bench.fleet import Fleet, report, simulate


def test_a_tiny_fleet_counts_add_up() -> None:
    f = Fleet(decodes=3, instances=2, ranks=2, rate=40.0, seconds=1.0, seed=1)
    r = simulate(f)
    c = r["counts"]
    assert r["rooms"] > 50 and r["held_at_end"] == 0  # every abort proven by acks
    assert c["abort"] == c["ack"] > 0  # one ack per ABORT: acks come at once here
    assert c["request"] % f.ranks == 0 and c["request"] > 0
    # The rule before: every decode, every rank, once a second, Hello + HelloAck.
    assert c["heartbeat (every rank)"] == 2 * f.decodes * f.instances * f.ranks * 1
    # The endpoints' own: Hellos and their answers, only to silent ranks rooms were
    # asked of (here every rank is busy: its statuses are its heartbeat)
    assert c.get("heartbeat", 0) < c["heartbeat (every rank)"] and c.get("heartbeat", 0) % 2 == 0
    assert "rank down" not in c  # every rank answers: none is ever judged down
    assert "decodes x ranks" in report([r], f)


def test_aborts_before_their_request_leave_a_tombstone_at_every_rank() -> None:
    f = Fleet(decodes=2, instances=2, ranks=4, rate=30.0, abort_fraction=1.0, early_fraction=1.0, seconds=0.5)
    r = simulate(f)
    assert r["counts"].get("request", 0) == 0
    assert r["tombstones_at_end"] == r["rooms"] * f.ranks == r["counts"]["ack"]


def test_heartbeats_grow_with_the_work_not_with_the_fleet() -> None:
    # a slow load: ranks a decode uses seldom are silent when its next room comes
    small = simulate(Fleet(decodes=4, instances=8, ranks=4, rate=5.0, seconds=6.0, seed=2))
    large = simulate(Fleet(decodes=4, instances=80, ranks=4, rate=5.0, seconds=6.0, seed=2))  # 10x
    for r in (small, large):
        # rooms shorter than the interval: a rank of a room is Hello'd at most once for it
        assert 0 < r["per_s"]["heartbeat"] <= 2 * r["per_s"]["request"]
        assert "rank down" not in r["counts"]
    assert large["per_s"]["heartbeat (every rank)"] == 10 * small["per_s"]["heartbeat (every rank)"]
    assert large["per_s"]["heartbeat"] < 0.05 * large["per_s"]["heartbeat (every rank)"]
