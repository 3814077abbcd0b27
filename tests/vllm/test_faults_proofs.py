"""kvconn_vllm.faults.scenarios: the release proofs a fault row reports are
the ones counted during that fault (no engine: stand-ins answer stats)."""

from __future__ import annotations

from typing import Any

from kvconn_vllm.faults.scenarios import FaultRun, Settings


class StandInEngine:
    """Answers what FaultRun asks of an engine between steps."""

    def __init__(self, pid: int, proofs: dict[str, int]) -> None:
        self.pid = pid
        self.proofs = dict(proofs)

    def alive(self) -> bool:
        return True

    def stopped(self) -> bool:
        return False

    def watch(self, on: bool) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"used_blocks": 0, "held_blocks": {}, "late_writes": [], "proofs": dict(self.proofs)}

    def call(self, command: str, **_: Any) -> dict[str, Any]:
        assert command == "stats"
        return self.stats()


class StandInPair:
    label = "kvconn (stand-in)"

    def __init__(self) -> None:
        self.prefill = StandInEngine(100, {})
        self.decode = StandInEngine(200, {"acks": 4, "completed": 1})


def run() -> tuple[FaultRun, StandInPair]:
    pair = StandInPair()
    return FaultRun(pair, lambda tokens: tokens, Settings(lease_s=6.0)), pair  # type: ignore[arg-type]


def test_a_row_counts_only_the_proofs_of_its_own_fault() -> None:
    faults, pair = run()
    # What earlier faults counted (acks 4, completed 1) is not this row's.
    result, base, t0 = faults._begin("abort")
    pair.decode.proofs["acks"] += 1
    pair.decode.proofs["late_acks"] = 2
    faults._sample(result, base, t0)
    assert result.proofs == {"decode:acks": 1, "decode:late_acks": 2}
    # The next fault starts from the counters where this one left them.
    result, base, t0 = faults._begin("prefill_frozen")
    faults._sample(result, base, t0)
    assert result.proofs == {}


def test_an_engine_started_during_the_fault_counts_from_zero() -> None:
    faults, pair = run()
    pair.prefill.proofs = {"writer_exit": 3}
    result, base, t0 = faults._begin("prefill_restarted")
    # The prefill that was there at the start is killed; a new one (another
    # pid, its counters from zero) counts one proof during the fault.
    pair.prefill = StandInEngine(101, {"writer_exit": 1})
    faults._sample(result, base, t0)
    assert result.proofs == {"prefill:writer_exit": 1}
