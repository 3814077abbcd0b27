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

import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from kvconn.conformance.checking import MiB, open_cluster
from kvconn.conformance.harness import Cluster, ConformanceFailure, RankProc, Settings, wait_for
from kvconn.conformance.plugin import require_capability
from kvconn.transport import Settlement

#: One chunk of 64 MiB (64 pages of 1 MiB): still being written for a while
#: after on_post returned, by any transport that does not land it inside on_post.
PAGES = 64
BARRIER_ROOMS = {"past_deadline": 0xBA_0001, "cancelled": 0xBA_0002}
FENCE_ROOM = 0xFE_0001


def _cluster(settings: Settings, room: int, rule: dict[str, object]) -> AbstractContextManager[Cluster]:
    return open_cluster(
        settings,
        page_bytes=MiB,
        num_pages=PAGES,
        chunk_pages=PAGES,
        source_pages=PAGES,
        faults={room: rule},
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
            pages = cluster.alloc(PAGES)
            rx = cluster.receiver(room, pages)
            _frozen_at(rank, "after_post", f"barrier {when}: the rank posts")
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

    @pytest.mark.kvconn_releases
    def test_fence_after_a_raise_stops_the_write(self, kvconn_settings: Settings) -> None:
        """(writer_fence) A hook raises right after on_post returned with
        64 MiB to write: the core poisons the room and fences with that write
        in flight. The rank freezes right after on_fence answered True: not
        one byte of the room's pages changes after that (fresh canaries, the
        rank resumed, watched)."""
        settings = kvconn_settings
        require_capability(settings.capabilities.writer_fence, "writer_fence not declared")
        rule: dict[str, object] = {"raise": "after_post", "stop": ["fenced"], "hold": "fenced"}
        rule["hold_s"] = _hold_s(settings)
        with _cluster(settings, FENCE_ROOM, rule) as cluster:
            rank = cluster.ranks[0]
            pages = cluster.alloc(PAGES)
            rx = cluster.receiver(FENCE_ROOM, pages)
            fenced = _frozen_at(rank, "fenced", "fence after a raise: on_fence answers")
            if fenced.get("result") is True:
                pending = len(cluster.bad_pattern_pages(FENCE_ROOM, pages))
                cluster.pages.recanary(pages)  # the rank is frozen: from here on nothing may change
                rank.signal(signal.SIGCONT)
                _watch(
                    cluster,
                    pages,
                    settings.late_write_watch_s,
                    lambda changed: (
                        f"fence after a raise: on_fence returned True with {pending} of {PAGES} pages "
                        f"still unwritten, and {len(changed)} pages changed after it (pages "
                        f"{changed[:8]}): the fence does not stop a write in flight"
                    ),
                )
            rank.signal(signal.SIGCONT)
            rx.abort()  # acked by the fence (or held); the release goes to the run's guard
