"""A real Prometheus server (the `prometheus` binary) scrapes kvconn's exporter
in a running endpoint process, evaluates the shipped rules, and answers
queries for kvconn's series through its HTTP API."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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
from kvconn.protocol.hold import Proof


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


class Prometheus:
    def __init__(
        self, binary: str, target_ports: list[int], workdir: Path, scrape_interval: str = "1s"
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        # JSON is YAML; a 1 s scrape and rule interval keep the test short
        targets = [f"127.0.0.1:{port}" for port in target_ports]
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": scrape_interval, "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [{"job_name": "kvconn", "static_configs": [{"targets": targets}]}],
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

    def wait_scraping(self, targets: int, timeout: float) -> None:
        """Until every target was scraped once (``up`` exists for it, 0 while
        nothing listens there): Prometheus hands its scrape loops their
        targets only some seconds after it is ready, and a short bench
        started at once had ended before its first scrape."""
        deadline = time.monotonic() + timeout
        while len(self.query('up{job="kvconn"}')) < targets:
            assert time.monotonic() < deadline, f"prometheus scraped no target in {timeout} s"
            time.sleep(0.2)

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
    server = Prometheus(prometheus_binary, [endpoint_child.port], tmp_path)
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


def free_ports(n: int) -> int:
    """A port P with P..P+n-1 free now (the bench serves decode on P and rank r on P+1+r)."""
    for _ in range(50):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports")


def test_prometheus_scrapes_a_running_kvconn_bench(prometheus_binary: str, tmp_path: Path) -> None:
    """``kvconn bench --metrics-port P`` serves its decode endpoint on P and
    each prefill rank on P+1+r while its modes run; Prometheus scrapes them
    (every 200 ms, from before the bench starts) and keeps what it saw after
    the run."""
    ranks = 2
    base = free_ports(1 + ranks)
    server = Prometheus(prometheus_binary, list(range(base, base + 1 + ranks)), tmp_path, "200ms")
    try:
        server.wait_ready(60)
        server.wait_scraping(1 + ranks, 60)
        bench = subprocess.run(
            [sys.executable, "-m", "kvconn.cli", "bench", "--modes", "kvconn", "--faults", "off",
             "--requests", "3000", "--stream-requests", "20", "--ranks", str(ranks),
             "--metrics-port", str(base), "--no-progress", "--json", str(tmp_path / "bench.json")],
            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        assert bench.returncode in (0, 1), bench.stderr[-3000:]
        report = json.loads((tmp_path / "bench.json").read_text())
        # the scrapes are gone with the bench; their samples stay in the TSDB
        span = "[10m]"
        released = server.wait_query(
            f'max_over_time(kvconn_releases_total{{job="kvconn",{ENDPOINT_LABEL}="decode"}}{span}) > 0', 30
        )
        proofs = {r["metric"]["proof"] for r in released}
        assert proofs and proofs <= {p.value for p in Proof} - {Proof.UNSAFE_TIMEOUT.value}, proofs
        # a scrape saw at most what the bench counted in the end
        counted = report["modes"]["kvconn"]["releases_by_proof"]
        for r in released:
            assert float(r["value"][1]) <= counted[r["metric"]["proof"]], (r, counted)
        for rank in range(ranks):
            (landed,) = server.wait_query(
                f'max_over_time(kvconn_chunks_total{{{ENDPOINT_LABEL}="prefill-{rank}",outcome="landed"}}'
                f"{span}) > 0",
                30,
            )
            assert landed["metric"]["instance"] == f"127.0.0.1:{base + 1 + rank}"
    finally:
        server.stop()


def test_a_release_without_proof_fires_kvconn_unsafe_release(prometheus_binary: str, tmp_path: Path) -> None:
    """The one alert that means a page may be corrupted, end to end: an
    endpoint in the legacy timeout-only mode frees an aborted room at its
    deadline, and a real Prometheus with the shipped rules fires
    KvconnUnsafeRelease with the endpoint's labels."""
    child = EndpointChild(pages=2, unsafe=True)
    server = Prometheus(prometheus_binary, [child.port], tmp_path, "200ms")
    try:
        server.wait_ready(60)
        # the counter seen at 0 first: increase() counts no series' first sample
        unsafe = f'kvconn_releases_total{{{ENDPOINT_LABEL}="decode",proof="unsafe_timeout"}}'
        (zero,) = server.wait_query(unsafe, 30)
        assert float(zero["value"][1]) == 0.0
        assert get(server.base + "/api/v1/alerts")["data"]["alerts"] == []
        child.send_line()
        assert child.next_event(30) == {"released": "unsafe_timeout"}
        deadline = time.monotonic() + 30
        while not (
            firing := [
                a for a in get(server.base + "/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"
            ]
        ):
            assert time.monotonic() < deadline, "KvconnUnsafeRelease did not fire in 30 s"
            time.sleep(0.2)
        (alert,) = firing
        assert alert["labels"]["alertname"] == "KvconnUnsafeRelease", alert
        assert alert["labels"]["severity"] == "critical" and alert["labels"][ENDPOINT_LABEL] == "decode", (
            alert
        )
        assert alert["labels"]["instance"] == f"127.0.0.1:{child.port}"
    finally:
        server.stop()
        child.close()
