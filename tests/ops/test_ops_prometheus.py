"""A real Prometheus server (the `prometheus` binary) scrapes kvconn's exporter
in a running endpoint process, evaluates the shipped rules, and answers
queries for kvconn's series through its HTTP API."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ops_support import RULES, EndpointChild

from kvconn.metrics import ENDPOINT_LABEL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


class Prometheus:
    def __init__(self, binary: str, target_port: int, workdir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        # JSON is YAML; a 1 s scrape and rule interval keep the test short
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [
                        {"job_name": "kvconn", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}
                    ],
                }
            )
        )
        self.log = workdir / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.base + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, (
                f"prometheus not ready in {timeout} s: {self.log.read_text()[-2000:]}"
            )
            time.sleep(0.1)

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = get(self.base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_query(self, expr: str, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            assert time.monotonic() < deadline, f"no result for {expr} in {timeout} s"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def prometheus(prometheus_binary: str, endpoint_child: EndpointChild, tmp_path: Path) -> Iterator[Prometheus]:
    server = Prometheus(prometheus_binary, endpoint_child.port, tmp_path)
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def test_prometheus_scrapes_a_running_endpoint_and_evaluates_the_rules(prometheus: Prometheus) -> None:
    (up,) = prometheus.wait_query('up{job="kvconn"} == 1', 30)
    assert up["metric"]["instance"].startswith("127.0.0.1:")
    # the child's rank wrote 3 pages of one room; decode released an aborted one by proof
    (landed,) = prometheus.wait_query(
        f'kvconn_chunks_total{{job="kvconn",{ENDPOINT_LABEL}="prefill-0",outcome="landed"}}', 30
    )
    assert float(landed["value"][1]) == 3.0
    released = prometheus.wait_query(f'kvconn_releases_total{{{ENDPOINT_LABEL}="decode"}} > 0', 30)
    assert [r["metric"]["proof"] for r in released] in (["acks"], ["completed"], ["nothing_sent"])
    # the shipped rules load and evaluate against real series
    groups = get(prometheus.base + "/api/v1/rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["name"] for r in rules} >= {"KvconnUnsafeRelease", "kvconn:pages_held:sum"}
    (held,) = prometheus.wait_query('kvconn:pages_held:sum{job="kvconn"}', 30)
    assert float(held["value"][1]) == 0.0
    deadline = time.monotonic() + 30
    while not all(r["health"] == "ok" and r.get("lastEvaluation", "").startswith("20") for r in rules):
        assert time.monotonic() < deadline, [(r["name"], r["health"], r.get("lastError")) for r in rules]
        time.sleep(0.2)
        rules = [r for g in get(prometheus.base + "/api/v1/rules")["data"]["groups"] for r in g["rules"]]
    # a healthy endpoint fires nothing
    alerts = get(prometheus.base + "/api/v1/alerts")["data"]["alerts"]
    assert alerts == [], alerts
