"""The documented recipe, run: two vLLM OpenAI servers (prefill, decode) with
KvconnConnector over loopback and ``kvconn-vllm-proxy`` in front of them.
Completions through the proxy, streamed or not, equal the prefill server's
own (it serves plain requests as one engine), and decode computed no prompt
token itself: vLLM's own metrics count every one as a KV transfer. A client
that hangs up on decode mid-transfer aborts the request: kvconn releases
its pages by proof, and decode's /metrics shows it.

Prefill writes a little slowly (loopback's ``piece_delay_s``: 16 KiB pieces
0.05 s apart, 64 KiB per 32-token block, so 0.2 s a block) so that a
transfer is still in flight when that client hangs up.

Both servers trace every room into one file (``"tracing": true`` and
``trace_file`` in ``kv_connector_extra_config``) and abort deadlines are 10 s:
docs/operations.md's quarantine runbook is followed step by step from the
two servers' own scrapes with the prefill rank frozen, and that
aborted request's trace is whole and in order (decode's root span, the
rank's spans under it)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)

from vllm_helpers import BLOCK_SIZE, add_word_tokenizer, kv_transfer_config, make_tiny_llama

from kvconn.runtime.trace_export import read_spans
from kvconn.testing.cluster import free_port
from kvconn.testing.tracing import order_errors
from kvconn_vllm.proxy import Proxy, serve

ROOT = Path(__file__).resolve().parents[2]

START_TIMEOUT_S = 300.0
#: The servers start in the first test that asks for them (up to
#: START_TIMEOUT_S each, on a loaded machine), then the runbook's waits.
pytestmark = pytest.mark.timeout(1200)
SLOW = {"piece_bytes": "16384", "piece_delay_s": "0.05"}
PROMPTS = {n: " ".join(f"w{(n * 13 + i * 7) % 500 + 3}" for i in range(n)) for n in (5, BLOCK_SIZE, 45, 70)}


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
    runs) in a process group of its own, stopped by its pid."""

    def __init__(
        self, model: Path, role: str, log: Path, extra: dict[str, Any] | None = None, *args: str
    ) -> None:
        """``extra``: the connector's kv_connector_extra_config (default: this
        file's, prefill writing at SLOW); ``args``: more of the server's own options."""
        self.trace_file = Path((extra or {}).get("trace_file", log.with_suffix(".none")))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server runs its engine in its own process
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
                + [arg for option in self._options(role, extra) for arg in option]
                + list(args),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def _options(self, role: str, extra: dict[str, Any] | None) -> list[tuple[str, ...]]:
        if extra is None:  # this file's servers: prefill writes slowly (SLOW)
            extra = {"backend_options": SLOW} if role == "kv_producer" else {}
        config = {**kv_transfer_config(role, **extra), "kv_load_failure_policy": "recompute"}
        return [
            ("--host", "127.0.0.1"),
            ("--port", str(self.port)),
            ("--served-model-name", "tiny"),
            ("--dtype", "float32"),
            ("--max-model-len", "256"),
            ("--block-size", str(BLOCK_SIZE)),
            ("--kv-cache-memory-bytes", str(16 << 20)),
            ("--enforce-eager",),
            ("--no-enable-prefix-caching",),
            ("--disable-hybrid-kv-cache-manager",),
            ("--disable-uvicorn-access-log",),
            ("--kv-transfer-config", json.dumps(config)),
        ]

    def wait_up(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.url} not up within {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return float(sample.value)
        raise KeyError(f"{name} {labels} not in {self.url}/metrics")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this test started
                self.proc.wait(30)


#: Both servers' settings beside SLOW: every room traced into one file, and
#: an abort deadline short enough for the runbook test (Config's timers
#: and tracing, from kv_connector_extra_config).
TRACED = {"tracing": True, "abort_timeout_s": 10}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, str]]:
    root = tmp_path_factory.mktemp("http")
    model = add_word_tokenizer(make_tiny_llama(root / "model"))
    traced = {**TRACED, "trace_file": str(root / "spans.jsonl")}
    prefill = Server(model, "kv_producer", root / "prefill.log", {"backend_options": SLOW, **traced})
    decode = Server(model, "kv_consumer", root / "decode.log", traced)
    proxy = serve(Proxy([prefill.url], [decode.url], timeout_s=120), port=0)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        prefill.wait_up(deadline)
        decode.wait_up(deadline)
        yield prefill, decode, f"http://127.0.0.1:{proxy.server_port}"
    finally:
        proxy.shutdown()
        proxy.server_close()
        prefill.stop()
        decode.stop()


