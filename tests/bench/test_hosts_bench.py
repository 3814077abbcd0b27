"""``kvconn bench --hosts``: decode and the ranks on different hosts (network,
PID and mount namespaces on this machine), one fault between hosts, and the
figures that must hold; plus the one-line refusals."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from bench_doc import undocumented

from kvconn.bench import cli, hosts_run
from kvconn.testing import host_faults, hosts, waiting
from kvconn.testing.libraries import why_unavailable

SHORT = [
    "--requests", "16", "--pages", "8", "--page-bytes", "16384", "--chunk-pages", "2",
    "--stream-requests", "8", "--concurrency", "4", "--settle-s", "0.2", "--drain-s", "3",
    "--no-progress", "--hosts", "3", "--host-faults", "partition", "--modes", "kvconn",
]  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_partition_across_hosts_corrupts_nothing_in_kvconn_mode(tmp_path: Path) -> None:
    if hosts.unavailable():
        pytest.skip(hosts.unavailable())
    if why_unavailable("nixl"):
        pytest.skip(f"nixl: {why_unavailable('nixl')}")
    out = tmp_path / "hosts.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvconn.cli", "bench", "--backend", "nixl", *SHORT, "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = waiting.communicate(proc, 50)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the bench tears its hosts down
        stdout, stderr = waiting.communicate(proc, 15)
        pytest.fail(f"the bench took over 50 s: {stdout}{stderr[-2000:]}")
    assert proc.returncode == 0, stdout + stderr[-2000:]
    rep = json.loads(out.read_text())
    assert not undocumented(rep), "fields docs/bench.md does not explain"
    for placement in (hosts_run.ONE_HOST, hosts_run.ACROSS):
        summary = rep["runs"][placement]["summary"]
        assert summary["violations"] == [] and summary["requests"] == 16
        assert summary["rooms_unreleased_end"] == 0
    assert rep["runs"][hosts_run.ACROSS]["rank_hosts"] == ["prefill0", "prefill1"]
    assert rep["runs"][hosts_run.ONE_HOST]["rank_hosts"] == ["decode", "decode"]
    assert rep["link_rtt_ms"] > 0 and set(rep["goals"]) == {"p99_met", "throughput_met"}
    # kvconn's mode only (--modes kvconn keeps the test short): no late write
    # landed, and the pages came back by a proof, not at the deadline.
    [kvconn] = rep["faults"]
    assert kvconn["fault"] == "partition" and kvconn["mode"] == "kvconn"
    assert kvconn["corrupted_pages"] == 0 and kvconn["held_pages"] == 0
    assert kvconn["back_s"] is not None and kvconn["proof"] not in ("", "unsafe_timeout")
    assert kvconn["others_failed"] == 0 and kvconn["others_wrong"] == 0 and kvconn["others_done"] > 0


def test_without_root_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts, "unavailable", lambda: "hosts (network, PID and mount namespaces) need root")
    with pytest.raises(RuntimeError, match=r"^--hosts: hosts .* need root$"):
        hosts_run.check(_args("--backend", "nixl", "--hosts", "2"), {})


def test_loopback_is_same_host_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts, "unavailable", lambda: "")
    with pytest.raises(ValueError, match=r"loopback does not cross hosts.*same-host only"):
        hosts_run.check(_args("--backend", "loopback", "--hosts", "3"), {})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--hosts", "1"), "at least 2"),
        (("--hosts", "2", "--host-faults", "partition,flood"), "unknown flood"),
    ],
)
def test_bad_values(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hosts_run.check(_args("--backend", "nixl", *argv), {})


def test_owner_fence_is_set_only_where_config_has_it() -> None:
    @attrs.frozen
    class Before:
        abort_timeout_s: float = 1.0

    @attrs.frozen
    class After:
        abort_timeout_s: float = 1.0
        owner_fence_after_s: float | None = None

    assert host_faults.owner_fence_config(2.0, Before) == {}
    assert host_faults.owner_fence_config(2.0, After) == {"owner_fence_after_s": 2.0}
    After(**host_faults.owner_fence_config(2.0, After))  # a Config that takes it
