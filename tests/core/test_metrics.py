"""Chunk outcomes are plain ints on the worker's path, yet scrape and read as
a Prometheus counter."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import attrs
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvconn.config import Config
from kvconn.metrics import Metrics
from kvconn.protocol.hold import HoldState
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.cluster import Cluster
from kvconn.testing.null import NullBackend
from kvconn.testing.waiting import wait_for


def test_tally_scrapes_as_a_counter_with_every_outcome() -> None:
    m = Metrics("prefill")
    m.chunks.counts["landed"] += 3
    m.chunks.counts["plugin_error"] += 1
    assert m.value("kvconn_chunks_total", outcome="landed") == 3.0
    assert m.value("kvconn_chunks_total", outcome="unsettled") == 0.0
    (family,) = [
        f for f in text_string_to_metric_families(m.exposition().decode()) if f.name == "kvconn_chunks"
    ]
    assert family.type == "counter"
    assert {s.labels["outcome"]: s.value for s in family.samples} == {
        "landed": 3.0,
        "failed_settled": 0.0,
        "unsettled": 0.0,
        "skipped": 0.0,
        "plugin_error": 1.0,
    }


def test_a_rank_counts_each_chunk_it_wrote() -> None:
    backend = NullBackend()
    rank = PrefillRank(backend, 0, 16 * 4096, Config())
    decode = DecodeEndpoint(backend, 16, 4096, [rank.address], Config())
    try:
        rx = decode.receiver(1, (0, 1, 2))
        sender = rank.sender(1)
        deadline = time.monotonic() + 10
        while sender.poll() < KVPoll.WAITING_FOR_INPUT:
            assert time.monotonic() < deadline, "the request never reached the rank"
            time.sleep(0.001)
        for page in range(3):
            sender.send([page], last=page == 2)
        while rx.poll() is not KVPoll.SUCCESS:
            assert time.monotonic() < deadline, "the room never succeeded"
            time.sleep(0.001)
        assert rank.metrics.value("kvconn_chunks_total", outcome="landed") == 3.0
        assert rank.metrics.value("kvconn_chunks_total", outcome="skipped") == 0.0
    finally:
        decode.close()
        rank.close()


def test_decode_times_each_ranks_ack_from_the_abort() -> None:
    """kvconn_abort_to_ack_seconds{rank}: which rank holds aborted pages, by how long."""
    backend = NullBackend()
    rank = PrefillRank(backend, 0, 16 * 4096, Config())
    now = [100.0]
    decode = DecodeEndpoint(backend, 16, 4096, [rank.address], Config(), clock=lambda: now[0])
    try:
        rx = decode.receiver(1, (0, 1, 2))
        deadline = time.monotonic() + 10
        while rank.sender(1).poll() < KVPoll.WAITING_FOR_INPUT:
            assert time.monotonic() < deadline, "the request never reached the rank"
            time.sleep(0.001)
        with rank._lock:  # the rank takes the ABORT only once the clock has moved on
            rx.abort()
            now[0] = 100.004
        while decode.held_pages():
            assert time.monotonic() < deadline, "the abort was never acked"
            time.sleep(0.001)
        buckets = dict(decode.metrics.buckets("kvconn_abort_to_ack_seconds", rank="0"))
        assert (buckets[0.002], buckets[0.005], buckets[float("inf")]) == (0.0, 1.0, 1.0)
        assert decode.metrics.buckets("kvconn_abort_to_ack_seconds", rank="1") == []
    finally:
        decode.close()
        rank.close()


def test_docs_metrics_lists_every_family() -> None:
    """docs/metrics.md is the operator's reference: a family added here and
    not there fails this test."""
    text = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    for family in Metrics("decode").registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        assert f"`{name}`" in text, f"{name} is not in docs/metrics.md"


def test_docs_metrics_lists_every_drop_reason() -> None:
    """Each ``reason`` label an endpoint can count is one DropReason, and the
    operator's reference explains every one of them."""
    from kvconn.protocol.drops import DropReason

    text = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    missing = [reason.value for reason in DropReason if f"`{reason.value}`" not in text]
    assert not missing, f"docs/metrics.md does not explain {missing}"
    assert str(DropReason.BAD_MAC) == "bad_mac"  # the label is the value


def test_decode_names_each_prefill_rank_by_id_and_address(caplog: pytest.LogCaptureFixture) -> None:
    """What an operator finds a stuck rank by, on decode's own scrape and log:
    each bootstrapped rank's series (up, rooms awaiting its proof by state,
    found down by cause, abort-to-ack) labelled with its ``rank`` id and its
    control ``address``, from the bootstrap on; a quarantine names the rank
    it waits for, with its address; the rank's own scrape names its address."""
    fast = {"heartbeat_interval_s": 0.05, "peer_timeout_s": 0.5}
    c = Cluster(num_ranks=1, num_pages=32, page_bytes=16 << 10, abort_timeout_s=1.5, start_decode=False)
    c.config = attrs.evolve(c.config, **fast)
    c.start_decode()
    rank = c.ranks[0]
    me = {"rank": "0", "address": rank.address}
    try:
        # from the bootstrap: every per-rank series at 0, the rank up
        assert c.metric("kvconn_prefill_rank_up", **me) == 1.0
        for cause in ("exited", "silent"):
            assert (
                c.dec.metrics.registry.get_sample_value("kvconn_ranks_down_total", {"cause": cause, **me})
                == 0.0
            )
        assert c.dec.metrics.buckets("kvconn_abort_to_ack_seconds", **me)[-1] == (float("inf"), 0.0)
        assert rank.value("kvconn_rank_info", address=rank.address, rank="0") == 1.0

        rx, _ = c.open(1, 4)
        rank.signal(signal.SIGSTOP)  # frozen: it proves nothing, and answers no Hello
        try:
            with caplog.at_level(logging.WARNING, logger="kvconn.runtime.decode"):
                wait_for(lambda: rx.poll() is KVPoll.FAILED, 10, "the open room's failure")
                wait_for(lambda: rx.state() is HoldState.QUARANTINED, 10, "quarantine at the abort deadline")
                wait_for(lambda: c.metric("kvconn_prefill_rank_up", **me) == 0.0, 10, "the rank found down")
            assert c.metric("kvconn_rooms_awaiting_rank", state="quarantined", **me) == 1.0
            assert c.metric("kvconn_rooms_awaiting_rank", state="held", **me) == 0.0
            assert c.metric("kvconn_ranks_down_total", cause="silent", **me) == 1.0
            logged = caplog.text
            assert f"prefill rank 0 ({rank.address}) is down: " in logged
            assert (
                f"room 1 quarantined: 4 pages held, no proof yet from prefill rank 0 ({rank.address})"
                in logged
            )
        finally:
            rank.signal(signal.SIGCONT)
        wait_for(lambda: c.released(1) is not None, 10, "the rank's late proof")
        wait_for(lambda: c.metric("kvconn_prefill_rank_up", **me) == 1.0, 10, "the rank heard again")
        assert c.metric("kvconn_rooms_awaiting_rank", state="quarantined", **me) == 0.0
    finally:
        c.close()
