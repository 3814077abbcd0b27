"""One trace per room across processes: decode (this process) and two
prefill rank processes each record spans with the OpenTelemetry SDK's
in-memory exporter; the ranks hand theirs back over their JSON-lines
channel. Every room's spans, on both sides, share decode's trace id; an
aborted room's trace holds the abort, each rank's ack and the release with
its proof, and a fenced room's the rank's fence and fenced ack."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from kvconn.protocol.ledger import KVPoll
from kvconn.testing.cluster import Cluster
from kvconn.testing.tracing import finished_spans, memory_exporter
from kvconn.testing.waiting import wait_for

DONE, ABORTED, FENCED = 7001, 7002, 7003
PAGES = 32


def events(span: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e["attributes"] for e in span["events"] if e["name"] == name]


def test_one_trace_per_room_across_decode_and_rank_processes() -> None:
    memory_exporter().clear()
    # rank 0 raises in on_post for FENCED: the room is poisoned, fenced, acked
    c = Cluster(tracing=True, observers=[[{"hook": "on_post", "rooms": [FENCED]}]])
    try:
        done, _ = c.open(DONE, PAGES)
        wait_for(lambda: done.poll() is KVPoll.SUCCESS, 20, "room written")
        c.finish(done)

        aborted, pages = c.open(ABORTED, PAGES)
        wait_for(lambda: c.landed_bytes(pages) > 0, 20, "first bytes")
        aborted.abort()
        fenced, _ = c.open(FENCED, PAGES)
        wait_for(lambda: fenced.poll() is KVPoll.FAILED, 20, "room failed by the raising plugin")
        fenced.abort()
        wait_for(lambda: c.released(ABORTED) is not None and c.released(FENCED) is not None, 20, "releases")
        # the rank's ack span ends in the rank process once it is sent: wait for both ranks'
        wait_for(
            lambda: all(any(s["name"] == "kvconn.rank.ack" for s in r.spans()) for r in c.ranks),
            10,
            "ack spans",
        )
        ranks = [r.spans() for r in c.ranks]
    finally:
        c.close()
    proofs = {room: rel.proof.value for room in (ABORTED, FENCED) if (rel := c.released(room)) is not None}

    decode_spans = [s for s in finished_spans() if s["name"] == "kvconn.room"]
    roots = {s["attributes"]["kvconn.room"]: s for s in decode_spans}
    assert set(roots) >= {DONE, ABORTED, FENCED}
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rank_spans in ranks:
        for s in rank_spans:
            by_trace[s["trace_id"]].append(s)
    for r, rank_spans in enumerate(ranks):
        assert rank_spans and {s["pid"] for s in rank_spans} == {c.ranks[r].proc.pid} != {os.getpid()}

    for room, root in roots.items():
        if room not in (DONE, ABORTED, FENCED):
            continue
        assert root["parent_id"] is None and root["pid"] == os.getpid()
        theirs = by_trace[root["trace_id"]]
        rooms = [s for s in theirs if s["name"] == "kvconn.rank.room"]
        # each rank's room span is a child of decode's, in decode's trace
        assert sorted(s["attributes"]["kvconn.rank"] for s in rooms) == [0, 1], (room, theirs)
        assert all(s["parent_id"] == root["span_id"] for s in theirs)
        assert all(s["attributes"]["kvconn.room"] == room for s in theirs)

    done_root = roots[DONE]
    assert done_root["attributes"]["kvconn.outcome"] == "finished"
    done_ranks = [s for s in by_trace[done_root["trace_id"]] if s["name"] == "kvconn.rank.room"]
    assert [s["attributes"]["kvconn.chunks"] for s in done_ranks] == [PAGES // 4] * 2  # chunks: a count
    assert {s["attributes"]["kvconn.outcome"] for s in done_ranks} == {"success"}

    for room in (ABORTED, FENCED):
        root = roots[room]
        assert events(root, "kvconn.abort") == [{}]
        assert {e["kvconn.rank"] for e in events(root, "kvconn.abort_sent")} == {0, 1}
        # the release and its proof, on the span and as its event
        (release,) = events(root, "kvconn.release")
        assert release["kvconn.proof"] == root["attributes"]["kvconn.proof"] == proofs[room]
        acks = events(root, "kvconn.ack")
        assert {a["kvconn.rank"] for a in acks if a["kvconn.result"] == "taken"} == {0, 1}
        rank_acks = [s for s in by_trace[root["trace_id"]] if s["name"] == "kvconn.rank.ack"]
        assert {s["attributes"]["kvconn.rank"] for s in rank_acks} == {0, 1}
    assert proofs[ABORTED] == "acks"

    assert proofs[FENCED] == "writer_fence"
    fenced_trace = by_trace[roots[FENCED]["trace_id"]]
    fences = [s for s in fenced_trace if s["name"] == "kvconn.rank.fence"]
    assert fences and {s["attributes"]["kvconn.rank"] for s in fences} == {0}
    assert {s["attributes"]["kvconn.result"] for s in fences} == {"ok"}
    fenced_acks = [
        s for s in fenced_trace if s["name"] == "kvconn.rank.ack" and s["attributes"]["kvconn.rank"] == 0
    ]
    assert any(s["attributes"]["kvconn.fenced"] for s in fenced_acks)
    assert any(a["kvconn.fenced"] for a in events(roots[FENCED], "kvconn.ack") if a["kvconn.rank"] == 0)
