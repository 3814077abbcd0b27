"""Faults that happen in production, each met by kvconn's mode and by the
timeout-only legacy mode, on loopback with real rank processes
(``kvconn bench --faults``).

* ``frozen``: a rank stops half way through a chunk (a GC pause, a frozen
  host: loopback's ``freeze_chunks`` makes it SIGSTOP itself there) and is
  continued after decode's deadline; the rest of the chunk then lands.
* ``late_queue``: half a chunk waits in the transport's queue and lands past
  decode's deadline (loopback's ``late_chunks``); the writer's fence has to
  wait for it.
* ``partition``: the ranks run in their own network namespace and the link
  is cut mid-transfer: decode's ABORTs do not reach them and they keep
  writing (loopback's data plane is shared memory and does not cross the
  link); healed after decode's deadline.

Per fault and mode: the pages written after decode handed them back
(corrupted: the next request's KV), and what kvconn paid instead: pages
quarantined and the time from the abort to the release, with its proof.

Interrupted (Ctrl-C, or a SIGTERM handler that raises), :func:`run` stops
both modes' threads, closes their clusters (a frozen rank is continued and
told to exit) and their hosts, and re-raises, within seconds.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvconn.runtime.procs import all_threads_stopped
from kvconn.testing import hosts
from kvconn.testing.cluster import Cluster
from kvconn.testing.hosts import Host, HostsUnavailable
from kvconn.testing.patterns import CANARY
from kvconn.testing.waiting import wait_for

FAULTS = ("frozen", "late_queue", "partition")
WRITE_S, DEADLINE_S = 0.4, 0.8  #: writer and decode deadlines (the legacy mode frees at the latter)
LATE_S = 1.6  #: how late the queued half of a chunk lands (past DEADLINE_S)
PAST_DEADLINE_S = 0.5  #: a frozen rank is continued, a link healed, this long past the deadline
PAGES = 8


@attrs.frozen
class Outcome:
    fault: str
    mode: str  #: "kvconn" or "legacy"
    rooms: int = 0
    pages: int = 0  #: pages of the aborted rooms
    corrupted_pages: int = 0  #: written after decode handed them back
    quarantined_pages: int = 0
    recovery_s: tuple[float, ...] = ()  #: abort -> release, per room released
    unreleased: int = 0  #: rooms still held at the end (never freed without proof)
    proofs: tuple[str, ...] = ()
    skipped: str = ""

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


class Stopped(Exception):
    """Raised in a mode's thread once :func:`run` was interrupted."""


#: How long an interrupted :func:`run` waits for its threads to unwind
#: (their hosts go with them) after it closed their clusters.
UNWIND_S = 15.0


@attrs.define(eq=False)
class _Stop:
    """What an interrupted :func:`run` tears down: every wait of a mode's
    thread checks :attr:`event`, and the clusters the threads made are
    closed from the interrupted thread, once each."""

    event: threading.Event = attrs.Factory(threading.Event)
    _open: list[Cluster] = attrs.Factory(list)
    _lock: threading.Lock = attrs.Factory(threading.Lock)

    def check(self) -> None:
        if self.event.is_set():
            raise Stopped("the fault run was interrupted")

    def until(self, cond: Callable[[], bool]) -> Callable[[], bool]:
        """``cond`` for :func:`wait_for`, raising :class:`Stopped` once stopped."""

        def checked() -> bool:
            self.check()
            return cond()

        return checked

    def sleep(self, seconds: float) -> None:
        if self.event.wait(max(0.0, seconds)):
            self.check()

    def opened(self, cluster: Cluster) -> None:
        with self._lock:
            self._open.append(cluster)
        self.check()  # stopped while it started: closed by whoever stopped, or below

    def close(self, cluster: Cluster) -> None:
        with self._lock:
            if cluster not in self._open:
                return
            self._open.remove(cluster)
        cluster.close()

    def stop(self) -> None:
        self.event.set()
        with self._lock:
            clusters, self._open = self._open, []
        for cluster in clusters:
            with contextlib.suppress(Exception):
                cluster.close()


