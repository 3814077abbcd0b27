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
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvconn.runtime.procs import wait_until_stopped
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


def run(rooms: int = 1, on_step: Callable[[str], None] = print) -> list[Outcome]:
    """Every fault, ``rooms`` rooms each, in both modes (side by side, on two
    threads: most of a fault is waiting for a deadline)."""
    results: dict[str, list[Outcome]] = {}
    threads = [
        threading.Thread(target=lambda m=m: results.__setitem__(m, _mode(m, rooms, on_step)), name=m)
        for m in ("kvconn", "legacy")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = [m for m in ("kvconn", "legacy") if m not in results]
    if missing:
        raise RuntimeError(f"the fault run of {', '.join(missing)} failed (its error is above)")
    return results["kvconn"] + results["legacy"]


def _mode(mode: str, rooms: int, on_step: Callable[[str], None]) -> list[Outcome]:
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
            c = stack.enter_context(_cluster(legacy, options, num_pages=npages, chunk_pages=1, **where))
        out = []
        for fault in FAULTS:
            on_step(f"{mode}: {fault}")
            if fault == "partition" and link is None:
                out.append(Outcome(fault, mode, skipped=skipped))
            else:
                out.append(_measure(c, fault, mode, rooms, link))
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


def _measure(c: Cluster, fault: str, mode: str, rooms: int, link: Host | None) -> Outcome:
    tally = _Tally()
    npages = 2 * PAGES if fault == "partition" else PAGES
    for i in range(rooms):
        room = _room(fault, i)
        before = _rank_counts(c)
        rx, pages = c.open(room, npages, exclude=sorted(c.pages.returned_once))
        if fault == "frozen":
            wait_until_stopped(c.ranks[0].proc.pid, timeout=30)  # half way through its chunk
        elif fault == "late_queue":  # rank 0 posted the chunk: its first half is in
            wait_for(lambda page=pages[0]: _rank_wrote(c, page, 0), 30, "rank 0's first bytes")  # type: ignore[misc]
        else:
            wait_for(lambda pages=pages: c.landed_bytes(pages) > 0, 30, "first bytes")  # type: ignore[misc]
        if fault == "partition" and link is not None:
            link.cut()
        t0 = time.monotonic()
        rx.abort()
        if fault == "late_queue":
            _until(t0 + LATE_S)  # the queued half lands about now
        else:
            _until(t0 + DEADLINE_S + PAST_DEADLINE_S)
            if fault == "frozen":
                c.ranks[0].signal(signal.SIGCONT)
            elif link is not None:
                link.heal()
        _settle(c, room, tally)
        _quiet(c, before, fault)
        tally.corrupted += len(c.late_pages(pages))
        tally.quarantined += npages if _was_quarantined(c, room) else 0
    return tally.outcome(fault, mode, rooms, npages)


@contextlib.contextmanager
def _cluster(legacy: bool, options: dict[str, str], **kw: Any) -> Iterator[Cluster]:
    c = Cluster(
        write_timeout_s=WRITE_S,
        abort_timeout_s=DEADLINE_S,
        backend_options=options,
        legacy=legacy,
        **kw,
    )
    try:
        yield c
    finally:
        c.close()


def _first_bytes(c: Cluster, pages: list[int]) -> None:
    wait_for(lambda: c.landed_bytes(pages) > 0, 30, "first bytes")


def _rank_counts(c: Cluster) -> list[tuple[float, float]]:
    """Per rank: ABORTs handled, fences that succeeded."""
    out = []
    for rank in c.ranks:
        samples = rank.metrics()
        aborts = samples.get(("kvconn_messages_total", frozenset({("type", "Abort")})), 0.0)
        out.append((aborts, samples.get(("kvconn_fences_total", frozenset({("result", "ok")})), 0.0)))
    return out


def _quiet(c: Cluster, before: list[tuple[float, float]], fault: str) -> None:
    """Wait until the fault's late bytes have had their chance to land."""
    if fault in ("frozen", "late_queue"):
        # Rank 0 fences the chunk it could not settle in time, and the fence
        # returns only once the transfer handed to hardware has landed.
        wait_for(lambda: _rank_counts(c)[0][1] > before[0][1], 60, "rank 0's fence")
        return
    # Partitioned ranks write on until the healed link brings the ABORT; a
    # chunk in flight then ends by its writer deadline.
    wait_for(lambda: all(n[0] > b[0] for n, b in zip(_rank_counts(c), before, strict=True)), 60, "ABORTs")
    time.sleep(2 * WRITE_S)


def _rank_wrote(c: Cluster, page: int, rank: int) -> bool:
    shard = c.dec.region.read(page * c.page_bytes + rank * c.shard, c.shard)
    return shard.count(CANARY) < len(shard)


def _until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def _settle(c: Cluster, room: int, tally: _Tally) -> None:
    """Wait (bounded) for the room's release; late bytes land or not."""
    try:
        wait_for(lambda: c.released(room) is not None, 20, f"release of room {room}")
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
