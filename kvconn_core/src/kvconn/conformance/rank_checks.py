"""The transport's own promises checked a second way: through a real prefill
rank (:mod:`kvconn.conformance.rank_proc`: the kvconn runtime, its listener
and transfer workers) instead of a bare writer driving the hooks.

The rank freezes itself (every thread of it) right after the answer that is
checked, before the core acts on it: a barrier's settlement, or a fence the
core ran because a hook raised with a 64 MiB write in flight. The suite then
compares decode's pages with that answer, lays fresh canaries, resumes the
rank and watches them. A lie the bare-writer checks of
:mod:`kvconn.conformance.transport_checks` miss (their blind spot: one way
of driving the hooks) is then seen here too, and the other way round.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from kvconn.conformance.checking import MiB, open_cluster
from kvconn.conformance.harness import Cluster, ConformanceFailure, RankProc, Settings, wait_for
from kvconn.conformance.plugin import require_capability
from kvconn.conformance.stakes import at_stake
from kvconn.transport import Settlement

#: One chunk of 64 MiB (64 pages of 1 MiB): still being written for a while
#: after on_post returned, by any transport that does not land it inside on_post.
PAGES = 64
BARRIER_ROOMS = {"past_deadline": 0xBA_0001, "cancelled": 0xBA_0002}
#: The past-deadline question asked inside a post (for an on_post that lands all before it returns).
INSIDE_ROOM = 0xBA_0003
#: How long into its post a rank whose on_post lands the whole chunk is frozen from outside.
FREEZE_AFTER_S = 0.002
FENCE_ROOM = 0xFE_0001


def _cluster(settings: Settings, room: int, rule: dict[str, object]) -> AbstractContextManager[Cluster]:
    inside: dict[str, object] = {"stop": ["after_barrier"]}
    return open_cluster(
        settings,
        page_bytes=MiB,
        num_pages=2 * PAGES + 3 * WARM_PAGES,
        chunk_pages=PAGES,
        source_pages=2 * PAGES + 3 * WARM_PAGES,
        faults={room: rule, INSIDE_ROOM: inside},
    )


#: A first room, before the checked one: the writer reaches the region.
WARM_PAGES = 2


def _reaches(cluster: Cluster, what: str, tries: int = 3) -> None:
    """A small room lands byte-exact first: the rank can write into decode's
    region at all (else what its barrier answers later has nothing at stake).
    A room that fails (its short deadline missed on a loaded host) is tried
    again, ``tries`` times at most."""
    state = ""
    for _ in range(tries):
        room = cluster.new_room()
        pages = cluster.alloc(WARM_PAGES)
        rx = cluster.receiver(room, pages)
        state = cluster.wait_done(rx, 30 + (cluster.settings.capabilities.max_write_timeout_s or 0.0), what)
        if state != "SUCCESS":
            rx.abort()
            continue
        bad = cluster.bad_pattern_pages(room, pages)
        if bad:
            raise ConformanceFailure(
                f"{what}: the room ended SUCCESS, but {len(bad)} of {WARM_PAGES} pages do not hold what was "
                "written: a DONE barrier answered LANDED before the bytes were there"
            )
        cluster.finish(rx)
        return
    at_stake(
        0,
        1,
        f"{tries} first rooms of {WARM_PAGES} pages each ended {state}",
        "a writer that reaches the region",
    )


def _hold_s(settings: Settings) -> float:
    """How long a rank holds an answer back after its freeze: the watch, and
    a margin for the suite's canaries."""
    return settings.late_write_watch_s + 1.0


def _frozen_at(rank: RankProc, point: str, what: str) -> dict[str, object]:
    event = rank.expect(40, what, event="stopping", point=point)
    wait_for(rank.stopped, 5, f"{what}: the rank froze")
    return event


