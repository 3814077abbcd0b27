"""A decode endpoint's view of its ranks' liveness, sans-I/O: which writers
each held room still owes a proof, which of them are proven gone, and the
heartbeat that finds a rank silent or gone (:class:`EndpointState` calls these
at its ticks; the state is its), and what a look at a writer's pid proves
(:func:`exit_proven`: the runtime reads ``/proc``, this decides)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kvconn.protocol.endpoint_events import Action, Send, WriterIdentity
from kvconn.protocol.hold import HoldState

if TYPE_CHECKING:
    from kvconn.protocol.endpoint import EndpointState


def owed(state: EndpointState) -> list[tuple[int, WriterIdentity, int]]:
    """(rank, writer, room) for every held or quarantined room's unproven
    writers: each room's own (a process restarted at a rank's address
    proves nothing for the rooms the earlier one was asked to write)."""
    found = []
    for room in state.tracker.rooms_in(HoldState.HELD) + state.tracker.rooms_in(HoldState.QUARANTINED):
        request = state.requests.get(room)
        for rank in state.tracker.ranks_of(room):
            writer = request.writers[rank] if request is not None else state.writers[rank]
            found.append((rank, writer, room))
    return found


def exits(
    state: EndpointState, gone: frozenset[WriterIdentity], peers_drained: bool, now: float
) -> list[Action]:
    """Release held rooms whose writer processes are proven gone, once
    nothing they sent can still arrive."""
    if not gone or not peers_drained:
        return []
    rooms: dict[tuple[int, WriterIdentity], list[int]] = {}
    for rank, writer, room in owed(state):
        if writer in gone:
            rooms.setdefault((rank, writer), []).append(room)
    actions: list[Action] = []
    for (rank, _), held in rooms.items():
        actions += state.carry(state.tracker.writer_exited(rank, now, frozenset(held)))
    return actions


def heartbeat(state: EndpointState, gone: frozenset[WriterIdentity], now: float) -> list[Action]:
    """Hello every rank again (its answer proves it alive and names its
    session); a rank silent past peer_timeout_s, or whose process is
    proven gone, is down."""
    actions: list[Action] = []
    for rank in sorted(state.ranks):
        writer = state.writers[rank]
        actions.append(Send(writer.address, state._hello(state._rank_of[rank][0]), rank))
        if rank in state.down:
            continue
        if writer in gone:
            actions += state._rank_down(rank, "exited", f"its process (pid {writer.pid}) exited", now)
        elif now - state._heard[rank] > state.peer_timeout_s:
            silent = f"no answer for {now - state._heard[rank]:.1f} s"
            actions += state._rank_down(rank, "silent", silent, now)
    return actions


@attrs.frozen(slots=True)
class PidSeen:
    """What decode's runtime found at a writer's pid in its own ``/proc``."""

    #: the look worked (False: ``/proc`` could not tell, which proves nothing)
    readable: bool
    #: a process has that pid
    found: bool = False
    #: its state letter ("Z" zombie, "X" dead, ...) and kernel start time
    state: str = ""
    start_time: int = 0

    @classmethod
    def free(cls) -> PidSeen:
        return cls(readable=True)

    @classmethod
    def process(cls, state: str, start_time: int) -> PidSeen:
        return cls(readable=True, found=True, state=state, start_time=start_time)

    @classmethod
    def unreadable(cls) -> PidSeen:
        return cls(readable=False)


def pid_names_writer(writer: WriterIdentity, local_pid_namespace: str) -> bool:
    """Whether decode's ``/proc`` can speak for ``writer`` at all: only where
    its pids mean what the writer's do (the same kernel boot and pid
    namespace, ``"<boot id>/pid:[<inode>]"``, and neither unknown). A writer
    on another host never is: across hosts a writer's exit proves nothing
    (what stands for it there is decode's own owner fence)."""
    return bool(local_pid_namespace) and writer.pid_namespace == local_pid_namespace


def exit_proven(writer: WriterIdentity, local_pid_namespace: str, seen: PidSeen) -> bool:
    """True only when the writer process certainly no longer runs: its pid
    names it here (:func:`pid_names_writer`) and that pid is free, reused by
    another process (another start time), or a zombie."""
    if not pid_names_writer(writer, local_pid_namespace) or not seen.readable:
        return False
    if not seen.found:
        return True
    return seen.start_time != writer.start_time or seen.state in ("Z", "X")
