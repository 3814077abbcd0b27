"""How ``scripts/engine_faults.py`` judges one fault, with stand-in engines
(no server, no namespace): what it counts as answered, corrupted, failed
(and failed after the fault cleared), hung; the page-seconds decode held;
how long after the fault cleared its held pages were back; rank-downs, and
which of them are false (no fault on)."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "engine_faults.py"


@pytest.fixture(scope="module")
def ef() -> Any:
    spec = importlib.util.spec_from_file_location("engine_faults", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_faults"] = module
    spec.loader.exec_module(module)
    return module


class StandIn:
    """A deployment whose answers and decode figures the test scripts."""

    def __init__(self, ef: Any) -> None:
        self.prompts = ["a", "b"]
        self.reference = {0: "A", 1: "B"}
        self.handoff = threading.Event()
        self.held = 0.0
        self.downs = 0.0
        self.mode = "ok"
        self.prefills: list[Any] = []
        self.decode = type("S", (), {"proc": None})()

    def ask(self, index: int, timeout_s: float) -> Any:
        self.handoff.set()
        time.sleep(0.02)
        if self.mode == "fail":
            raise RuntimeError("rank 0 is down")
        if self.mode == "wrong" and index == 1:
            return "not B"
        return self.reference[index]

    def decode_metrics(self) -> dict[str, float]:
        return {"pages_held": self.held, "rank_downs": self.downs, "proof:writer_fence": 0.0}


def _fault(ef: Any, run: Any, **kw: Any) -> Any:
    return ef.Fault("f", run, 1.0, before_s=0.2, after_s=0.6, **kw)


def test_a_fault_that_holds_pages_until_after_it_cleared_is_judged(
    ef: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ef, "_restore", lambda d: None)
    d = StandIn(ef)
    monitor = ef.Monitor(d)
    try:

        def run(dd: StandIn) -> float:
            dd.held, dd.downs, dd.mode = 4.0, 1.0, "fail"
            time.sleep(0.5)
            cleared = time.monotonic()
            threading.Timer(0.5, lambda: setattr(dd, "held", 0.0)).start()  # back 0.5 s after
            dd.mode = "ok"
            return cleared

        row = ef.run_fault(d, monitor, _fault(ef, run), 1.0)
    finally:
        monitor.close()
    assert row.requests == row.answered + row.failed and row.failed >= 1 and row.answered >= 1
    assert row.failed_after == 0 and row.reasons == {"RuntimeError": row.failed}
    assert row.corrupted == 0 and row.hung == 0
    assert row.rank_downs == 1 and row.false_rank_downs == 0  # a fault was on
    assert row.max_pages_held == 4.0 and 0.3 <= row.capacity_back_s <= 1.5
    assert 2.0 <= row.pinned_page_seconds <= 8.0  # 4 pages for about a second


def test_wrong_answers_are_corrupted_and_a_rank_down_with_no_fault_is_false(
    ef: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ef, "_restore", lambda d: None)
    d = StandIn(ef)
    d.mode = "wrong"
    monitor = ef.Monitor(d)
    try:

        def run(dd: StandIn) -> float:
            dd.downs = 2.0
            time.sleep(0.3)
            return time.monotonic()

        row = ef.run_fault(d, monitor, _fault(ef, run, no_fault=True, sync=False), 1.0)
    finally:
        monitor.close()
    assert row.corrupted >= 1 and row.corrupted < row.answered  # prompt "b" only
    assert row.false_rank_downs == 2 and row.capacity_back_s == 0.0 and row.pinned_page_seconds == 0.0