def _watch(cluster: Cluster, pages: list[int], seconds: float, late: Callable[[list[int]], str]) -> None:
    """``pages`` keep the canary just laid for ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        changed = cluster.changed_pages(pages)
        if changed:
            raise ConformanceFailure(late(changed))
        if time.monotonic() >= deadline:
            return
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


class RankChecks:
    """Mixed into :class:`~kvconn.conformance.ConformanceSuite`."""

    @pytest.mark.kvconn_releases
    @pytest.mark.parametrize("case", ["past_deadline", "cancelled"])
    def test_barrier_answer_holds_in_a_rank(self, kvconn_settings: Settings, case: str) -> None:
        """A rank frozen right after posting 64 MiB, resumed past its write
        deadline (``past_deadline``) or after decode aborted the room
        (``cancelled``: the barrier runs once the transport has seen the
        ABORT), frozen again right after its DONE barrier answered: LANDED
        means every page holds what was posted; FAILED_SETTLED means nothing
        more of it lands (fresh canaries, the rank resumed, watched).
        UNSETTLED is always true: the core fences or waits for the exit."""
        settings = kvconn_settings
        room = BARRIER_ROOMS[case]
        # After the second stop the barrier's answer is held back from the
        # core while the suite watches: no ack, so decode lays no canary of
        # its own over a late write.
        rule: dict[str, object] = {"stop": ["after_post", "after_barrier"], "hold": "after_barrier"}
        rule["hold_s"] = _hold_s(settings)
        if case == "cancelled":
            rule["await_abort"] = "before_barrier"
        when = "past its deadline" if case == "past_deadline" else "after the room's ABORT"
        with _cluster(settings, room, rule) as cluster:
            rank = cluster.ranks[0]
            _reaches(cluster, f"barrier {when}: a first room lands")
            pages = cluster.alloc(PAGES)
            rx = cluster.receiver(room, pages)
            _frozen_at(rank, "after_post", f"barrier {when}: the rank posts")
            pending = len(cluster.bad_pattern_pages(room, pages))
            if not pending:
                # on_post landed the whole chunk before it returned (nixl over cma,
                # or over TCP on an idle machine): the same question of a rank
                # frozen inside its post instead.
                if case == "cancelled":
                    rx.abort()
                rank.signal(signal.SIGCONT)
                _frozen_at(rank, "after_barrier", f"barrier {when}: the barrier answers")
                rank.signal(signal.SIGCONT)
                rx.abort()
                pending = self._inside_post(settings, cluster, rank, case)
                at_stake(
                    pending,
                    1,
                    f"on_post lands its chunk before it returns; a rank that reached the region froze "
                    f"{FREEZE_AFTER_S * 1000:.0f} ms into the post of another with {pending} of {PAGES} pages "
                    f"not written, then asked {when}",
                    "pages of the chunk still to land when the barrier was asked",
                )
                return
            at_stake(
                pending,
                1,
                f"a rank that reached the region (a first room landed) froze with {pending} of {PAGES} pages "
                f"of a posted 64 MiB chunk not written, then asked {when}",
                "pages of the chunk still to land when the barrier was asked",
            )
            if case == "cancelled":
                rx.abort()
                time.sleep(0.3)  # the ABORT (and a re-send) reaches the frozen rank's socket
            else:
                time.sleep(settings.write_timeout_s + 0.1)
            rank.signal(signal.SIGCONT)
            _frozen_at(rank, "after_barrier", f"barrier {when}: the barrier answers")
            answered = [
                e for e in rank.history() if e.get("event") == "after_barrier" and e.get("room") == room
            ]
            settlement = str(answered[-1]["settlement"])
            if settlement == Settlement.LANDED.value:
                bad = cluster.bad_pattern_pages(room, pages)
                if bad:
                    raise ConformanceFailure(
                        f"a rank's DONE barrier answered LANDED {when}, but {len(bad)} of {PAGES} pages "
                        f"do not hold what was posted (pages {bad[:8]}): bytes were still in flight"
                    )
            elif settlement == Settlement.FAILED_SETTLED.value:
                cluster.pages.recanary(pages)  # the rank is frozen: from here on nothing may change
                rank.signal(signal.SIGCONT)
                _watch(
                    cluster,
                    pages,
                    settings.late_write_watch_s,
                    lambda changed: (
                        f"a rank's DONE barrier answered FAILED_SETTLED {when} (nothing more can land), "
                        f"but {len(changed)} of {PAGES} pages changed after it (pages {changed[:8]})"
                    ),
                )
            rank.signal(signal.SIGCONT)
            if case == "past_deadline":
                rx.abort()  # the room ends either way; its release goes to the run's guard

    @staticmethod
    def _inside_post(settings: Settings, cluster: Cluster, rank: RankProc, case: str) -> int:
        """The rank frozen from outside :data:`FREEZE_AFTER_S` into its post of
        :data:`INSIDE_ROOM`, held past its deadline (``past_deadline``) or
        until decode's ABORT of the room reached it (``cancelled``), resumed,
        frozen again right after its barrier answered: LANDED must hold. How
        many pages were still unwritten at the first freeze."""
        when = "past its deadline" if case == "past_deadline" else "after the room's ABORT"
        pages = cluster.alloc(PAGES)
        rx = cluster.receiver(INSIDE_ROOM, pages)
        posting = rank.expect(
            40, "barrier inside a post: the rank posts", event="before_post", room=INSIDE_ROOM
        )
        try:
            rank.stop_at(float(posting["t"]) + FREEZE_AFTER_S, "barrier inside a post: the rank froze")
            pending = len(cluster.bad_pattern_pages(INSIDE_ROOM, pages))
            if case == "cancelled":
                rx.abort()
                time.sleep(0.3)  # the ABORT (and a re-send) reaches the frozen rank's socket
            else:
                time.sleep(settings.write_timeout_s + 0.1)
        finally:
            rank.signal(signal.SIGCONT)
        answered = _frozen_at(rank, "after_barrier", "barrier inside a post: the barrier answers")
        del answered
        settled = [
            e for e in rank.history() if e.get("event") == "after_barrier" and e.get("room") == INSIDE_ROOM
        ]
        if settled and settled[-1]["settlement"] == Settlement.LANDED.value:
            bad = cluster.bad_pattern_pages(INSIDE_ROOM, pages)
            if bad:
                raise ConformanceFailure(
                    f"a rank's DONE barrier answered LANDED {when}, but {len(bad)} of {PAGES} pages "
                    f"do not hold what was posted (pages {bad[:8]}): bytes were still in flight"
                )
        rank.signal(signal.SIGCONT)
        rx.abort()
        return pending

    @pytest.mark.kvconn_releases
    def test_fence_after_a_raise_stops_the_write(self, kvconn_settings: Settings) -> None:
        """(writer_fence) A rank with two transfer workers serves two decodes
        (two peers); a room of each, 64 MiB in two chunks, is written at once
        (each worker waits before its first post for the other, so both post
        together),
        and a hook raises right after each first post: the core fences with
        both writes in flight, both rooms' second chunks queued behind them.
        The rank freezes as the core calls on_fence (what is still to land is
        measured) and right after it answered True: not one byte of either
        room's pages changes after that (fresh canaries, the rank resumed,
        watched), and the queued chunks are never written."""
        settings = kvconn_settings
        require_capability(settings.capabilities.writer_fence, "writer_fence not declared")
        rule: dict[str, object] = {
            "gather": "before_post",
            "gather_n": 2,
            "raise": "after_post",
            "stop": ["fencing", "fenced"],
            "hold": "fenced",
            "hold_s": _hold_s(settings),
        }
        rooms = (FENCE_ROOM, FENCE_ROOM + 1)  # one per worker (room % workers)
        shape: dict[str, object] = {
            "page_bytes": MiB,
            "num_pages": PAGES + 3 * WARM_PAGES,
            "chunk_pages": PAGES // 2,
            # Both rooms' source pages at once (the rank writes a room from its own).
            "source_pages": 2 * (PAGES + 3 * WARM_PAGES),
            "workers": 2,
        }
        faults: dict[int, dict[str, object]] = {room: rule for room in rooms}
        with open_cluster(settings, faults=faults, **shape) as first:
            second = Cluster(settings, ranks_of=first, seed=0xFE2, **shape)  # type: ignore[arg-type]
            try:
                self._fence_two_peers(settings, (first, second), rooms)
            finally:
                second.close()

    def _fence_two_peers(
        self, settings: Settings, clusters: tuple[Cluster, Cluster], rooms: tuple[int, int]
    ) -> None:
        rank = clusters[0].ranks[0]
        for cluster in clusters:  # both decodes connected first (a connect may wait for the workers)
            _reaches(cluster, "fence after a raise: a first room lands in each decode")
        pages = [cluster.alloc(PAGES) for cluster in clusters]
        # The page owner (the process holding both regions) is frozen while the
        # rank writes: a transport that receives there (a socket it reads) holds
        # its writes in flight until the fence, whatever its pace. (A transport
        # that writes the memory itself is not held back: its writes may all
        # have landed when the core fences.)
        owner = clusters[0].owner_pid
        if owner is not None:
            os.kill(owner, signal.SIGSTOP)
        try:
            rxs = [cluster.receiver(room, p) for cluster, room, p in zip(clusters, rooms, pages, strict=True)]
            # Frozen as the core calls on_fence: what is not written yet is what the fence must stop.
            _frozen_at(rank, "fencing", "fence after a raise: the core fences")
        finally:
            if owner is not None:
                os.kill(owner, signal.SIGCONT)
        posted = {e["room"] for e in rank.history() if e.get("event") == "after_post" and e["room"] in rooms}
        pending = [
            len(cluster.bad_pattern_pages(room, p))
            for cluster, room, p in zip(clusters, rooms, pages, strict=True)
        ]
        rank.signal(signal.SIGCONT)
        fenced = _frozen_at(rank, "fenced", "fence after a raise: on_fence answers")
        if fenced.get("result") is not True:
            at_stake(0, 1, "on_fence did not answer True", "a fence that answered True")
        for cluster, p in zip(clusters, pages, strict=True):
            cluster.pages.recanary(p)  # the rank is frozen: from here on nothing may change
        rank.signal(signal.SIGCONT)
        for cluster, p in zip(clusters, pages, strict=True):
            _watch(
                cluster,
                p,
                settings.late_write_watch_s,
                lambda changed: (
                    f"fence after a raise: the fence does not stop every write in flight: {len(changed)} pages "
                    f"changed after on_fence returned True (pages {changed[:8]}; {pending} of {PAGES} pages of "
                    "each room were unwritten at the fence), or a queued chunk was written after it"
                ),
            )
        rank.signal(signal.SIGCONT)
        writes = sum(1 for room, n in zip(rooms, pending, strict=True) if room in posted and n > PAGES // 2)
        # Two writes posted at once, neither answered: the core must fence both. How many still had
        # bytes to land when it did is the transport's pace (nixl's transfer() pushes most of a write
        # before it returns; tcpdemo's sender is done within the milliseconds the core takes to get
        # to its fence): reported, not required. (Two in flight at least: the bare writer's fence
        # check, whose posts follow each other with nothing between them.)
        unanswered = len(posted & set(rooms))
        at_stake(
            unanswered,
            2,
            f"{unanswered} writes posted at once to 2 decodes and unanswered when the core fenced, {writes} of "
            f"them still writing then ({pending[0] - PAGES // 2} and {pending[1] - PAGES // 2} of {PAGES // 2} "
            "pages of their chunks unwritten), each room's second chunk queued behind",
            "two writes, to two peers, that only the fence could settle",
        )
        for rx in rxs:
            rx.abort()  # acked by the fence (or held); the release goes to the run's guard
