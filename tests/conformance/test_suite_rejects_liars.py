"""The suite rejects a transport that tells one lie, whatever its speed, and
accepts the same transport telling none (``liars/``: our own third-party
style plugin and its lying variants, registered for these tests only)."""

from __future__ import annotations

import pytest
from conformance_cli import conformance


@pytest.mark.parametrize(
    ("lie", "check", "message"),
    [
        ("wide", "test_done_barrier_means_landed[dram]", "(3000 segments) but the region does not hold"),
        ("overrun", "test_done_barrier_means_landed[dram]", "past the end of segment"),
        ("wide", "test_integrity_wide_chunks", "hold wrong bytes after SUCCESS"),
        # the overrun shows first in its room's neighbour or in a page no room held
        (
            "overrun",
            "test_integrity_wide_chunks",
            "hold wrong bytes after SUCCESS|landed outside the pages of its room",
        ),
        ("any_decode", "test_each_chunk_lands_in_its_decode", "was for decode 'a', and decode 'a'"),
        ("any_decode", "test_two_decodes_share_a_rank", "of decode 1 of 2 hold wrong bytes"),
        ("cancel", "test_failed_settled_means_nothing_lands", "landed after the answer"),
        ("late_landed", "test_writer_fence_stops_frozen_writer", "LANDED past its deadline"),
        ("fence_resume", "test_writer_fence_stops_frozen_writer", "after on_fence returned True"),
        ("outlive", "test_killed_writer_proves_exit", "processes the rank started outlived it"),
        # in a session of its own, re-parented to the suite (a child subreaper) when the rank died
        ("outlive_detached", "test_killed_writer_proves_exit", "processes the rank started outlived it"),
        ("fence_idle", "test_writer_fence_stops_frozen_writer", "after on_fence returned True"),
        ("vram", "test_vram_claim_is_device_memory", "on a host without a GPU"),
        ("vram", "test_done_barrier_means_landed[vram]", "on a host without a GPU: its rounds"),
        ("cross_host", "test_cross_host_claim", "cannot write to the region"),
    ],
)
def test_each_lie_fails_its_check(liar_env: dict[str, str], lie: str, check: str, message: str) -> None:
    keyword = check.split("[")[0].removeprefix("test_")
    code, out = conformance("liar-" + lie.replace("_", "-"), "-k", keyword, env=liar_env)
    if f"SKIPPED  {check}  (cross_host: hosts" in out:
        pytest.skip("this machine cannot make hosts (network, PID and mount namespaces need root)")
    assert code != 0, out
    assert f"FAILED   {check}" in out, out
    assert any(m in out for m in message.split("|")), out


FINAL = "test_nothing_landed_late_in_the_whole_run"


@pytest.mark.parametrize("delay_s", [6, 12])
def test_a_write_after_the_fence_past_every_watch_window_fails_the_run(
    liar_env: dict[str, str], delay_s: int
) -> None:
    """A writer that writes again ``delay_s`` after its fence (past the fence
    check's own watch, past --thorough's 10 s): the writer and its region stay
    guarded to the end of the run, whose last check names the fence check."""
    code, out = conformance(
        "liar-fence-resume", "-k", "fence_stops", "-o", f"lie_delay_s={delay_s}", env=liar_env
    )
    assert code != 0, out
    assert "PASSED   test_writer_fence_stops_frozen_writer" in out, out
    assert f"FAILED   {FINAL}" in out, out
    assert "released by test_writer_fence_stops_frozen_writer" in out, out


@pytest.mark.parametrize("delay_s", [6, 12])
def test_a_helper_writing_long_after_the_rank_died_fails_two_checks(
    liar_env: dict[str, str], delay_s: int
) -> None:
    """A copy daemon (a session of its own) that replays ``delay_s`` after the
    rank was killed: seen alive when the rank died (the suite is its
    subreaper), and, independently, its bytes found by the run's guard."""
    code, out = conformance(
        "liar-outlive-detached", "-k", "killed_writer_proves", "-o", f"lie_delay_s={delay_s}", env=liar_env
    )
    assert code != 0, out
    assert "FAILED   test_killed_writer_proves_exit" in out, out
    assert "processes the rank started outlived it" in out, out
    assert f"FAILED   {FINAL}" in out, out
    assert "released by test_killed_writer_proves_exit" in out, out


def test_a_stray_write_that_crashes_the_region_fails_a_check_naming_the_signal(
    liar_env: dict[str, str],
) -> None:
    """A transport writing past its peer's region, over what the region's own
    code reads through: the process holding the region dies of SIGSEGV. It is
    the harness's region host, not the process that gives the verdict: the
    checks fail, naming the signal and the last operation, and the run ends
    with its summary."""
    code, out = conformance("liar-stray", "-k", "integrity and one_page or done_barrier", env=liar_env)
    assert code == 1, out  # failed checks, not a crashed suite
    for check in ("test_integrity[one_page]", "test_done_barrier_means_landed[dram]"):
        assert f"FAILED   {check}" in out, out
    assert "was killed by SIGSEGV during region" in out, out
    assert "liar-stray: " in out, out  # the summary was printed


def test_the_honest_liar_passes_the_same_checks(liar_env: dict[str, str]) -> None:
    code, out = conformance(
        "liar-honest",
        "-k",
        "done_barrier or wide_chunks or two_decodes or fence_stops or failed_settled or its_decode or vram_claim or cross_host"
        " or killed_writer or frozen_owner",
        env=liar_env,
    )
    assert code == 0, out
    for check in (
        "test_done_barrier_means_landed[dram]",
        "test_integrity_wide_chunks",
        "test_two_decodes_share_a_rank",
        "test_writer_fence_stops_frozen_writer",
        "test_failed_settled_means_nothing_lands",
        "test_each_chunk_lands_in_its_decode",
        "test_killed_writer_proves_exit",
        # It settles a chunk of an already-aborted room before writing a byte
        # and answers FAILED_SETTLED: true, and no fence follows (the old
        # suite rejected it for the missing fence).
        "test_frozen_owner_gets_pages_back_only_after_drain",
        "test_frozen_owner_killed_writer_gets_pages_back_only_after_drain",
    ):
        assert f"PASSED   {check}" in out, out


def test_the_owner_fence_check_rejects_a_fence_that_only_swaps_metadata(liar_env: dict[str, str]) -> None:
    """The honest liar's owner fence (the contents moved to new memory, the
    old unlinked) passes; the lie (new metadata, same memory) fails: the
    resumed writer's bytes land after the fence. Paced, so that the copy is
    still running when the suite freezes the writer."""
    paced = ("-o", "pace_s=0.0002")
    code, out = conformance("liar-honest", "-k", "owner_fence", *paced, env=liar_env)
    assert code == 0, out
    assert "PASSED   test_owner_fence_stops_frozen_writer  (fence " in out, out
    assert " 0 bytes after it in " in out, out
    code, out = conformance("liar-owner-fence", "-k", "owner_fence", *paced, env=liar_env)
    assert code != 0, out
    assert "FAILED   test_owner_fence_stops_frozen_writer" in out, out
    assert "the fence does not stop a resumed writer" in out, out
