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
    # the endpoint's own counters and histogram, through the files by themselves
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
