"""The engine's handle on one room at a prefill rank.

Every decision (which requests it writes, what it may send and where, its
verdict) is :class:`kvconn.protocol.rank.RankState`'s; a Sender asks it
through :meth:`PrefillRank.step` (a send: in one lock section, planned and
committed) and queues the planned chunk; the worker lowers it (:func:`lower`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvconn.chunk import Chunk, SegmentTable
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.rank import Verdict
from kvconn.runtime.layout import EngineLayout, PageLayout

if TYPE_CHECKING:
    from kvconn.runtime.prefill import PrefillRank


class Sender:
    """The engine's handle on one room at this rank (like SGLang's KVSender).

    It writes the room into ``decodes`` decode endpoints (1 unless prefill
    TP is smaller than decode TP: then each decode rank requests the room
    and takes its own head slice of every page). It takes the first
    ``decodes`` requests for the room id that arrive, one per decode
    endpoint, that no other sender took (so one sender per decode's request,
    made as ``on_request`` reports each, works too), and each :meth:`send`
    queues the chunk to every one of them, into that decode's own pages.
    Until all ``decodes`` requests came, :meth:`poll` says BOOTSTRAPPING and
    :meth:`send` raises. A request decode aborted before any sender took it
    is taken too: the sender then says FAILED.

    Each decode's room is its own at this rank: its counts, acks, fences and
    status. One decode's abort fails only its room: the others still
    complete, and :meth:`statuses` says how each ended; :meth:`poll` sums
    them up (FAILED if any failed, SUCCESS once all succeeded), and
    :meth:`verdict` says how the room ended and whether it is settled.

    Decode may reuse a room id once the room concluded. A sender belongs to
    the requests it first saw (their ledger incarnations): its late
    ``clear()`` or ``fail()`` leaves a later request for the same id alone,
    and it sends nothing into one. Once it has seen its requests conclude,
    or was cleared, :meth:`poll` keeps that verdict.
    """

    def __init__(self, rank: PrefillRank, room: int, decodes: int = 1) -> None:
        self._rank = rank
        self.room = room
        self.decodes = decodes
        self._state = rank.step(lambda state, now: (state.open_sender(room, decodes, now), []))

    def poll(self) -> KVPoll:
        return self._rank.step(lambda state, now: state.poll(self._state, now))

    def statuses(self) -> dict[str, KVPoll]:
        """Each decode endpoint's room, by decode name, as this sender saw it
        (only the requests it took)."""

        def statuses(state: RankStateT, now: float) -> tuple[dict[str, KVPoll], list[Action]]:
            _, actions = state.poll(self._state, now)
            return state.leg_statuses(self._state), actions

        return self._rank.step(statuses)

    def verdict(self) -> Verdict | None:
        """How the room ended at every decode the sender writes (None while
        it has not): SUCCESS or FAILED, why, and whether it is settled (see
        :meth:`settled`). An engine reuses the source pages once it is."""
        return self._rank.step(lambda state, now: state.verdict(self._state, now))

    def send(self, src_pages: Sequence[int], last: bool = False, extras_slot: int | None = None) -> None:
        """Queue the next ``len(src_pages)`` pages of the room for writing,
        into every decode the sender writes.

        ``extras_slot``: with the last chunk, this rank's slot of the room's
        per-room extras (its layout's ``extras``), written into the slot
        decode asked for along with the pages. Required then if decode asked
        for extras and this rank writes them (see ``KVLayout.extra_segments``).

        ``last``: this is the room's final chunk, and it must complete the
        room's destination pages. Once it lands, decode is told Success and
        may hand the pages out again, so no chunk may follow it: this
        sender, or any sender of the room while it is Success, raises
        :class:`~kvconn.errors.RoomStateError` (a room id decode reuses
        starts over with its request). A refused send queues nothing.
        """
        rank = self._rank
        src = tuple(src_pages)
        # The chunk object and its segments are the worker's to make
        # (lower()), once the ledger counted the chunk and said it is
        # written: the engine's thread only plans, commits and queues.
        plan = rank.commit_send(self._state, src, last, extras_slot)
        for leg in plan.legs:
            # The incarnation tag: a chunk of this request, dequeued after the
            # room id was taken by a newer request, is skipped, not written
            # into the newer request's pages.
            rank.enqueue_planned(plan, leg, src)

    def settled(self) -> bool:
        """The room is Success or Failed and no chunk of it is being written
        any more, at any of its decodes: its source pages may be reused."""
        return self._rank.step(lambda state, now: (state.settled(self._state), []))

    def fail(self, reason: str) -> None:
        """Prefill-initiated failure: tell every decode, write nothing more.
        A decode whose request has not come yet is told FAILED when it does."""
        self._rank.step(lambda state, now: (None, state.fail(self._state, reason, now)))

    def clear(self) -> None:
        """The engine is done with the room (success or not). A room still
        live fails, and its decode is told: its queued chunks will not be
        written. Afterwards :meth:`poll` says Success or Failed for good."""
        self._rank.step(lambda state, now: (None, state.clear(self._state, now)))


def lower(
    rank: int, chunk: Chunk, layout: PageLayout | EngineLayout, extras: int | None, extras_slot: int | None
) -> SegmentTable:
    """A planned chunk's segments: its pages through the pair's layout, and
    with a last chunk that writes decode's extras, this rank's extras slot
    ``extras_slot`` into decode's slot ``extras`` (the core checked both)."""
    segments = layout.segments(rank, chunk.src_pages, chunk.dst_pages)
    if extras is not None:
        assert isinstance(layout, EngineLayout) and extras_slot is not None  # the core checked
        more = layout.src.extra_segments(layout.dst, extras_slot, extras)
        segments = SegmentTable(np.concatenate([segments.rows, more.rows]))
    return segments


if TYPE_CHECKING:
    from kvconn.protocol.rank import Action, RankState

    RankStateT = RankState[PageLayout | EngineLayout]
