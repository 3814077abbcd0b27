"""kvconn_vllm.stats: a worker's reports, merged as vLLM merges TP workers'
and recorded as its API server records them, add up to the endpoints' own
figures; histograms (abort-to-release by proof, abort-to-ack by rank) arrive
as their observations; every family is recorded when the metrics are built,
before any report. (The path through two real servers' /metrics:
test_e2e_http.py.)"""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)

from kvconn.config import Config
from kvconn.metrics import Metrics
from kvconn.metrics_relay import Reporter
from kvconn.plugins import get_backend
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn_vllm.connector import KvconnConnector
from kvconn_vllm.stats import KvconnConnectorStats

PAGE = 4096


def _wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_reports_add_up_to_the_endpoints_figures_and_releases_are_observed() -> None:
    registry = CollectorRegistry()
    types = {
        Counter: functools.partial(Counter, registry=registry),
        Gauge: functools.partial(Gauge, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    prom = KvconnConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    engine = {"model_name": "tiny", "engine": "0"}
    # before any report: every family kvconn has, its name on the scrape (a
    # labelled one with no event yet as its HELP and TYPE lines)
    assert {f.name for f in Metrics("decode").registry.collect()} <= {f.name for f in registry.collect()}
    # before any report: every family, its counters at 0 for each label value alerts watch
    for proof in ("acks", "unsafe_timeout"):
        at = {**engine, "kvconn_endpoint": "decode-0", "proof": proof}
        assert registry.get_sample_value("kvconn_releases_total", at) == 0.0
        assert registry.get_sample_value("kvconn_abort_to_release_seconds_count", at) == 0.0
    for name in ("kvconn_pages_quarantined", "kvconn_quarantine_oldest_seconds", "kvconn_poisoned_rooms"):
        assert registry.get_sample_value(name, {**engine, "kvconn_endpoint": "decode-0"}) == 0.0
    assert (
        registry.get_sample_value("kvconn_acks_sent_total", {**engine, "kvconn_endpoint": "prefill-0"}) == 0.0
    )
    clock = [0.0]
    reporter = Reporter(clock=lambda: clock[0])
    config = Config(write_timeout_s=1.0, abort_timeout_s=5.0)
    rank = PrefillRank(get_backend("loopback"), 0, 64 * PAGE, config)
    decode = DecodeEndpoint(get_backend("loopback"), 64, PAGE, [rank.address], config)
    endpoints: list[tuple[str, Metrics]] = [("decode-0", decode.metrics), ("prefill-0", rank.metrics)]
    try:
        first = reporter.take(endpoints)
        assert first is not None and reporter.take(endpoints) is None  # within the interval
        for room in (1, 2):
            decode.receiver(room, (2 * room, 2 * room + 1)).abort()
        _wait(lambda: decode.held_pages() == 0, "both releases")
        clock[0] += 1.0
        second = reporter.take(endpoints)
        assert second is not None
        # two workers' reports, merged as vLLM's KVOutputAggregator does, then
        # built from the dict as the API server does
        merged = KvconnConnectorStats(data=first).aggregate(KvconnConnectorStats(data=second))
        prom.observe(KvconnConnector.build_kv_connector_stats(merged.to_dict()).data, 0)
        for name, labels in (
            ("kvconn_releases_total", {"proof": "acks"}),
            ("kvconn_aborts_sent_total", {}),
            ("kvconn_acks_sent_total", {}),
        ):
            endpoint = "prefill-0" if name == "kvconn_acks_sent_total" else "decode-0"
            metrics = rank.metrics if endpoint == "prefill-0" else decode.metrics
            recorded = registry.get_sample_value(
                name, {"model_name": "tiny", "engine": "0", "kvconn_endpoint": endpoint, **labels}
            )
            assert recorded == metrics.value(name, **labels) > 0, name
        assert (
            registry.get_sample_value(
                "kvconn_pages_held", {"model_name": "tiny", "engine": "0", "kvconn_endpoint": "decode-0"}
            )
            == 0.0
        )
        count = registry.get_sample_value(
            "kvconn_abort_to_release_seconds_count",
            {"model_name": "tiny", "engine": "0", "kvconn_endpoint": "decode-0", "proof": "acks"},
        )
        assert count == 2.0
        # each rank's acks, labelled with its id and address, exactly as decode observed them
        me = {**engine, "kvconn_endpoint": "decode-0", "rank": "0", "address": rank.address}
        for suffix in ("_count", "_sum"):
            name = "kvconn_abort_to_ack_seconds" + suffix
            recorded = registry.get_sample_value(name, me)
            assert recorded == decode.metrics.value(name, rank="0", address=rank.address) > 0, name
        up = registry.get_sample_value("kvconn_prefill_rank_up", {**me})
        assert up == 1.0
        assert merged.reduce()["kvconn releases"] == 2
    finally:
        decode.close()
        rank.close()