def run(rooms: int = 1, on_step: Callable[[str], None] = print) -> list[Outcome]:
    """Every fault, ``rooms`` rooms each, in both modes (side by side, on two
    threads: most of a fault is waiting for a deadline)."""
    results: dict[str, list[Outcome]] = {}
    stop = _Stop()

    def one(mode: str) -> None:
        try:
            results[mode] = _mode(mode, rooms, on_step, stop)
        except BaseException:
            if not stop.event.is_set():  # else it failed because its cluster was closed under it
                raise

    # Daemons: an interrupted run returns once its clusters are closed and
    # its hosts gone (below), never waiting on a thread that has not noticed.
    threads = [threading.Thread(target=one, args=(m,), name=m, daemon=True) for m in ("kvconn", "legacy")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException:
        stop.stop()
        deadline = time.monotonic() + UNWIND_S
        for t in threads:  # each leaves its hosts on the way out
            t.join(max(0.0, deadline - time.monotonic()))
        raise
    missing = [m for m in ("kvconn", "legacy") if m not in results]
    if missing:
        raise RuntimeError(f"the fault run of {', '.join(missing)} failed (its error is above)")
    return results["kvconn"] + results["legacy"]


def _mode(mode: str, rooms: int, on_step: Callable[[str], None], stop: _Stop) -> list[Outcome]:
    """One cluster: its ranks in a namespace of their own when one can be
    built (then also the partition), every fault in turn."""
    legacy = mode == "legacy"
    # One page a chunk, 0.2 s a chunk: in a partition the ranks are still
    # writing the room well past decode's deadline, each chunk within its own.
    options = {
        "piece_bytes": "16384",
        "piece_delay_s": "0.1",
        "freeze_chunks": ",".join(f"0:{_room('frozen', i)}:0" for i in range(rooms)),
        "late_chunks": ",".join(f"0:{_room('late_queue', i)}:0" for i in range(rooms)),
        "late_delivery_s": str(LATE_S),
    }
    with contextlib.ExitStack() as stack:
        # Decode (this process) on one host, the ranks on another; the
        # ranks share this machine's /dev/shm (loopback's data plane).
        link: Host | None = None
        where: dict[str, str] = {}
        on_decode_host: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        try:
            stop.check()
            fabric = stack.enter_context(hosts.hosts(("decode", "prefill0")))
            link = fabric["prefill0"]
            where = {"decode_host": fabric["decode"].ip, "rank_host": link.ip, "netns": link.netns}
            on_decode_host = fabric["decode"].entered()
        except HostsUnavailable as exc:
            skipped = str(exc)
        # Pages enough that no room gets another's: in the legacy mode a page a
        # late write reached goes back to the pool, and a room given it would
        # look written before its rank wrote a byte.
        npages = rooms * (2 * PAGES + 2 * PAGES)
        with on_decode_host:
            c = stack.enter_context(_cluster(legacy, options, stop, num_pages=npages, chunk_pages=1, **where))
        out = []
        for fault in FAULTS:
            stop.check()
            on_step(f"{mode}: {fault}")
            if fault == "partition" and link is None:
                out.append(Outcome(fault, mode, skipped=skipped))
            else:
                out.append(_measure(c, fault, mode, rooms, link, stop))
        return out


def _room(fault: str, i: int) -> int:
    return 1000 * (1 + FAULTS.index(fault)) + i


@attrs.define
class _Tally:
    corrupted: int = 0
    quarantined: int = 0
    recovery: list[float] = attrs.Factory(list)
    proofs: list[str] = attrs.Factory(list)
    unreleased: int = 0

    def outcome(self, fault: str, mode: str, rooms: int, pages: int) -> Outcome:
        return Outcome(
            fault,
            mode,
            rooms,
            rooms * pages,
            self.corrupted,
            self.quarantined,
            tuple(self.recovery),
            self.unreleased,
            tuple(sorted(set(self.proofs))),
        )


def _measure(c: Cluster, fault: str, mode: str, rooms: int, link: Host | None, stop: _Stop) -> Outcome:
    tally = _Tally()
    npages = 2 * PAGES if fault == "partition" else PAGES
    for i in range(rooms):
        room = _room(fault, i)
        before = _rank_counts(c)
        rx, pages = c.open(room, npages, exclude=sorted(c.pages.returned_once))
        if fault == "frozen":  # half way through its chunk
            frozen = functools.partial(all_threads_stopped, c.ranks[0].proc.pid)
            wait_for(stop.until(frozen), 30, "rank 0 stopped", poll=0.001)
        elif fault == "late_queue":  # rank 0 posted the chunk: its first half is in
            wait_for(stop.until(functools.partial(_rank_wrote, c, pages[0], 0)), 30, "rank 0's first bytes")
        else:
            wait_for(stop.until(functools.partial(_landed, c, pages)), 30, "first bytes")
        if fault == "partition" and link is not None:
            link.cut()
        t0 = time.monotonic()
        rx.abort()
        if fault == "late_queue":
            stop.sleep(t0 + LATE_S - time.monotonic())  # the queued half lands about now
        else:
            stop.sleep(t0 + DEADLINE_S + PAST_DEADLINE_S - time.monotonic())
            if fault == "frozen":
                c.ranks[0].signal(signal.SIGCONT)
            elif link is not None:
                link.heal()
        _settle(c, room, tally, stop)
        _quiet(c, before, fault, stop)
        tally.corrupted += len(c.late_pages(pages))
        tally.quarantined += npages if _was_quarantined(c, room) else 0
    return tally.outcome(fault, mode, rooms, npages)


@contextlib.contextmanager
def _cluster(legacy: bool, options: dict[str, str], stop: _Stop, **kw: Any) -> Iterator[Cluster]:
    c = Cluster(
        write_timeout_s=WRITE_S,
        abort_timeout_s=DEADLINE_S,
        backend_options=options,
        legacy=legacy,
        **kw,
    )
    try:
        stop.opened(c)
        yield c
    finally:
        stop.close(c)


def _rank_counts(c: Cluster) -> list[tuple[float, float]]:
    """Per rank: ABORTs handled, fences that succeeded."""
    out = []
    for rank in c.ranks:
        samples = rank.metrics()
        aborts = samples.get(("kvconn_messages_total", frozenset({("type", "Abort")})), 0.0)
        out.append((aborts, samples.get(("kvconn_fences_total", frozenset({("result", "ok")})), 0.0)))
    return out


def _quiet(c: Cluster, before: list[tuple[float, float]], fault: str, stop: _Stop) -> None:
    """Wait until the fault's late bytes have had their chance to land."""
    if fault in ("frozen", "late_queue"):
        # Rank 0 fences the chunk it could not settle in time, and the fence
        # returns only once the transfer handed to hardware has landed.
        wait_for(stop.until(lambda: _rank_counts(c)[0][1] > before[0][1]), 60, "rank 0's fence")
        return
    # Partitioned ranks write on until the healed link brings the ABORT; a
    # chunk in flight then ends by its writer deadline.
    wait_for(
        stop.until(lambda: all(n[0] > b[0] for n, b in zip(_rank_counts(c), before, strict=True))),
        60,
        "ABORTs",
    )
    stop.sleep(2 * WRITE_S)


def _landed(c: Cluster, pages: list[int]) -> bool:
    return c.landed_bytes(pages) > 0


def _rank_wrote(c: Cluster, page: int, rank: int) -> bool:
    shard = c.dec.region.read(page * c.page_bytes + rank * c.shard, c.shard)
    return shard.count(CANARY) < len(shard)


def _settle(c: Cluster, room: int, tally: _Tally, stop: _Stop) -> None:
    """Wait (bounded) for the room's release; late bytes land or not."""
    try:
        wait_for(stop.until(lambda: c.released(room) is not None), 20, f"release of room {room}")
    except AssertionError:
        tally.unreleased += 1
        return
    rel = c.released(room)
    assert rel is not None
    tally.recovery.append(rel.held_for)
    tally.proofs.append(rel.proof.value)


def _was_quarantined(c: Cluster, room: int) -> bool:
    rel = c.released(room)
    return rel is not None and rel.quarantined_for > 0


def iter_rows(outcomes: list[Outcome]) -> Iterator[tuple[str, Outcome | None, Outcome | None]]:
    """(fault, kvconn's outcome, legacy's outcome), in FAULTS order."""
    by = {(o.fault, o.mode): o for o in outcomes}
    for fault in FAULTS:
        k, leg = by.get((fault, "kvconn")), by.get((fault, "legacy"))
        if k or leg:
            yield fault, k, leg
