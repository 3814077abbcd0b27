"""kvconn's figures on SGLang's /metrics: a decode endpoint in a process
with prometheus_client's multiprocess mode on, as SGLang's scheduler runs
with --enable-metrics, and an HTTP /metrics served the way SGLang serves
it (a MultiProcessCollector over the folder; sglang.srt.utils's
add_prometheus_middleware), scraped over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from ops_support import HERE
from prometheus_client import CollectorRegistry, make_wsgi_app, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from kvconn.metrics import SCRAPE_TIME_FAMILIES, Metrics


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def sglang_metrics(tmp_path: Path) -> Iterator[str]:
    folder = tmp_path / "prometheus"
    folder.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    child = subprocess.Popen(
        [sys.executable, str(HERE / "sglang_decode_child.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(folder))
    server = make_server("127.0.0.1", 0, make_wsgi_app(registry), handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line and json.loads(line)["ready"], child.stderr.read() if child.stderr else ""
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        if child.stdin is not None:
            child.stdin.close()
        child.wait(30)


def test_every_kvconn_family_reaches_sglangs_metrics(sglang_metrics: str) -> None:
    with urllib.request.urlopen(sglang_metrics, timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}

    def value(family: str, sample: str, **labels: str) -> float:
        (found,) = [
            s.value
            for s in families[family].samples
            if s.name == sample and labels.items() <= s.labels.items()
        ]
        return float(found)

    # the relay's: scrape-time families, labelled by endpoint
    assert value("kvconn_pages_held", "kvconn_pages_held", kvconn_endpoint="decode-0") == 0.0
    assert value("kvconn_pages_quarantined", "kvconn_pages_quarantined", kvconn_endpoint="decode-0") == 0.0
    assert value("kvconn_quarantine_oldest_seconds", "kvconn_quarantine_oldest_seconds") == 0.0
    # the relayed tallies (kvconn_releases), and the histogram through the files by itself
    released = sum(s.value for s in families["kvconn_releases"].samples if s.name == "kvconn_releases_total")
    assert released == 1.0
    assert (
        value(
            "kvconn_abort_to_release_seconds",
            "kvconn_abort_to_release_seconds_count",
            proof=next(s.labels["proof"] for s in families["kvconn_releases"].samples if s.value == 1.0),
        )
        == 1.0
    )
    # decode's families, every one (prefill-only ones have no value at a decode)
    decode_only = {
        "kvconn_chunks",
        "kvconn_acks_sent",
        "kvconn_fences",
        "kvconn_plugin_errors",
        "kvconn_rank_info",
    }
    expected = {f.name for f in Metrics("decode").registry.collect()} - decode_only
    labelled_unset = {"kvconn_dropped_messages", "kvconn_plugin_errors", "kvconn_abort_to_ack_seconds"}
    assert expected - labelled_unset <= set(families), sorted(expected - set(families))
    assert SCRAPE_TIME_FAMILIES - {"kvconn_chunks", "kvconn_rank_info"} <= set(families)


def test_a_poke_relays_the_held_pages_at_once_not_at_the_next_interval() -> None:
    """A release pokes the relay: SGLang's /metrics shows the held pages
    within the relay's minimum gap, where the interval alone (a second in
    SGLang) made a fault run's "capacity back" up to a second late."""
    from kvconn_sglang.metrics import Relay

    metrics = Metrics("decode")
    held = [7.0]
    metrics.pages_held.set_function(lambda: held[0])
    relay = Relay(lambda: [("decode-0", metrics)], interval_s=60.0)  # the interval never comes
    try:

        def relayed() -> float | None:
            for made in relay.recorder.made:
                for family in made.collect():
                    for s in family.samples:
                        if s.name == "kvconn_pages_held":
                            return float(s.value)
            return None

        relay.poke()
        deadline = time.monotonic() + 10
        while relayed() != 7.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relayed() == 7.0
        held[0] = 0.0
        t = time.monotonic()
        relay.poke()
        while relayed() != 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relayed() == 0.0, "a poke while the interval is a minute away was not relayed"
        assert time.monotonic() - t < 5  # a loaded CI machine: far under the interval all the same
    finally:
        relay.close()
