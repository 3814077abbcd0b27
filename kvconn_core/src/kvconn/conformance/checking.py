"""What the end-to-end checks share: their clusters' deadlines, S1 seen from
outside, the late-write watch, and a rank's kill that proves nothing of it
outlives it."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

from kvconn.conformance import guard
from kvconn.conformance.harness import Child, Cluster, ConformanceFailure, Settings, wait_for
from kvconn.conformance.writing import HEALTHY_WRITE_S

MiB = 1 << 20


def generous(settings: Settings) -> Settings:
    """For checks of where bytes land, not how fast: deadlines a healthy
    write meets on a loaded host (a first write may set up a connection; a
    nixl room missed 5 s once beside a 12 GB ``rm``), as a bare writer's
    :func:`~kvconn.conformance.writing.healthy_write_timeout`."""
    return attrs.evolve(
        settings,
        write_timeout_s=max(settings.write_timeout_s, HEALTHY_WRITE_S),
        abort_timeout_s=max(settings.abort_timeout_s, HEALTHY_WRITE_S + 5.0),
    )


@contextmanager
def open_cluster(settings: Settings, **kwargs: Any) -> Iterator[Cluster]:
    made = Cluster(settings, **kwargs)
    try:
        yield made
    finally:
        made.close()


def settled_before(cluster: Cluster, room: int, released_at: float) -> int:
    """S1 seen from outside: every chunk of ``room`` that any rank posted had
    settled (its DONE barrier returned) before decode got the room back.
    How many chunks the ranks posted (what the release had to wait for)."""
    total = 0
    for rank in cluster.ranks:

        def seen(rank: Any = rank) -> tuple[set[int], dict[int, dict[str, Any]]]:
            events = [e for e in rank.history() if e.get("room") == room]
            posted = {e["index"] for e in events if e["event"] == "before_post"}
            return posted, {e["index"]: e for e in events if e["event"] == "after_barrier"}

        # The child reports before it acks, but its pipe may lag decode's socket.
        deadline = time.monotonic() + 1.0
        posted, settled = seen()
        while not posted <= settled.keys() and time.monotonic() < deadline:
            time.sleep(0.01)
            posted, settled = seen()
        total += len(posted)
        for index in sorted(posted):
            done = settled.get(index)
            if done is None or done["t"] > released_at:
                when = "never" if done is None else f"{done['t'] - released_at:+.4f} s after the release"
                raise ConformanceFailure(
                    f"S1 violated: room {room} was released while chunk {index} of rank "
                    f"{rank.address} could still land (its DONE barrier settled {when})"
                )
    return total


def no_late_bytes(cluster: Cluster, room: int | str, pages: list[int], settle_s: float) -> None:
    """The released pages of ``room`` keep their canary for ``settle_s``
    (checked along the way, so a late write fails the check at once). The
    run's guard watches them on until the suite ends."""
    deadline = time.monotonic() + settle_s
    while True:
        bad = cluster.changed_after_release(pages)
        if bad:
            raise ConformanceFailure(
                f"late write after release: {len(bad)} pages of aborted room {room} changed after "
                f"decode released them (pages {bad[:8]})"
            )
        if time.monotonic() >= deadline:
            return
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


#: How long a process the rank started may linger after the rank died (the
#: interpreter's own helpers, e.g. multiprocessing's resource tracker, exit
#: within milliseconds of their parent).
SURVIVOR_GRACE_S = 1.0


def kill_rank(rank: Child, what: str, owners: Sequence[int | None] = ()) -> None:
    """Kill a rank and check that nothing it started outlives it: the core
    takes the rank's exit as proof that none of its writes can land, which
    a helper process (an offload engine, a daemon) still writing makes false.

    What the rank started (its session and its descendants, a daemon in a
    session of its own among them) is frozen first, so that the rank dies
    with each of them where it was; then, the rank killed, one that still
    maps the shared memory of a page owner (``owners``: their pids; decode's
    regions), or holds it or the owner's ``/proc/PID/mem`` open, fails at
    once, with the threads it holds. Its writes land only
    after it is resumed, once decode could act on the exit: in released
    pages, for the run's guard to see. The others are resumed and get
    :data:`SURVIVOR_GRACE_S` to exit (the interpreter's own helpers, e.g.
    multiprocessing's resource tracker, exit within milliseconds); what is
    still there then fails. This process being a child subreaper
    (:func:`guard.become_subreaper`), the orphans re-parented here when the
    rank died are seen too. What is found is left alive until the end of
    the run."""
    memory: set[tuple[str, int]] = set()
    for pid in owners:
        if pid is not None:
            memory |= guard.shared_memory_of(pid)
    started = guard.descendants(rank.pid, rank.session)
    guard.signal_all(started, signal.SIGSTOP)
    before = guard.children()

    def left() -> list[str]:
        return rank.survivors() + guard.orphans_since(before, {rank.proc.pid})

    mapping: list[str] = []
    try:
        rank.kill()
        mapping = guard.holders(left(), memory, [pid for pid in owners if pid is not None])
    finally:
        if not mapping:
            guard.signal_all(started, signal.SIGCONT)

    def keep(found: list[str]) -> None:
        guard.GUARD.keep(
            f"processes that outlived a rank ({'; '.join(found[:3])})",
            lambda: "",
            guard.kill_later([int(line.split()[0]) for line in found]),
        )

    if mapping:
        keep(left())
        time.sleep(SURVIVOR_GRACE_S)  # decode acts on the exit: what they write now is late
        guard.signal_all(started, signal.SIGCONT)
        raise ConformanceFailure(
            f"{what}: processes the rank started still map decode's memory after it died "
            f"({'; '.join(mapping[:3])}): whatever they can write still lands after the rank's exit, "
            "which then proves nothing"
        )
    try:
        wait_for(lambda: not left(), SURVIVOR_GRACE_S, what, poll=0.05)
    except ConformanceFailure:
        found = left()
        if found:
            keep(found)
            raise ConformanceFailure(
                f"{what}: processes the rank started outlived it ({'; '.join(found[:3])}): whatever they "
                "can write still lands after the rank's exit, which then proves nothing"
            ) from None
