"""Every interleaving of small worlds, on the real core and on its mutants."""

from __future__ import annotations

import explore
import mutants
import pytest

from kvconn.protocol.hold import HoldTracker

CONFIGS = [
    # 2 ranks x 2 chunks, one ERR (settled or not) anywhere, clear, fence and
    # abort at every point; decode's deadline is explored in the next ones.
    dict(ranks=2, chunks=2, errors=1, deadline=False),
    # the two biggest worlds (about a minute each on 2 cores) are slow: the
    # smaller ones below and the mutant tests' worlds keep CI's 30 minutes
    pytest.param(dict(ranks=2, chunks=1, errors=1, deadline=True, reuse=False), marks=pytest.mark.slow),
    dict(ranks=1, chunks=3, errors=2, deadline=True),
    # one rank serves the room to two decodes (prefill TP < decode TP), each
    # aborting at any point; ERRs, fences, clears and reuse on either lane
    pytest.param(dict(ranks=1, chunks=2, errors=1, deadline=False, decodes=2), marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    "config",
    CONFIGS,
    ids=lambda c: "{ranks}r{chunks}c{errors}e{deadline}".format(**c) + "2d" * (c.get("decodes") == 2),
)
def test_core_is_safe_in_every_interleaving(
    config: dict[str, int | bool], capsys: pytest.CaptureFixture[str]
) -> None:
    report = explore.explore(**config)  # type: ignore[arg-type]
    with capsys.disabled():
        print(
            f"\n  explored {config}: {report.states} states, {report.transitions} transitions, "
            f"{report.terminals} terminal interleavings"
        )
    assert report.terminals > 0 and report.states > 1000
    assert report.reuses > 0 or not config.get("reuse", True)  # a rank took the reused id anew


@pytest.mark.slow
def test_core_is_safe_2x2_with_deadline() -> None:
    report = explore.explore(ranks=2, chunks=2, errors=1, deadline=True)
    print(report)
    assert report.states > 500_000


# Each mutant is one change the brief says breaks safety; the named test for
# each fails (the explorer raises Violation) if the real core had that bug.
CAUGHT = {
    "test_invariant_D_count_deleted": mutants.NoDequeueCount,
    "test_invariant_D_count_after_status_check": mutants.CountAfterCheck,
    "test_cleared_room_acked_ignoring_count": mutants.AckClearedIgnoringCount,
    "test_err_with_write_in_flight_uncounts": mutants.ErrAlwaysUncounts,
    "test_unknown_room_acked_without_tombstone": mutants.AckUnknownAtOnce,
    "test_invariant_F_register_before_failed_without_ack_guard": mutants.RegisterBeforeFailedNoGuard,
    "test_chunk_of_a_reused_rooms_earlier_request_written": mutants.DequeueIgnoresIncarnation,
    "test_failed_room_reused_before_it_drained": mutants.ReuseFailedRoomAtOnce,
}


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_mutant_is_caught(name: str) -> None:
    with pytest.raises(explore.Violation) as info:
        for config in (dict(ranks=1, chunks=2, errors=1), dict(ranks=2, chunks=1, errors=1)):
            explore.explore(**config, ledger_factory=CAUGHT[name])  # type: ignore[arg-type]
    assert str(info.value).startswith(("S1", "S2"))


def test_acking_one_decode_on_the_other_decodes_count_is_caught() -> None:
    # One rank writes the room into two decodes: an ack to one decode must
    # wait for that decode's own writes, whatever the other decode's count.
    with pytest.raises(explore.Violation) as info:
        explore.explore(ranks=1, chunks=1, errors=0, decodes=2, ledger_factory=mutants.AckOnOtherDecodesCount)
    assert str(info.value).startswith("S1")
    # the same world on the real core is safe
    assert explore.explore(ranks=1, chunks=1, errors=0, decodes=2).terminals > 0


def test_register_before_failed_is_harmless_only_while_ack_demands_failed() -> None:
    # The brief: "Register before Failed is only harmless because try-to-ack
    # also demands Failed". With that guard kept, exploration finds nothing...
    explore.explore(ranks=1, chunks=2, errors=1, ledger_factory=mutants.RegisterBeforeFailed)
    # ...and dropping it as well is caught (test_mutant_is_caught above).
    with pytest.raises(explore.Violation):
        explore.explore(ranks=1, chunks=2, errors=1, ledger_factory=mutants.RegisterBeforeFailedNoGuard)


def test_decode_accepting_any_generation_is_caught() -> None:
    # An ack of an earlier hold of the same room (a reused id) must not count:
    # replay rank 0's ack of hold 1 into hold 2 of the same room id.
    def run(tracker: HoldTracker) -> list[object]:
        tracker.open(1, (0,), frozenset({0}))
        old = tracker.abort(1, now=0.0)[0].abort  # type: ignore[union-attr]
        from kvconn.protocol.messages import AbortAck

        tracker.ack(AbortAck(1, 0, old.generation, False), now=0.0)  # hold 1 released
        tracker.open(1, (0,), frozenset({0}))
        tracker.abort(1, now=0.0)
        return list(tracker.ack(AbortAck(1, 0, old.generation, False), now=0.0))

    kept = run(explore.default_tracker())
    assert [type(a).__name__ for a in kept] == ["Dropped"]
    broken = run(mutants.AcceptAnyGeneration("decode", "reply", abort_timeout=10.0))
    assert [type(a).__name__ for a in broken] == ["Release"]


def test_one_ack_target_per_room_id_is_caught_with_two_decodes() -> None:
    """A ledger keeping one ack target per room id (not per (decode, room)):
    with both decodes' ABORTs pending, the first decode is never acked and its
    pages stay held although every write settled (L2)."""
    with pytest.raises(explore.Violation) as info:
        explore.explore(
            ranks=1,
            chunks=1,
            errors=0,
            deadline=False,
            decodes=2,
            ledger_factory=mutants.OneAckTargetPerRoomId,
        )
    assert str(info.value).startswith("L2")
    # ...and a one-decode world cannot see it
    explore.explore(ranks=1, chunks=2, errors=1, ledger_factory=mutants.OneAckTargetPerRoomId)
