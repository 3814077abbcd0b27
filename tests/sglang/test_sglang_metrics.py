"""kvconn_sglang's metrics wiring as SGLang runs it with ``--enable-metrics``:
the decode manager, built as SGLang builds it with
``server_args.enable_metrics`` in a process whose prometheus_client writes
SGLang's multiprocess folder, starts the relay of kvconn's scrape-time
figures; a ``/metrics`` served as SGLang serves it (a
``MultiProcessCollector`` over that folder, over HTTP) shows them beside
the counters and histograms that reach the files by themselves."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, multiprocess, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from conftest import KVCONN_ENV, Zygote, running
from kvconn.testing.waiting import wait_for


@pytest.fixture
def sglang_metrics(zygote: Zygote, tmp_path: Path) -> Iterator[str]:
    """The child's manager up, its room released; the URL of a /metrics over its folder."""
    folder = tmp_path / "prometheus"  # what SGLang's launcher puts in PROMETHEUS_MULTIPROC_DIR
    folder.mkdir()
    pid, conn = zygote.fork("metrics_decode", {}, {**KVCONN_ENV, "PROMETHEUS_MULTIPROC_DIR": str(folder)})
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(folder))
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    rfile = conn.makefile("r")
    try:
        conn.settimeout(120)  # it imports nothing more: seconds
        line = rfile.readline()
        assert line and json.loads(line)["ready"], f"the child {pid} did not get ready (its stderr is above)"
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        rfile.close()
        conn.close()  # the child closes its manager and exits
        wait_for(lambda: not running(pid), 30, "the metrics child exited")


def scrape(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return {f.name: f for f in text_string_to_metric_families(response.read().decode())}


def test_the_managers_figures_reach_sglangs_metrics(sglang_metrics: str) -> None:
    # the relay records every second: bounded wait for its first record
    deadline = time.monotonic() + 20
    while "kvconn_pages_held" not in (families := scrape(sglang_metrics)):
        assert time.monotonic() < deadline, f"no relayed family in 20 s: {sorted(families)}"
        time.sleep(0.2)

    def samples(family: str, name: str) -> list[Any]:
        return [s for s in families[family].samples if s.name == name]

    # relayed (scrape-time only in kvconn's registry), by the manager's endpoint name
    for gauge in ("kvconn_pages_held", "kvconn_pages_quarantined", "kvconn_quarantine_oldest_seconds"):
        assert [(s.labels["kvconn_endpoint"], s.value) for s in samples(gauge, gauge)] == [("decode-0", 0.0)]
    # the endpoint's own: its one aborted room, released by proof
    released = {s.labels["proof"]: s.value for s in samples("kvconn_releases", "kvconn_releases_total")}
    assert sum(released.values()) == 1.0 and released.get("unsafe_timeout") == 0.0, released
    (proof,) = [p for p, v in released.items() if v == 1.0]
    counts = samples("kvconn_abort_to_release_seconds", "kvconn_abort_to_release_seconds_count")
    assert {s.labels["proof"]: s.value for s in counts}[proof] == 1.0