def _complete(base: str, prompt: str, **extra: Any) -> Any:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    request = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        raw = response.read()
    if extra.get("stream"):
        events = [line.removeprefix(b"data: ") for line in raw.splitlines() if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    return json.loads(raw)


def _names(server: Server) -> set[str]:
    """The kvconn metric names on ``server``'s /metrics as a PromQL query
    names them: every sample's, and a counter family's ``_total`` even before
    its first labelled sample (its HELP and TYPE lines are there)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kvconn_"):
            names.update(s.name for s in family.samples)
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "gauge":
                names.add(family.name)
    return names


#: The metric names monitoring/'s dashboard queries.
DASHBOARD_NAMES = frozenset(
    re.findall(
        r"(?<![\w:])kvconn_[a-z0-9_]+", (ROOT / "monitoring/grafana/kvconn-dashboard.json").read_text()
    )
) - {"kvconn_endpoint"}
#: A prefill rank's series at decode: from when decode first asks that instance.
PER_RANK = {"kvconn_abort_to_ack_seconds_bucket"}


def test_every_dashboard_metric_is_on_each_servers_scrape_from_the_start(
    servers: tuple[Server, Server, str],
) -> None:
    """Before any request (this module's first test: the servers are only up),
    each server's own /metrics has every metric the dashboard queries but a
    prefill rank's own, which decode's has from its first request on."""
    prefill, decode, proxy = servers
    assert len(DASHBOARD_NAMES) >= 27
    for server in (prefill, decode):
        assert DASHBOARD_NAMES - PER_RANK - _names(server) == set(), server.url
    _complete(proxy, PROMPTS[5])
    deadline = time.monotonic() + 30
    while DASHBOARD_NAMES - _names(decode):
        assert time.monotonic() < deadline, f"not on decode's scrape: {DASHBOARD_NAMES - _names(decode)}"
        time.sleep(0.2)


def test_completions_through_the_proxy_equal_one_engines_and_decode_computed_no_prompt(
    servers: tuple[Server, Server, str],
) -> None:
    prefill, decode, proxy = servers
    source = "vllm:prompt_tokens_by_source_total"

    def counts() -> tuple[float, float, float]:
        return (
            sum(_samples(decode, source, source="external_kv_transfer")),
            sum(_samples(decode, source, source="local_compute")),
            sum(_samples(decode, "vllm:request_success_total", finished_reason="length")),
        )

    before = counts()
    for n, prompt in PROMPTS.items():
        alone = _complete(prefill.url, prompt)
        disaggregated = _complete(proxy, prompt)
        assert disaggregated["usage"]["prompt_tokens"] == n
        assert disaggregated["choices"][0]["text"] == alone["choices"][0]["text"], f"{n}-token prompt"
        assert _complete(proxy, prompt, stream=True) == alone["choices"][0]["text"], (
            f"{n}-token prompt, streamed"
        )
    remote, local, answered = (after - was for after, was in zip(counts(), before, strict=True))
    assert (remote, local, answered) == (2 * sum(PROMPTS), 0, 2 * len(PROMPTS))


def test_each_server_logs_the_connector_and_core_versions(servers: tuple[Server, Server, str]) -> None:
    """What an operator reports with a problem: kvconn-vllm's and kvconn-core's versions (issue 43)."""
    import kvconn
    import kvconn_vllm

    line = f"kvconn-vllm {kvconn_vllm.__version__} (kvconn-core {kvconn.__version__})"
    for server in servers[:2]:
        assert line in server.log.read_text(errors="replace"), server.tail()


def _samples(server: Server, name: str, **labels: str) -> list[float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return [
        float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]


def test_kvconn_figures_on_each_servers_own_metrics(servers: tuple[Server, Server, str]) -> None:
    """kvconn's counters and gauges reach vLLM's /metrics of both servers
    through vLLM's KV connector stats (kvconn_vllm.stats), under kvconn's own
    names and labels plus vLLM's, so monitoring/'s rules apply unchanged."""
    prefill, decode, proxy = servers
    landed = {"kvconn_endpoint": "prefill-0", "outcome": "landed"}
    before = sum(_samples(prefill, "kvconn_chunks_total", **landed))
    _complete(proxy, PROMPTS[45])
    deadline = time.monotonic() + 30
    while sum(_samples(prefill, "kvconn_chunks_total", **landed)) <= before:
        assert time.monotonic() < deadline, "prefill's landed chunks never rose on its /metrics"
        time.sleep(0.2)
    (held,) = _samples(decode, "kvconn_pages_held", kvconn_endpoint="decode-0", model_name="tiny")
    assert held == 0.0
    # counters the alerts watch exist at 0 from the start, one series per proof
    proofs = _samples(decode, "kvconn_releases_total", kvconn_endpoint="decode-0")
    assert len(proofs) >= 7 and sum(proofs) == 0.0, proofs
    assert sum(_samples(decode, "kvconn_messages_total", kvconn_endpoint="decode-0")) > 0


#: 220 tokens: 7 blocks, 1.4 s of writes at SLOW.
LONG_PROMPT = " ".join(f"w{(i * 17) % 500 + 3}" for i in range(220))


def _hang_up_mid_transfer(decode: Server, body: dict[str, Any]) -> None:
    """Send ``body`` to decode's completions and close the connection,
    unanswered, once vLLM says the request's KV load is in progress (its own
    gauge): vLLM's server aborts the request, mid-transfer."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{decode.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    loading = {"stage": "in_progress"}
    with socket.create_connection(("127.0.0.1", decode.port), timeout=10) as conn:
        conn.sendall(head.encode() + data)
        deadline = time.monotonic() + 30
        while sum(_samples(decode, "vllm:num_requests_kv_fetch_by_stage", **loading)) < 1:
            assert time.monotonic() < deadline, "decode never started loading the request's KV"
            time.sleep(0.02)


def _release_histogram(server: Server, sample: str) -> dict[str, float]:
    """``kvconn_abort_to_release_seconds`` of decode-0, by proof: its ``_count`` or ``_sum``."""
    name = "kvconn_abort_to_release_seconds"
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        s.labels["proof"]: float(s.value)
        for family in text_string_to_metric_families(text)
        if family.name == name
        for s in family.samples
        if s.name == f"{name}_{sample}" and s.labels.get("kvconn_endpoint") == "decode-0"
    }


