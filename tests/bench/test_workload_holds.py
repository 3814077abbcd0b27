"""The abort bench's check that kvconn holds no more pages than aborted rooms
explain (``held_exceeds_aborted``), when decode fails rooms on its own."""

from __future__ import annotations

import threading

import attrs

from kvconn.bench.mode_result import ModeResult
from kvconn.bench.workload import ModeRun, _Active, _Aborted
from kvconn.protocol.ledger import KVPoll


@attrs.define
class _Rx:
    state: KVPoll

    def poll(self) -> KVPoll:
        return self.state


@attrs.define
class _Decode:
    held: int

    def held_pages(self) -> int:
        return self.held


def _run(held: int, active: dict[int, KVPoll], aborted: dict[int, int]) -> ModeRun:
    """A ModeRun's accounting alone (no processes): rooms in flight of 16
    pages each with their receivers' states, and rooms the bench aborted."""
    run = ModeRun.__new__(ModeRun)
    run._lock = threading.RLock()
    run.result = ModeResult("kvconn")
    run.decode = _Decode(held)  # type: ignore[assignment]
    run._active = {
        room: _Active(None, _Rx(state), tuple(range(room * 16, room * 16 + 16)), 0.0, None)  # type: ignore[arg-type]
        for room, state in active.items()
    }
    run._aborted = {room: _Aborted(room, pages, 0.0, "decode") for room, pages in aborted.items()}
    run._held_expected = sum(aborted.values())
    return run


def test_rooms_decode_failed_itself_hold_their_pages_without_a_violation() -> None:
    # Room 1 the bench aborted; rooms 2 and 3 decode failed (a rank found
    # down) before the bench's loop polled them; room 4 is still in flight.
    states = {1: KVPoll.FAILED, 2: KVPoll.FAILED, 3: KVPoll.FAILED, 4: KVPoll.TRANSFERRING}
    run = _run(48, states, {1: 16})
    run._sample()
    assert run.result.violations == []
    assert run.result.peak_pages_held == 48 and run.result.peak_pages_aborted_unreleased == 48


def test_a_hold_no_failed_room_explains_is_still_a_violation() -> None:
    run = _run(64, {1: KVPoll.FAILED, 2: KVPoll.FAILED, 4: KVPoll.TRANSFERRING}, {1: 16})
    run._sample()
    (v,) = run.result.violations
    assert v.kind == "held_exceeds_aborted" and v.detail == "kvconn holds 64 pages, aborted rooms 32"
