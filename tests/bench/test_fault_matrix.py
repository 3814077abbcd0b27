"""How the fault matrix (``kvconn.testing.scenarios``) judges what it
measures: a false rank-down, a hung or failed request, pinned page-seconds,
how long pages stayed held after a proof, the targets a kvconn row missed;
and that its CPU hogs go by pid. The rows themselves run end to end in
``test_bench.py``."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvconn.config import Config
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing import scenarios
from kvconn.testing.matrix_decode import Client
from kvconn.testing.matrix_row import EVIDENCE_S, Hogs, Outcome, capacity_back, false_downs, page_seconds
from kvconn.testing.null import NullBackend
from kvconn.testing.pages import CanaryPages

WAIT_S = 10.0


def test_a_rank_down_is_false_when_no_fault_touched_that_rank_before_the_call() -> None:
    frozen = [(0, 10.0, 12.0)]  # rank 0 frozen from 10 s to 12 s
    assert false_downs(frozen, [{"rank": 0, "at": 11.0}]) == 0  # during the freeze
    assert false_downs(frozen, [{"rank": 0, "at": 12.0 + EVIDENCE_S - 0.01}]) == 0  # on its evidence
    assert false_downs(frozen, [{"rank": 0, "at": 12.0 + EVIDENCE_S + 0.01}]) == 1  # alive long enough
    assert false_downs(frozen, [{"rank": 0, "at": 9.9}]) == 1  # before it
    assert false_downs(frozen, [{"rank": 1, "at": 11.0}]) == 1  # another rank, alive and reachable
    everyone = [(None, 10.0, 12.0)]  # a partition of every rank
    assert false_downs(everyone, [{"rank": 1, "at": 11.0}, {"rank": 0, "at": 11.5}]) == 0
    killed = [(0, 10.0, None)]  # for good
    assert false_downs(killed, [{"rank": 0, "at": 500.0}]) == 0
    assert false_downs([], [{"rank": 0, "at": 1.0}, {"rank": 1, "at": 2.0}]) == 2  # overload: no fault


def test_page_seconds_integrate_the_held_pages() -> None:
    series = [(0.0, 0), (1.0, 8), (3.0, 4), (4.0, 0)]
    assert page_seconds(series, 10.0) == pytest.approx(8 * 2 + 4 * 1)
    assert page_seconds(series, 2.0) == pytest.approx(8 * 1)  # cut at the end (a killed decode)
    assert page_seconds([(0.0, 5)], 3.0) == pytest.approx(15)  # still held at the end
    assert page_seconds([], 3.0) == 0.0


def test_pages_held_after_a_proof_count_from_the_proof_or_their_abort_whichever_is_later() -> None:
    proof = 10.0
    # aborted at 7, released at 12: held 2 s past the proof
    assert capacity_back([{"t": 12.0, "held_for": 5.0}], proof) == pytest.approx(2.0)
    # aborted at 11 (after the proof), released at 11.3: 0.3 s
    assert capacity_back([{"t": 11.3, "held_for": 0.3}], proof) == pytest.approx(0.3)
    # released before the proof (the timeout-only mode frees at its deadline): 0
    assert capacity_back([{"t": 9.0, "held_for": 2.0}], proof) == 0.0
    # the longest of them
    rooms = [{"t": 12.0, "held_for": 5.0}, {"t": 14.5, "held_for": 4.0}, {"t": 10.5, "held_for": 0.1}]
    assert capacity_back(rooms, proof) == pytest.approx(4.0)
    assert capacity_back([], proof) == 0.0


def _row(**kw: Any) -> Outcome:
    base = dict(requests=20, answered=10, capacity_back_s=0.2)
    return Outcome("frozen", kw.pop("mode", "kvconn"), 4.0, **(base | kw))


def test_misses_name_every_target_a_kvconn_row_missed() -> None:
    legacy = _row(mode="legacy")
    assert scenarios.misses(_row(), legacy) == ()
    assert scenarios.misses(_row(corrupted=2), legacy) == ("2 pages corrupted",)
    assert scenarios.misses(_row(hung=3, hung_prefill=1), legacy) == ("3 hung (1 at prefill)",)
    assert scenarios.misses(_row(false_rank_downs=1), legacy) == ("1 false rank-downs",)
    assert scenarios.misses(_row(capacity_back_s=1.5), legacy) == ("pages back after 1.50 s (> 1 s)",)
    still = _row(capacity_back_s=None, capacity_note="16 pages still held 6.0 s after the proof")
    assert scenarios.misses(still, legacy) == ("pages 16 pages still held 6.0 s after the proof",)
    assert scenarios.misses(_row(capacity_back_s=None, capacity_note="n/a: decode died"), legacy) == ()
    # answered: one request's difference is the run-to-run spread; two is a miss
    assert scenarios.misses(_row(answered=9), legacy) == ()
    assert scenarios.misses(_row(answered=8), legacy) == ("answered 8 of 20 < timeout-only's 10 of 20",)
    assert scenarios.misses(_row(error="boom"), legacy) == ("did not complete: boom",)
    assert scenarios.misses(_row(corrupted=1, skipped="needs root"), legacy) == ()


def test_unknown_faults_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="unknown faults"):
        scenarios.run(["frozen", "meteor"])
    assert set(scenarios.SHORT) <= set(scenarios.FAULTS)
    assert all(scenarios.MATRIX[f].bound_s > scenarios.PEER_S for f in scenarios.FAULTS)


# -- the decode process's client, in this process ------------------------------------
def null_pair(fail_rooms: bool) -> tuple[DecodeEndpoint, CanaryPages, PrefillRank]:
    """A decode endpoint and one rank that moves no bytes (and, with
    ``fail_rooms``, fails every room it is asked for, at once)."""
    config = Config(write_timeout_s=0.2, abort_timeout_s=30.0)
    ranks: list[PrefillRank] = []

    def on_request(room: int, npages: int) -> None:
        if fail_rooms:  # as an engine does: off the rank's own thread
            threading.Thread(target=ranks[0].fail_room, args=(room, "injected prefill failure")).start()

    ranks.append(PrefillRank(NullBackend(), 0, 16 * 4096, config, on_request=on_request))
    decode = DecodeEndpoint(NullBackend(), 16, 4096, [ranks[0].address], config)
    return decode, CanaryPages(decode.region, 16, 4096), ranks[0]


@pytest.fixture
def quiet() -> Iterator[tuple[DecodeEndpoint, CanaryPages]]:
    decode, pages, rank = null_pair(fail_rooms=False)
    yield decode, pages
    decode.close()
    rank.close()


@pytest.fixture
def failing() -> Iterator[tuple[DecodeEndpoint, CanaryPages]]:
    decode, pages, rank = null_pair(fail_rooms=True)
    yield decode, pages
    decode.close()
    rank.close()


def _events(capsys: pytest.CaptureFixture[str], seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen += [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return seen


def _ended(capsys: pytest.CaptureFixture[str], n: int) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + WAIT_S
    while len([e for e in _events(capsys, seen) if e.get("event") == "request"]) < n:
        assert time.monotonic() < deadline, f"{n} requests did not end: {seen}"
        time.sleep(0.02)
    return [e for e in seen if e.get("event") == "request"]


def test_a_request_no_rank_writes_hangs_at_its_bound(
    quiet: tuple[DecodeEndpoint, CanaryPages], capsys: pytest.CaptureFixture[str]
) -> None:
    decode, pages = quiet
    client = Client(decode, pages)
    client.start(rate=100.0, npages=4, bound_s=0.3, count=1)
    (ended,) = _ended(capsys, 1)
    assert ended["outcome"] == "hung" and "still transferring" in ended["reason"]
    assert ended["tries"] == 1 and ended["t"] - ended["arrived"] >= 0.3


def test_a_request_that_fails_with_a_reason_is_tried_once_more_then_failed(
    failing: tuple[DecodeEndpoint, CanaryPages], capsys: pytest.CaptureFixture[str]
) -> None:
    decode, pages = failing
    client = Client(decode, pages)
    client.start(rate=100.0, npages=4, bound_s=5.0, count=2)
    ended = _ended(capsys, 2)
    assert [e["outcome"] for e in ended] == ["failed", "failed"]
    assert all(e["tries"] == 2 and "injected prefill failure" in e["reason"] for e in ended)
    assert client.open_count() == 0


def test_no_free_pages_past_the_bound_is_a_hang(
    quiet: tuple[DecodeEndpoint, CanaryPages], capsys: pytest.CaptureFixture[str]
) -> None:
    decode, pages = quiet
    pages.take(14)  # two pages left, a request wants four
    client = Client(decode, pages)
    client.start(rate=100.0, npages=4, bound_s=0.2, count=1)
    (ended,) = _ended(capsys, 1)
    assert ended["outcome"] == "hung" and "no free pages" in ended["reason"] and ended["tries"] == 0


def test_cpu_hogs_are_shared_by_both_modes_and_killed_by_pid() -> None:
    hogs = Hogs(per_cpu=1)
    try:
        hogs.on()
        hogs.on()  # the other mode's thread
        pids = hogs.pids()
        assert len(pids) == os.cpu_count() and all(os.path.exists(f"/proc/{p}") for p in pids)
        hogs.off()
        assert hogs.pids() == pids and all(os.path.exists(f"/proc/{p}") for p in pids)  # one mode left
        hogs.off()
        assert hogs.pids() == [] and not any(os.path.exists(f"/proc/{p}") for p in pids)
    finally:
        hogs.close()