# slow: whether the hang-up lands while kvconn holds the room is a race with
# the transfer (one CI run of four saw no release in 60 s); run with -m slow.
@pytest.mark.slow
def test_a_client_hanging_up_mid_transfer_shows_its_release_on_decodes_metrics(
    servers: tuple[Server, Server, str],
) -> None:
    """Abort-to-release by proof and the quarantine's age, on the real
    decode server's /metrics, after a client hung up on decode while prefill
    was still writing its KV."""
    prefill, decode, proxy = servers
    before = _release_histogram(decode, "count")
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    params = Proxy([prefill.url], [decode.url], timeout_s=120).kv_params("/v1/completions", body)
    _hang_up_mid_transfer(decode, {**body, "kv_transfer_params": params})
    # decode's figures travel with its engine's steps: a request keeps it stepping
    deadline = time.monotonic() + 60
    while sum(_release_histogram(decode, "count").values()) == sum(before.values()):
        assert time.monotonic() < deadline, "no release after the abort on decode's /metrics"
        _complete(proxy, PROMPTS[5])
    after = _release_histogram(decode, "count")
    rose = {proof: n - before.get(proof, 0.0) for proof, n in after.items() if n != before.get(proof, 0.0)}
    (proof,) = rose  # one aborted room, one release
    assert rose[proof] == 1.0 and proof in ("acks", "writer_fence", "completed"), rose  # proven
    took = _release_histogram(decode, "sum")[proof]
    assert 0 < took < 30, took  # within decode's abort deadline (30 s): never quarantined
    decode_0 = {"kvconn_endpoint": "decode-0"}
    assert sum(_samples(decode, "kvconn_releases_total", proof=proof, **decode_0)) == after[proof]
    assert _samples(decode, "kvconn_quarantine_oldest_seconds", **decode_0) == [0.0]
    assert _samples(decode, "kvconn_pages_quarantined", **decode_0) == [0.0]
    assert _samples(decode, "kvconn_pages_held", **decode_0) == [0.0]


