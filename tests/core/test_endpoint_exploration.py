"""Every interleaving of small worlds on the decode endpoint's state machine
(``explore_endpoint.py``; its bootstrap: ``explore_bootstrap.py``), and on
its mutants (``endpoint_mutants.py``)."""

from __future__ import annotations

import endpoint_mutants as mutants
import explore_bootstrap
import explore_endpoint as explore
import pytest

from kvconn.protocol.endpoint import EndpointState

L = explore.Limits
ONE = (("p0",),)
WORLDS = {
    # a rank's process exits at any point (its bytes drain later), heartbeats tick
    "liveness": (ONE, L(ticks=2, exits=1, requests_per_room=1)),
    # the rank's process freezes at any point, maybe for good (it answers no Hello)
    "silence": (ONE, L(ticks=2, freezes=1, requests_per_room=1)),
    # with control links reported: the rank's process starved (load: its link stays up)
    # at any point, for a while; it is never called down for it (F)
    "load": (ONE, L(ticks=3, starves=1, links=True, requests_per_room=1)),
    # ... starved and frozen at any points: load is no silence, a freeze still is
    "load_and_freeze": (ONE, L(ticks=2, starves=1, freezes=1, links=True, aborts=1, requests_per_room=1)),
    # ... exits, with its link lost: its rooms end, a request after the loss waits or fails
    "liveness_links": (ONE, L(ticks=2, exits=1, links=True, requests_per_room=1)),
    # ... a new process takes the address at any point: no request is sent blind (F), and
    # one that waited goes to the process that answered
    "restart_links": (ONE, L(ticks=2, restarts=1, links=True, requests_per_room=1)),
    # a new process takes the rank's address at any point, the earlier one writes on
    "restart": (ONE, L(ticks=2, restarts=1, requests_per_room=1)),
    # two instances, a room on each, one rank's process exits
    "routing": (
        (("a0",), ("b0",)),
        L(rooms=((1, 0), (2, 1)), ticks=1, exits=1, requests_per_room=1, aborts=1),
    ),
    # the room id reused once its pages are back; acks after a fence wait for the drain
    "reuse": (ONE, L(ticks=2, fenced=True, requests_per_room=2)),
    # a transfer deadline passes at any point
    "deadline": (ONE, L(ticks=3, transfer_timeout_s=1.5, requests_per_room=1)),
    # the engine drains the endpoint at any point, its writer may freeze for good: the
    # grace's end aborts what is left, the report comes and says what is held
    "decode_drain": (ONE, L(ticks=2, decode_drain=True, freezes=1, aborts=1, requests_per_room=1)),
    # the rank's process drains at any point (refuses, fails what is left, says done)
    "drain": (ONE, L(ticks=1, fenced=True, drains=1, requests_per_room=2, aborts=1)),
    # a rank process drains before, during or after an owner fence: it announces to every
    # decode name whose Hello it took; safety and liveness of both hold together
    "drain_owner_fence": (ONE, L(ticks=3, aborts=1, drains=1, owner_fence_after_s=1.0, requests_per_room=1)),
    # a writer frozen (or its acks late) past the deadline: the owner fence, ok or failing,
    # against late acks and heartbeats; then the room id reused under the new name
    "owner_fence": (ONE, L(ticks=3, aborts=1, freezes=1, owner_fence_after_s=1.0, fence_fails=1)),
    # a room quarantined (its ack late) while another is in flight on the same rank, which
    # stays up (no heartbeat but the Hello after the fence)
    "owner_fence_in_flight": (
        ONE,
        L(
            rooms=((1, 0), (2, 0)),
            ticks=3,
            aborts=1,
            owner_fence_after_s=1.0,
            requests_per_room=1,
            heartbeat_interval_s=10.0,
            peer_timeout_s=20.0,
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_endpoint_is_safe_in_every_interleaving(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    instances, limits = WORLDS[name]
    report = explore.explore(instances, limits)
    with capsys.disabled():
        print(f"\n  explored endpoint world {name}: {report.states} states, {report.transitions} transitions")
    assert report.terminals > 0 and report.states > 300


# Each mutant is one change that breaks a rule; the explorer must catch it in
# the world that exercises that rule (and the real machine passes there).
CAUGHT: dict[str, tuple[type[EndpointState], str, L, str]] = {
    "ack_of_a_restarted_process_counts": (
        mutants.AckOfAnySession,
        "p0",
        L(ticks=2, restarts=1, requests_per_room=1),
        "S",
    ),
    "exit_counts_before_drain": (
        mutants.ExitWithoutDrain,
        "p0",
        L(ticks=2, exits=1, requests_per_room=1),
        "S",
    ),
    "fenced_ack_counts_before_drain": (
        mutants.FencedAckAtOnce,
        "p0",
        L(ticks=1, fenced=True, requests_per_room=1),
        "S",
    ),
    "drained_proves_fenced_rooms": (
        mutants.DrainedProvesFencedRooms,
        "p0",
        L(ticks=1, fenced=True, drains=1, requests_per_room=1, aborts=1),
        "S",
    ),
    "failed_owner_fence_releases": (mutants.FailedOwnerFenceReleases, "p0", WORLDS["owner_fence"][1], "S"),
    "owner_fence_leaves_rooms_in_flight": (
        mutants.OwnerFenceLeavesRoomsInFlight,
        "p0",
        WORLDS["owner_fence_in_flight"][1],
        "L",
    ),
    "decode_drain_grace_never_ends": (mutants.DrainGraceNeverEnds, "p0", WORLDS["decode_drain"][1], "L"),
    "decode_drain_reports_drained_at_grace_end": (
        mutants.DrainReportsAtGraceEnd,
        "p0",
        WORLDS["decode_drain"][1],
        "S",
    ),
    "decode_drain_waits_for_every_page": (
        mutants.DrainWaitsForEveryPage,
        "p0",
        WORLDS["decode_drain"][1],
        "L",
    ),
    # the engine never aborts: only liveness can end a room whose writer died or froze
    "heartbeats_watch_no_rank": (
        mutants.WatchesNoRank,
        "p0",
        L(ticks=2, exits=1, aborts=0, requests_per_room=1),
        "L",
    ),
    "silent_rank_never_down": (
        mutants.SilentNeverDown,
        "p0",
        L(ticks=2, freezes=1, aborts=0, requests_per_room=1),
        "L",
    ),
    # control links (issue 40): load is no silence, no request sent blind, none left waiting
    "links_ignored": (mutants.LinksIgnored, "p0", WORLDS["load"][1], "F"),
    "sends_blind": (mutants.SendsBlind, "p0", WORLDS["restart_links"][1], "F"),
    "waiting_never_sent": (
        mutants.WaitingNeverSent,
        "p0",
        L(ticks=2, restarts=1, links=True, aborts=0, requests_per_room=1),
        "L",
    ),
    "restart_leaves_old_rooms_open": (
        mutants.RestartKeepsOldRooms,
        "p0",
        L(ticks=2, restarts=1, aborts=0, requests_per_room=1),
        "L",
    ),
}


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_endpoint_mutant_is_caught(name: str) -> None:
    factory, address, limits, rule = CAUGHT[name]
    with pytest.raises(explore.Violation) as info:
        explore.explore(((address,),), limits, factory)
    assert str(info.value).startswith(rule)
    if (((address,),), limits) not in WORLDS.values():  # else explored there already
        explore.explore(((address,),), limits)  # the real machine, same world: no violation


B = explore_bootstrap.Limits
BOOTSTRAP_WORLDS = {
    # every rank up, two Hellos or HelloAcks lost: kept
    "all_up": B(("up", "up", "up"), losses=2),
    # one rank silent, one refusing: given up at the deadline, never before
    "silent_and_refusing": B(("silent", "refusing", "up"), losses=1),
    "silent": B(("up", "silent"), losses=2),
}


@pytest.mark.parametrize("name", sorted(BOOTSTRAP_WORLDS))
def test_bootstrap_ends_by_its_deadline_and_keeps_exactly_the_instances_whose_ranks_are_up(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    report = explore_bootstrap.explore(BOOTSTRAP_WORLDS[name])
    with capsys.disabled():
        print(
            f"\n  explored bootstrap world {name}: {report.states} states, {report.transitions} transitions"
        )
    assert report.terminals > 0 and report.states > 50


BOOTSTRAP_CAUGHT = {
    "bootstrap_never_resends": (mutants.BootstrapNeverResends, "all_up", "the bootstrap ended GiveUp"),
    "bootstrap_without_deadline": (mutants.BootstrapWithoutDeadline, "silent", "the waiter waits until"),
}


@pytest.mark.parametrize("name", sorted(BOOTSTRAP_CAUGHT))
def test_bootstrap_mutant_is_caught(name: str) -> None:
    factory, world, message = BOOTSTRAP_CAUGHT[name]
    with pytest.raises(explore_bootstrap.Violation, match=message):
        explore_bootstrap.explore(BOOTSTRAP_WORLDS[world], factory)
