"""The fleet simulator (kvconn.bench.fleet) at a tiny size: it drives the
real ledgers and trackers, and its counts add up."""

from __future__ import annotations

from kvconn.bench.fleet import Fleet, report, simulate


def test_a_tiny_fleet_counts_add_up() -> None:
    f = Fleet(decodes=3, instances=2, ranks=2, rate=40.0, seconds=1.0, seed=1)
    r = simulate(f)
    c = r["counts"]
    assert r["rooms"] > 50 and r["held_at_end"] == 0  # every abort proven by acks
    assert c["abort"] == c["ack"] > 0  # one ack per ABORT: acks come at once here
    assert c["request"] % f.ranks == 0 and c["request"] > 0
    # Today's heartbeats: every decode, every rank, once a second, Hello + HelloAck.
    assert c["heartbeat"] == 2 * f.decodes * f.instances * f.ranks * 1
    assert 0 <= c["heartbeat (proposed)"] <= c["heartbeat"]
    assert "decodes x ranks" in report([r], f)


def test_aborts_before_their_request_leave_a_tombstone_at_every_rank() -> None:
    f = Fleet(decodes=2, instances=2, ranks=4, rate=30.0, abort_fraction=1.0, early_fraction=1.0, seconds=0.5)
    r = simulate(f)
    assert r["counts"].get("request", 0) == 0
    assert r["tombstones_at_end"] == r["rooms"] * f.ranks == r["counts"]["ack"]
