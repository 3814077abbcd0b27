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
* **Load is not silence.** decode's control link to each rank (a ZMQ
  connection) runs a heartbeat of its own that the rank's messaging library
  answers on its I/O thread, without the rank's Python: a process that runs
  answers it however busy its interpreter is (an engine's step loop holding
  the GIL, a garbage collection stretched by CPU starvation), while one that
  is stopped, gone or cut off does not, and the link is lost
  (:func:`links_changed`; :func:`link_heartbeat` says how the runtime sets
  it). A watched rank that leaves a Hello unanswered for ``peer_timeout_s``
  is down only if its link is not up; with its link up it is slow, and down
  only past ``peer_hung_timeout_s`` (its kvconn threads hung). Where the
  runtime reports no link, the first rule alone applies.
* **Whoever is there now is asked first.** A rank whose link was lost since
  its process last spoke may be another process by now (restarted at its
  address) or none: a new room is not sent to it blind. Its request waits
  (:attr:`Request.unsent`) while the rank is Hello'd (at once, and again as
  soon as the link is back); the answer sends it, to the process that gave
  it (a restart is adopted first), and a rank judged down fails it, with
  nothing sent: its pages need no proof from that rank.

A rank being down only fails rooms onto the abort path; pages still need
proof (hold.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kvconn.protocol.endpoint_events import Action, RankDown, Request, Send, WriterIdentity

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


def heard_from(state: EndpointState, rank: int, now: float) -> list[Action]:
    """``rank``'s current process spoke: it is alive now, any Hello it had
    not answered is answered, and requests waiting for it to be confirmed
    (:attr:`Request.unsent`) go to it now."""
    state._heard[rank] = now
    state._asked.pop(rank, None)
    if rank not in state.unconfirmed or state._link.get(state.writers[rank].address) is False:
        # While its link is down a request would reach whoever is there once
        # it is back, and this answer may be one the process sent before it
        # went: only one heard with the link up confirms the rank.
        return []
    state.unconfirmed.discard(rank)
    return send_waiting(state, rank)


def hear(state: EndpointState, rank: int, session: int, now: float) -> list[Action]:
    """A message for this endpoint (its decode name checked) came from the
    process of ``session`` at endpoint-wide ``rank``: a heartbeat, whatever
    else it says, if that process is the rank's current one. One of an
    earlier process at that address (a retired session) is not: it says
    nothing of the process decode now sends to."""
    writer = state.writers.get(rank)
    if writer is not None and writer.session == session:
        return heard_from(state, rank, now)
    return []


def link_heartbeat(heartbeat_interval_s: float, peer_timeout_s: float) -> tuple[float, float]:
    """(interval, timeout) of the control link's own heartbeat: pinged every
    heartbeat, lost once a ping goes unanswered for half of ``peer_timeout_s``
    (at least one interval), so that a stopped, gone or cut-off rank's link
    is lost before its first unanswered Hello is ``peer_timeout_s`` old."""
    return heartbeat_interval_s, max(heartbeat_interval_s, peer_timeout_s / 2)


def links_changed(state: EndpointState, changes: tuple[tuple[str, bool], ...], now: float) -> list[Action]:
    """Apply the runtime's link events, in order. A lost link makes its rank
    unconfirmed (its next requests wait to learn who answers there) and
    brings the next heartbeat forward to the next tick; a link back for an
    unconfirmed rank Hellos it at once, so that a process restarted at the
    address is known before the engine's next room on it."""
    actions: list[Action] = []
    for address, up in changes:
        # Kept by address: the first handshake comes while the rank is still
        # being bootstrapped, before it has an id here.
        state._link[address] = up
        rank = state._id_at.get(address)
        if rank is None:
            continue
        if not up:
            state.unconfirmed.add(rank)
            # A lost link is the first sign of an exit: the next tick runs
            # the heartbeat, which looks the ranks' processes up, rather
            # than up to an interval later.
            state._next_heartbeat = min(state._next_heartbeat, now)
        elif rank in state.unconfirmed:
            actions.append(_hello(state, rank))
    return actions


def linked(state: EndpointState, rank: int) -> bool:
    """The runtime reports ``rank``'s control link up: its process runs and
    answers the link's heartbeat (False also where no link is reported)."""
    return state._link.get(state.writers[rank].address, False)


def ask_first(state: EndpointState, request: Request, ranks: list[int], now: float) -> list[Action]:
    """``request``'s ranks that are unconfirmed are not sent it yet: each is
    Hello'd now (its answer sends it, :func:`send_waiting`)."""
    actions: list[Action] = []
    for rank in ranks:
        request.unsent.add(rank)
        actions.append(_hello(state, rank))
        state._asked.setdefault(rank, now)
    return actions


def send_waiting(state: EndpointState, rank: int) -> list[Action]:
    """``rank`` answered: the requests that waited for it are sent, to its
    current process (a restart adopted already, so they are its)."""
    actions: list[Action] = []
    for request in list(state.requests.values()):
        if rank not in request.unsent:
            continue
        request.unsent.discard(rank)
        if request.aborted or request.verdict is not None or not state.current(request):
            continue
        writer = request.writers[rank] = state.writers[rank]
        actions.append(Send(writer.address, state.transfer_request(request, writer.session), rank))
    return actions


def fail_waiting(state: EndpointState, rank: int, reason: str, now: float) -> list[Action]:
    """``rank`` is down: the requests that waited to be sent to it fail,
    nothing sent to it (their pages owe it no proof)."""
    actions: list[Action] = []
    for request in list(state.requests.values()):
        if rank in request.unsent and request.verdict is None and not request.aborted:
            actions += state.fail_and_abort(
                request, f"rank {rank} is down: {reason}; nothing was sent to it", now
            )
    return actions


def heartbeat(state: EndpointState, gone: frozenset[WriterIdentity], now: float) -> list[Action]:
    """Hello each watched rank silent for ``heartbeat_interval_s`` (its answer
    proves it alive and names its session) and every rank that is down; a
    watched rank whose first unanswered Hello is older than
    ``peer_timeout_s`` while its link is not up, or older than
    ``peer_hung_timeout_s``, or whose process is proven gone, is down. The
    process gone from an unconfirmed rank whose link is up again (another
    one answers there, a restart being confirmed) fails only what it was
    sent."""
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
            reason = f"its process (pid {writer.pid}) exited"
            if rank in state.unconfirmed and linked(state, rank):
                actions += state._fail_rooms_of(rank, writer, f"rank {rank}: {reason}", now)
            else:
                actions += down(state, rank, "exited", reason, now)
                continue
        if now - state._heard[rank] >= state.heartbeat_interval_s:
            actions.append(_hello(state, rank))
            state._asked.setdefault(rank, now)
        asked = state._asked.get(rank)
        if asked is None or now - asked <= state.peer_timeout_s:
            continue
        if not linked(state, rank):
            actions += down(state, rank, "silent", f"no answer to a Hello for {now - asked:.1f} s", now)
        elif now - asked > state.peer_hung_timeout_s:
            why = f"no answer to a Hello for {now - asked:.1f} s, its link up (its kvconn threads hung)"
            actions += down(state, rank, "hung", why, now)
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
    the abort path, and those still waiting to be sent to it fail."""
    state.down[rank] = reason
    state._asked.pop(rank, None)
    actions: list[Action] = [RankDown(rank, cause, reason)]
    writer = state.writers[rank]
    actions += state._fail_rooms_of(rank, writer, f"rank {rank} is down: {reason}", now)
    return actions + fail_waiting(state, rank, reason, now)


def unavailable(state: EndpointState, ids: tuple[int, ...]) -> list[str]:
    """Why a request to these ranks could not be served now (empty: it
    could): a rank down, or one whose link is lost and not back. An engine
    that cached where an instance's ranks are reads it again on this."""
    reasons = []
    for rank in ids:
        if rank in state.down:
            reasons.append(f"rank {rank} is down: {state.down[rank]}")
        elif state._link.get(state.writers[rank].address) is False:
            reasons.append(f"rank {rank}'s control link ({state.writers[rank].address}) is lost")
    return reasons


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
