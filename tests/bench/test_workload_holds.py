"""The abort bench's accounting when decode fails rooms on its own (a rank
found down or restarted): their held pages (``held_exceeds_aborted``) and
their release (``unexpected_release``) are kvconn's, not violations."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import attrs

from kvconn.bench.mode_result import ModeResult
from kvconn.bench.workload import ModeRun, _Aborted, _Active
from kvconn.protocol.hold import Proof
from kvconn.protocol.ledger import KVPoll


@attrs.define
class _Rx:
    state: KVPoll

    def poll(self) -> KVPoll:
        return self.state


@attrs.define
class _Region:
    def write(self, offset: int, data: bytes) -> None:
        pass


@attrs.define
class _Decode:
    held: int
    region: _Region = attrs.Factory(_Region)

    def held_pages(self) -> int:
        return self.held


@attrs.frozen
class _Release:
    room: int
    pages: tuple[int, ...]
    proof: Proof = Proof.ACKS


def _run(held: int, active: dict[int, KVPoll], aborted: dict[int, int]) -> ModeRun:
    """A ModeRun's accounting alone (no processes): rooms in flight of 16
    pages each with their receivers' states, and rooms the bench aborted."""
    run = ModeRun.__new__(ModeRun)
    run._lock = threading.RLock()
    run.result = ModeResult("kvconn")
    run.decode = _Decode(held)  # type: ignore[assignment]
    run._active = {
        room: _Active(_Rx(state), tuple(range(room * 16, room * 16 + 16)), 0.0, None)  # type: ignore[arg-type]
        for room, state in active.items()
    }
    run._aborted = {room: _Aborted(room, pages, 0.0, "decode") for room, pages in aborted.items()}
    run._held_expected = sum(aborted.values())
    run._released_unpolled = set()
    run._free, run._owner, run._canary, run._now = [], {}, b"", lambda: 0.0
    run.wl = SimpleNamespace(page_bytes=8)  # type: ignore[assignment]
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


def test_a_room_decode_failed_and_released_before_the_loop_polled_it() -> None:
    # Room 2 failed at decode (a rank found down); its pages came back on
    # proof before the bench's loop saw it FAILED.
    run = _run(0, {2: KVPoll.FAILED, 4: KVPoll.TRANSFERRING}, {})
    run._on_release(_Release(2, run._active[2].pages))  # type: ignore[arg-type]
    assert run.result.violations == [] and run.result.releases_by_proof == {"acks": 1}
    run._failed(2, run._active[2])  # the loop polls it: counted, not aborted again
    assert run._aborted == {} and run._held_expected == 0
    # A room in flight that decode did not fail is released only if aborted.
    run._on_release(_Release(4, run._active[4].pages))  # type: ignore[arg-type]
    (v,) = run.result.violations
    assert v.kind == "unexpected_release" and v.room == 4
