"""Every interleaving of small worlds on the decode endpoint's state machine
(``explore_endpoint.py``), and on its mutants (``endpoint_mutants.py``)."""

from __future__ import annotations

import endpoint_mutants as mutants
import explore_endpoint as explore
import pytest

from kvconn.protocol.endpoint import EndpointState

L = explore.Limits
ONE = (("p0",),)
WORLDS = {
    # a rank's process exits at any point (its bytes drain later), heartbeats tick
    "liveness": (ONE, L(ticks=2, exits=1, requests_per_room=1)),
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