def _listener_pid(address: str) -> int:
    """The process listening at ``address`` (tcp://HOST:PORT), as the runbook
    finds it: ``ss -ltnp 'sport = :PORT'``."""
    port = address.rsplit(":", 1)[1]
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    (pid,) = {int(p) for p in re.findall(r"pid=(\d+)", out)}
    return pid


def _state(pid: int) -> str:
    return subprocess.run(
        ["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, timeout=30
    ).stdout


def _wait_for(cond: Any, timeout_s: float, what: str, explain: Any = None) -> None:
    """Wait for ``cond``; on timeout fail with ``what`` and, if given, what
    ``explain()`` says then (the figures a failure in CI needs read)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what if explain is None else f"{what}\n{explain()}"
        time.sleep(0.25)


def _one(server: Server, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return [
        (dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]


def test_the_quarantine_runbook_works_from_the_servers_own_scrapes_and_the_abort_is_traced_end_to_end(
    servers: tuple[Server, Server, str],
) -> None:
    """docs/operations.md, KvconnQuarantineAgeRising, step by step on real
    servers: a prefill rank frozen with a request's blocks ready to send
    (SIGSTOP of the process that listens at its address), the request asked
    of it by decode and aborted there (the client hung up), and quarantined
    past decode's 10 s deadline. From decode's /metrics,
    the rank the quarantine waits for (its address), that decode found it
    down (KvconnRankDown's labels), decode's log line; from the prefill
    server's /metrics, that the rank is its own; ``ss`` and ``ps`` name the
    stopped process; SIGCONT, and decode's /metrics shows the release by the
    rank's late proof. That request's trace, written by both servers'
    workers: decode's root span, the rank's spans under it, in order."""
    prefill, decode, proxy = servers
    dec = {"kvconn_endpoint": "decode-0"}
    _complete(proxy, PROMPTS[5])  # the instance is known at decode, and the rank reported
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    params = Proxy([prefill.url], [decode.url], timeout_s=120).kv_params("/v1/completions", body)
    (address,) = params["kvconn_prefill"]
    rank_pid = _listener_pid(address)
    released_before = {
        labels["proof"]: value for labels, value in _one(decode, "kvconn_releases_total", **dec)
    }
    data = json.dumps({**body, "kv_transfer_params": params}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{decode.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    # the fault: prefill's rank frozen with the request's blocks ready to send
    os.kill(rank_pid, signal.SIGSTOP)
    try:
        with socket.create_connection(("127.0.0.1", decode.port), timeout=10) as conn:
            conn.sendall(head.encode() + data)
            _wait_for(
                lambda: (
                    sum(
                        v for _, v in _one(decode, "vllm:num_requests_kv_fetch_by_stage", stage="in_progress")
                    )
                    >= 1
                ),
                30,
                "decode never started loading the request's KV",
            )
        # the client hung up: vLLM aborts the request, kvconn holds its blocks
        # The alert's figure: a quarantined room, its age growing.
        _wait_for(
            lambda: sum(v for _, v in _one(decode, "kvconn_quarantine_oldest_seconds", **dec)) > 0,
            90,
            "no quarantine on decode's /metrics",
        )
        # 1. Find the rank, on decode's scrape: the address the quarantined room waits for.
        waiting = [
            (lab, v)
            for lab, v in _one(decode, "kvconn_rooms_awaiting_rank", state="quarantined", **dec)
            if v > 0
        ]
        assert [(lab["address"], lab["rank"], v) for lab, v in waiting] == [(address, "0", 1.0)]
        found = waiting[0][0]["address"]
        # ... and decode found it down (KvconnRankDown's labels name it), it hears it no more
        _wait_for(
            lambda: [v for _, v in _one(decode, "kvconn_prefill_rank_up", address=found, **dec)] == [0.0],
            60,
            "decode still hears the frozen rank",
        )
        assert [
            v for _, v in _one(decode, "kvconn_ranks_down_total", cause="silent", address=found, **dec)
        ] == [1.0]
        log = decode.log.read_text(errors="replace")
        assert f"no proof yet from prefill rank 0 ({found})" in log, decode.tail()
        assert f"prefill rank 0 ({found}) is down: " in log, decode.tail()
        # 2. Find its server: the prefill server's own scrape names the address.
        assert [v for _, v in _one(prefill, "kvconn_rank_info", address=found)] == [1.0]
        # ... and the process listening there, and 3. why it proves nothing: stopped.
        pid = _listener_pid(found)
        assert pid == rank_pid and _state(pid).strip().startswith("T"), _state(pid)
        held_s = time.monotonic()
    finally:
        os.kill(rank_pid, signal.SIGCONT)  # 4. it resumes
    _wait_for(
        lambda: sum(v for _, v in _one(decode, "kvconn_rooms_awaiting_rank", address=found, **dec)) == 0,
        90,
        "the quarantine did not end after SIGCONT",
    )
    after = {labels["proof"]: value for labels, value in _one(decode, "kvconn_releases_total", **dec)}
    rose = {
        p: after[p] - released_before.get(p, 0.0) for p in after if after[p] != released_before.get(p, 0.0)
    }
    (proof,) = rose
    assert rose[proof] == 1.0 and proof in ("late_acks", "writer_fence"), rose
    assert [v for _, v in _one(decode, "kvconn_pages_quarantined", **dec)] == [0.0]
    # 5. the resumed rank serves again. A request also makes decode's engine
    # step, and /metrics moves only with steps (docs/metrics.md): decode may
    # have heard the rank again after the step that reported the release, and
    # an idle engine would show it down until its next request (CI6, CI9).
    _complete(proxy, PROMPTS[45])
    _wait_for(
        lambda: [v for _, v in _one(decode, "kvconn_prefill_rank_up", address=found, **dec)] == [1.0],
        30,
        "decode does not hear the resumed rank",
        lambda: (
            f"rank_up: {_one(decode, 'kvconn_prefill_rank_up', **dec)}\n"
            f"drops: {_one(decode, 'kvconn_dropped_messages_total', **dec)}\n{decode.tail()}"
        ),
    )
    print(f"\nrunbook: room released by {proof} {time.monotonic() - held_s:.1f} s after SIGCONT")

    # The aborted request's trace, from both servers' workers.
    room = params["kvconn_room"]

    def trace() -> list[dict[str, Any]]:
        spans = read_spans(str(decode.trace_file))
        roots = [s for s in spans if s["name"] == "kvconn.room" and s["attributes"]["kvconn.room"] == room]
        if not roots:
            return []
        return [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]

    _wait_for(lambda: any(s["name"] == "kvconn.rank.ack" for s in trace()), 30, "the rank's ack span")
    spans = trace()
    assert order_errors(spans) == [], spans
    (root,) = [s for s in spans if s["parent_id"] is None]
    assert root["attributes"]["kvconn.proof"] == proof
    ranks = {s["pid"] for s in spans if s["name"].startswith("kvconn.rank.")}
    assert ranks == {rank_pid} and root["pid"] != rank_pid
    assert {s["name"] for s in spans} >= {"kvconn.room", "kvconn.rank.room", "kvconn.rank.ack"}
    assert [e["name"] for e in root["events"]][:2] == ["kvconn.abort", "kvconn.abort_sent"]
