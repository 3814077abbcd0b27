"""docs/operations.md's quarantine runbook, followed step by step on real
SGLang servers (docs/sglang.md's recipe, loopback, no router), each step
from a server's own ``/metrics``; and the aborted request's trace, from
inside SGLang, whole and in order.

Both servers are configured through kvconn_sglang's variables alone: every
room traced into one file (``KVCONN_SGLANG_TRACING=1``,
``KVCONN_SGLANG_TRACE_FILE``), decode's liveness and abort timers short
(``KVCONN_SGLANG_PEER_TIMEOUT_S``, ``_HEARTBEAT_INTERVAL_S``,
``_ABORT_TIMEOUT_S``), and loopback's fault point through
``KVCONN_SGLANG_BACKEND_OPTIONS``, naming two ``rank:room:index`` triples
in one ``freeze_chunks`` (the prefill rank stops itself half-way through
the room's first chunk). Two SGLang servers: ``slow``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from sglang_servers import Process, Recipe, option, read_recipe
from tiny_model import TINY_LLAMA

from kvconn.runtime.trace_export import read_spans
from kvconn.testing.cluster import free_port
from kvconn.testing.tracing import order_errors
from kvconn.testing.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
pytest.importorskip("sglang", reason="sglang is not installed here: scripts/setup-sglang-venv.sh")

START_S = 900.0
#: The room loopback freezes the prefill rank in (and a second one, never
#: used, to show two triples in one variable).
FROZEN_ROOM, OTHER_ROOM = 7_700_101, 7_700_102
PROMPT = [(i * 7) % (TINY_LLAMA["vocab_size"] - 3) + 3 for i in range(100)]
#: kvconn's settings for both servers, as the operator writes them.
KVCONN = {
    "KVCONN_SGLANG_TRANSPORT": "loopback",
    "KVCONN_SGLANG_TRACING": "1",
    "KVCONN_SGLANG_WRITE_TIMEOUT_S": "5",
    "KVCONN_SGLANG_ABORT_TIMEOUT_S": "8",
    "KVCONN_SGLANG_HEARTBEAT_INTERVAL_S": "0.5",
    "KVCONN_SGLANG_PEER_TIMEOUT_S": "6",
    "KVCONN_SGLANG_RESEND_INTERVAL_S": "0.5",
    "KVCONN_SGLANG_BACKEND_OPTIONS": f"freeze_chunks=0:{FROZEN_ROOM}:0,0:{OTHER_ROOM}:0,piece_bytes=4096",
    # SGLang's own deadline for a held room: passes while kvconn still holds it
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "1",
}


def _env(recipe: Recipe, trace_file: Path) -> dict[str, str]:
    env = {**os.environ, **recipe.env, **KVCONN, "KVCONN_SGLANG_TRACE_FILE": str(trace_file)}
    if os.environ.get("PYTHONPATH"):  # the doc's (the CPU stand-ins) first, then the test's own
        env["PYTHONPATH"] = recipe.env.get("PYTHONPATH", "") + os.pathsep + os.environ["PYTHONPATH"]
    return env


class Servers:
    def __init__(self, recipe: Recipe, root: Path) -> None:
        self.recipe = recipe
        self.trace_file = root / "spans.jsonl"
        env = _env(recipe, self.trace_file)
        url = {argv: f"http://127.0.0.1:{option(argv, '--port')}" for argv in (recipe.prefill, recipe.decode)}
        self.prefill = Process(recipe.prefill, env, root / "prefill.log", url[recipe.prefill])
        self.decode = Process(recipe.decode, env, root / "decode.log", url[recipe.decode])

    def body(self, room: int, rid: str) -> dict[str, Any]:
        port = int(option(self.recipe.prefill, "--disaggregation-bootstrap-port"))
        return {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "rid": rid,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port,
            "bootstrap_room": room,
        }


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    pytest.importorskip(
        "opentelemetry.sdk.trace",
        reason="opentelemetry-sdk: scripts/setup-sglang-venv.sh installs kvconn-core[trace]",
    )
    doc = read_recipe()
    root = tmp_path_factory.mktemp("runbook")
    bound = doc.bound(root / "model", {p: free_port() for p in doc.ports()})
    subprocess.run(bound.model, check=True, timeout=600)  # the doc's line that makes the model
    servers = Servers(bound, root)
    try:
        deadline = time.monotonic() + START_S
        for server in (servers.prefill, servers.decode):
            server.wait_up(deadline)
        yield servers
    finally:
        servers.prefill.stop()
        servers.decode.stop()


def _labelled(server: Process, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return [
        (dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]


#: The metric names monitoring/'s dashboard queries.
DASHBOARD_NAMES = frozenset(
    re.findall(
        r"(?<![\w:])kvconn_[a-z0-9_]+",
        (Path(__file__).resolve().parents[2] / "monitoring/grafana/kvconn-dashboard.json").read_text(),
    )
) - {"kvconn_endpoint"}
#: A prefill rank's series at decode: from when decode first asks that instance.
PER_RANK = {
    "kvconn_abort_to_ack_seconds_bucket",
    "kvconn_ranks_down_total",
    "kvconn_prefill_rank_up",
    "kvconn_rooms_awaiting_rank",
}
#: Families whose label values only events make: dropped frames by reason,
#: messages by type, plugin hooks that raised.
EVENT_LABELLED = {"kvconn_dropped_messages_total", "kvconn_messages_total", "kvconn_plugin_errors_total"}


def _names(server: Process) -> set[str]:
    """The kvconn sample names on ``server``'s /metrics (and each gauge's)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kvconn_"):
            names.update(s.name for s in family.samples)
    return names


