"""A decode endpoint's view of its ranks' liveness, sans-I/O: which writers
each held room still owes a proof, which of them are proven gone, and the
heartbeat that finds a rank silent or gone (:class:`EndpointState` calls these
at its ticks; the state is its), and what a look at a writer's pid proves
(:func:`exit_proven`: the runtime reads ``/proc``, this decides).

Liveness protects rooms, so it is asked only where rooms depend on it, and
traffic is its own proof:

* **Piggybacked.** Any message naming this endpoint from a rank's current
  process (a RoomStatus, an ABORT_ACK, a RankDraining, a HelloAck) is
  hearing from it (:func:`hear`): an active rank needs no Hello.
* **Only the ranks that matter.** The ranks decode *watches* are those asked
  to write a room it has open, held or quarantined (``EndpointState.watched``,
  counted per rank as rooms come and go: no walk of the rooms). Each
  heartbeat Hellos a watched rank silent for ``heartbeat_interval_s``; it is
  down once its first unanswered Hello is ``peer_timeout_s`` old (counted
  from the probe, not from its last message: a rank idle for an hour that
  gets a room is asked first, not declared down at once), or when its
  process is proven gone. An idle rank is not asked, and its silence or
  exit is not judged until a room depends on it again; a rank already down
  is Hello'd every heartbeat until it answers (so a healed rank is back up
  before the engine's next room on it would fail).

A rank being down only fails rooms onto the abort path; pages still need
proof (hold.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kvconn.protocol.endpoint_events import Action, RankDown, Send, WriterIdentity

if TYPE_CHECKING:
    from kvconn.protocol.endpoint import EndpointState


def owed(state: EndpointState) -> list[tuple[int, WriterIdentity, int]]:
    """(rank, writer, room) for every held or quarantined room's writers:
    each room's own (a process restarted at a rank's address proves nothing
    for the rooms the earlier one was asked to write). A walk of the held
    rooms: only once an exit is proven (:func:`exits`); the exit check asks
    ``state.owed()``, kept up to date as rooms are held and released."""
    return [
        (rank, writer, room)
        for room, request in state._held.items()
        for rank, writer in request.writers.items()
    ]


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


def heard_from(state: EndpointState, rank: int, now: float) -> None:
    """``rank``'s current process spoke: it is alive now, and any Hello it
    had not answered is answered."""
    state._heard[rank] = now
    state._asked.pop(rank, None)


def hear(state: EndpointState, rank: int, session: int, now: float) -> None:
    """A message for this endpoint (its decode name checked) came from the
    process of ``session`` at endpoint-wide ``rank``: a heartbeat, whatever
    else it says, if that process is the rank's current one. One of an
    earlier process at that address (a retired session) is not: it says
    nothing of the process decode now sends to."""
    writer = state.writers.get(rank)
    if writer is not None and writer.session == session:
        heard_from(state, rank, now)


def heartbeat(state: EndpointState, gone: frozenset[WriterIdentity], now: float) -> list[Action]:
    """Hello each watched rank silent for ``heartbeat_interval_s`` (its answer
    proves it alive and names its session) and every rank that is down; a
    watched rank whose first unanswered Hello is older than
    ``peer_timeout_s``, or whose process is proven gone, is down."""
    watching = state.watched()
    actions: list[Action] = []
    for rank in sorted(watching | state.down.keys() | state._asked.keys()):
        writer = state.writers[rank]
        if rank in state.down:
            actions.append(_hello(state, rank))
            continue
        if rank not in watching:
            del state._asked[rank]  # no room depends on it: its silence is not judged
            continue
        if writer in gone:
            actions += down(state, rank, "exited", f"its process (pid {writer.pid}) exited", now)
            continue
        if now - state._heard[rank] >= state.heartbeat_interval_s:
            actions.append(_hello(state, rank))
            state._asked.setdefault(rank, now)
        asked = state._asked.get(rank)
        if asked is not None and now - asked > state.peer_timeout_s:
            actions += down(state, rank, "silent", f"no answer to a Hello for {now - asked:.1f} s", now)
    return actions


def back_up(state: EndpointState, rank: int, now: float) -> list[Action]:
    """``rank``, down, answered: its link healed or it resumed, so the proof
    of every held room it owes can come now. Its ABORTs go out at once (a
    quarantined room's re-sends back off to 30 s; those sent during the cut
    may have been lost with a dropped connection). A walk of the held rooms
    only when the rank owes one (``state._owing``), as :func:`exits` walks
    them only once an exit is proven."""
    writer = state.writers[rank]
    if writer not in state._owing:  # the per-writer count: no held room waits for it
        return []
    rooms = [room for room, request in state._held.items() if request.writers.get(rank) == writer]
    return state.carry(state.tracker.reask(rank, rooms, now))


def live(state: EndpointState) -> frozenset[WriterIdentity]:
    """The writers a heartbeat looks up in ``/proc``: those of watched ranks up."""
    return frozenset(state.writers[r] for r in state.watched() if r not in state.down)


def down(state: EndpointState, rank: int, cause: str, reason: str, now: float) -> list[Action]:
    """``rank`` is down: the open rooms of its current process fail, onto
    the abort path."""
    state.down[rank] = reason
    state._asked.pop(rank, None)
    actions: list[Action] = [RankDown(rank, cause, reason)]
    writer = state.writers[rank]
    return actions + state._fail_rooms_of(rank, writer, f"rank {rank} is down: {reason}", now)


def _hello(state: EndpointState, rank: int) -> Send:
    return Send(state.writers[rank].address, state._hello(state._rank_of[rank][0]), rank)


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