def _listener_pid(address: str) -> int:
    """The process listening at ``address`` (tcp://HOST:PORT), as the runbook
    finds it: ``ss -ltnp 'sport = :PORT'``."""
    port = address.rsplit(":", 1)[1]
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    (pid,) = {int(p) for p in re.findall(r"pid=(\d+)", out)}
    return pid


def _post(server: Process, body: Mapping[str, Any]) -> None:
    """POST on a thread: the answer is not what these tests look at."""
    import threading

    def post() -> None:
        with contextlib.suppress(Exception):  # an aborted request's HTTP 500, or the server stopped
            server.post("/generate", body, timeout_s=300)

    threading.Thread(target=post, daemon=True).start()


def test_the_quarantine_runbook_works_from_sglangs_own_scrapes_and_the_abort_is_traced_end_to_end(
    servers: Servers,
) -> None:
    prefill, decode = servers.prefill, servers.decode
    dec = {"kvconn_endpoint": "decode-0"}
    # Before any request, each server's /metrics has the dashboard's metrics:
    # all but a rank's own at decode (from decode's first request to it) and
    # the families whose label values only events make (the multiprocess files
    # SGLang serves hold series, not families).
    for server in (prefill, decode):
        missing = DASHBOARD_NAMES - PER_RANK - EVENT_LABELLED - _names(server)
        assert missing == set(), (server.url, missing)
    # a request that completes first: decode knows the instance, the relays ran
    warm = servers.body(7_700_100, "warm")
    _post(prefill, warm)
    answer = decode.post("/generate", warm, timeout_s=300)
    assert answer["meta_info"]["finish_reason"]["type"] == "length", answer
    wait_for(lambda: _names(decode) >= PER_RANK, 30, "the rank's own series at decode", 0.25)
    # the fault: the prefill rank stops itself half-way through the room's first chunk
    scheduler = prefill.scheduler()
    frozen = servers.body(FROZEN_ROOM, "frozen")
    _post(prefill, frozen)
    _post(decode, frozen)
    import psutil

    wait_for(
        lambda: scheduler.status() == psutil.STATUS_STOPPED, 120, "the prefill rank froze mid-write", 0.25
    )
    released_before = {lab["proof"]: v for lab, v in _labelled(decode, "kvconn_releases_total")}
    decode.post("/abort_request", {"rid": "frozen"})
    try:
        wait_for(
            lambda: sum(v for _, v in _labelled(decode, "kvconn_quarantine_oldest_seconds")) > 0,
            90,
            "no quarantine on decode's /metrics",
            0.25,
        )
        # 1. Find the rank, on decode's scrape: the address the quarantined room waits for.
        waiting = [
            (lab, v)
            for lab, v in _labelled(decode, "kvconn_rooms_awaiting_rank", state="quarantined", **dec)
            if v
        ]
        assert [(lab["rank"], v) for lab, v in waiting] == [("0", 1.0)], waiting
        address = waiting[0][0]["address"]
        # decode found it down: KvconnRankDown's series names the address
        wait_for(
            lambda: (
                [v for _, v in _labelled(decode, "kvconn_prefill_rank_up", address=address, **dec)] == [0.0]
            ),
            60,
            "decode still hears the frozen rank",
            0.25,
        )
        assert (
            sum(v for _, v in _labelled(decode, "kvconn_ranks_down_total", cause="silent", address=address))
            == 1
        )
        log = decode.log.read_text(errors="replace")
        assert f"room {FROZEN_ROOM} quarantined: " in log and f"from prefill rank 0 ({address})" in log, (
            decode.tail()
        )
        assert f"prefill rank 0 ({address}) is down: " in log, decode.tail()
        # 2. Find its server: the prefill server's own scrape names the address.
        assert [v for _, v in _labelled(prefill, "kvconn_rank_info", address=address)] == [1.0]
        # ... the process listening there, and 3. why it proves nothing: stopped.
        pid = _listener_pid(address)
        assert pid == scheduler.pid
        stat = subprocess.run(
            ["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, timeout=30
        )
        assert stat.stdout.strip().startswith("T"), stat.stdout
    finally:
        scheduler.send_signal(signal.SIGCONT)  # 4. it resumes
    wait_for(
        lambda: sum(v for _, v in _labelled(decode, "kvconn_rooms_awaiting_rank", address=address)) == 0,
        90,
        "the quarantine did not end after SIGCONT",
        0.25,
    )
    after = {lab["proof"]: v for lab, v in _labelled(decode, "kvconn_releases_total")}
    rose = {
        p: after[p] - released_before.get(p, 0.0) for p in after if after[p] != released_before.get(p, 0.0)
    }
    (proof,) = rose
    assert rose[proof] == 1.0 and proof in ("late_acks", "writer_fence"), rose
    wait_for(
        lambda: [v for _, v in _labelled(decode, "kvconn_prefill_rank_up", address=address, **dec)] == [1.0],
        60,
        "decode hears the rank again",
        0.25,
    )

    # The aborted request's trace, from inside both servers' schedulers.
    def trace() -> list[dict[str, Any]]:
        spans = read_spans(str(servers.trace_file)) if servers.trace_file.exists() else []
        roots = [
            s for s in spans if s["name"] == "kvconn.room" and s["attributes"]["kvconn.room"] == FROZEN_ROOM
        ]
        return [s for s in spans if roots and s["trace_id"] == roots[0]["trace_id"]]

    wait_for(lambda: any(s["name"] == "kvconn.rank.ack" for s in trace()), 60, "the rank's ack span", 0.25)
    spans = trace()
    assert order_errors(spans) == [], spans
    (root,) = [s for s in spans if s["parent_id"] is None]
    assert root["attributes"]["kvconn.proof"] == proof
    assert (
        {s["pid"] for s in spans if s["name"].startswith("kvconn.rank.")} == {scheduler.pid} != {root["pid"]}
    )
    assert {s["name"] for s in spans} >= {"kvconn.room", "kvconn.rank.room", "kvconn.rank.ack"}
