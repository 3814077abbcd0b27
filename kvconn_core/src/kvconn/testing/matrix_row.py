"""One row of the fault matrix (:mod:`kvconn.testing.scenarios`): one fault
in one mode, on fresh processes, and what it is measured by.

A row starts a decode process (:mod:`kvconn.testing.matrix_decode`: a
decode endpoint and an open-loop client) and two prefill rank processes
(:mod:`kvconn.testing.faults`), on two hosts when they can be made; lets
its users arrive, injects the fault, lets them arrive on, waits until every
request ended, every page came back (bounded), and late bytes had their
chance; then reads what the processes reported (every event stamped with
the machine's shared monotonic clock) into an :class:`Outcome`.

The deadlines and the load every row runs with are here, in one place, and
so is how each figure is judged: a request has hung past its fault's bound;
a rank called down had been alive and reachable for the EVIDENCE_S before
the call (no fault window of the row touched it) was called down falsely;
a page's wait counts from the later of the fault's proof point and its
room's abort.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvconn.testing.child import Child, ChildError, StderrLog
from kvconn.testing.cluster import Cluster, Rank
from kvconn.testing.hosts import Fabric, Host
from kvconn.testing.waiting import wait_for

# -- the deadlines every row runs with (short, so that a row takes seconds) ------
WRITE_S = 0.4  #: a writer's deadline (post to settled)
HEARTBEAT_S = 0.25  #: decode Hellos a silent rank this often
PEER_S = 1.0  #: a rank whose Hello went unanswered this long is down
DEADLINE_S = 2.0  #: decode's deadline after an abort (the timeout-only mode frees then)
BRIEF_S = 0.5  #: a freeze or a cut shorter than PEER_S
#: A fault past a deadline clears this long after it (the timeout-only mode
#: has freed the pages by then, on a machine at load 40 too).
PAST_S = 0.7
LATE_S = DEADLINE_S + 1.0  #: how late the queued half of a chunk lands, after its post
OVERLOAD_S = 3.0  #: how long the CPU hogs run
HOGS_PER_CPU = 10
#: What a loaded machine adds to any bound (this one is shared, at load 10-50).
SLACK_S = 3.0
#: Every request ends within this of its arrival while a rank cannot answer:
#: the rank is asked within two heartbeats of its silence, called down one
#: heartbeat after PEER_S, and its rooms then fail at once (a retry too).
SILENT_BOUND_S = PEER_S + 3 * HEARTBEAT_S + SLACK_S
DECODE_FROZEN_S = DEADLINE_S + PAST_S  #: decode itself stopped past every deadline
#: The done-when target: pages back this soon after a proof became possible.
CAPACITY_TARGET_S = 1.0

# -- the load ----------------------------------------------------------------------
RATE = 4.0  #: requests per second, arriving whatever happens
PAGES = 4  #: pages per request
NUM_PAGES = 256
PAGE_BYTES = 16 << 10  #: two ranks, 8 KiB shards
#: Loopback writes a 2 KiB piece each 10 ms: 40 ms a page and rank, a room
#: in flight long enough for a fault to meet it.
OPTIONS_BASE = {"piece_bytes": "2048", "piece_delay_s": "0.01", "late_delivery_s": str(LATE_S)}
FREEZE_ROOM, LATE_ROOM, CUT_ROOM, STORM_ROOM = 1, 2, 3, 100
CUT_PAGES = 64  #: long enough that its writers are still at it past decode's deadline
STORM_ROOMS = 16
OPTIONS = {**OPTIONS_BASE, "freeze_chunks": f"0:{FREEZE_ROOM}:0", "late_chunks": f"0:{LATE_ROOM}:0"}
WARM_S = 0.6  #: requests before the fault
TAIL_S = 1.5  #: requests after it cleared
#: How long the row waits, once every request ended, for the pages held to come back.
CAPACITY_WAIT_S = 6.0
#: A rank called down is judged on this window before the call: alive and
#: reachable throughout it, the call was false.
EVIDENCE_S = PEER_S + 2 * HEARTBEAT_S
BARRIER_S = 180.0  #: how long one mode waits for the other at a row
#: How long an interrupted :func:`run` waits for its threads to unwind.
UNWIND_S = 15.0


@attrs.frozen
class Outcome:
    """One fault in one mode (docs/bench.md explains each field)."""

    fault: str
    mode: str  #: "kvconn" or "legacy"
    bound_s: float = 0.0
    requests: int = 0
    answered: int = 0  #: bytes verified
    recomputed: int = 0  #: of those, answered by the retry after a failure
    failed: int = 0  #: with a reason (its retry too)
    hung: int = 0  #: requests not ended within bound_s, and hung_prefill
    hung_prefill: int = 0  #: rooms a rank still worked on past bound_s
    wrong_answers: int = 0  #: SUCCESS with another room's bytes in a page
    corrupted: int = 0  #: pages written after decode handed them back
    pinned_page_seconds: float = 0.0
    capacity_back_s: float | None = None
    capacity_note: str = ""  #: why capacity_back_s is None
    false_rank_downs: int = 0
    rank_downs: int = 0
    #: Each rank-down: rank, seconds from the fault, reason, "(false)".
    downs: tuple[str, ...] = ()
    proofs: tuple[str, ...] = ()  #: of the releases
    reasons: tuple[tuple[str, int], ...] = ()  #: failures and hangs, by reason
    load: float = 0.0  #: the machine's 1-minute load average, the higher of the row's start and end
    misses: tuple[str, ...] = ()  #: kvconn's targets this row missed
    skipped: str = ""
    error: str = ""

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


class Stopped(Exception):
    """Raised in a mode's thread once :func:`run` was interrupted."""


# -- what an interrupted run tears down ----------------------------------------------
@attrs.define(eq=False)
class Stop:
    """Every wait of a mode's thread checks :attr:`event`; what the threads
    opened (processes, hogs) is closed from the interrupted thread, once."""

    event: threading.Event = attrs.Factory(threading.Event)
    barrier: threading.Barrier = attrs.Factory(lambda: threading.Barrier(2, timeout=BARRIER_S))
    _open: list[Any] = attrs.Factory(list)
    _lock: threading.Lock = attrs.Factory(threading.Lock)

    def check(self) -> None:
        if self.event.is_set():
            raise Stopped("the fault run was interrupted")

    def until(self, cond: Callable[[], bool]) -> Callable[[], bool]:
        def checked() -> bool:
            self.check()
            return cond()

        return checked

    def sleep(self, seconds: float) -> None:
        if self.event.wait(max(0.0, seconds)):
            self.check()

    def meet(self) -> None:
        """Wait for the other mode at this row (it meets the fault now too)."""
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            self.check()
            raise RuntimeError("the other mode's thread did not reach this row") from None

    def opened(self, thing: Any) -> None:
        with self._lock:
            self._open.append(thing)
        self.check()  # stopped while it started: closed by whoever stopped, or by the caller

    def close(self, thing: Any) -> None:
        with self._lock:
            if thing not in self._open:
                return
            self._open.remove(thing)
        thing.close()

    def stop(self) -> None:
        self.event.set()
        self.barrier.abort()
        with self._lock:
            things, self._open = self._open, []
        for thing in things:
            with contextlib.suppress(Exception):
                thing.close()


class Hogs:
    """CPU hogs shared by both modes' threads: the first :meth:`on` starts
    ``HOGS_PER_CPU`` per CPU, the last :meth:`off` kills them, by pid."""

    def __init__(self, per_cpu: int = HOGS_PER_CPU) -> None:
        self.count = per_cpu * (os.cpu_count() or 1)
        self._lock = threading.Lock()
        self._users = 0
        self._procs: list[subprocess.Popen[bytes]] = []

    def on(self) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._procs = [
                    subprocess.Popen(
                        ["sh", "-c", "while :; do :; done"],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                    for _ in range(self.count)
                ]

    def pids(self) -> list[int]:
        with self._lock:
            return [proc.pid for proc in self._procs]

    def off(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users <= 0:
                self._kill()

    def close(self) -> None:
        with self._lock:
            self._users = 0
            self._kill()

    def _kill(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait(10)


# -- the decode process ----------------------------------------------------------------
class MatrixDecode(Child):
    """A :mod:`kvconn.testing.matrix_decode` process."""

    failure = ChildError

    def __init__(self, args: dict[str, Any], netns: str | None) -> None:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        # Its stderr (and its resource tracker's, which outlives a killed
        # decode and reports its segment) goes to a file, read back if it dies.
        super().__init__("kvconn.testing.matrix_decode", args, prefix, log=StderrLog(), name="matrix decode")
        self.address = self.segment = ""
        self.gone_at: float | None = None  #: when it was killed

    def bootstrap(self, prefill: Sequence[str], timeout: float = 60) -> None:
        self.send_json({"prefill": list(prefill)})
        ready = self.expect(timeout, "decode ready", event="ready")
        self.address, self.segment = ready["address"], ready["segment"]

    def send_json(self, cmd: dict[str, Any]) -> None:
        self.send_line(json.dumps(cmd))

    def ask(self, reply: str, timeout: float = 30, **cmd: Any) -> dict[str, Any]:
        self.send_json(cmd)
        return self.expect(timeout, f"decode's {reply}", event=reply)

    def kill_now(self) -> float:
        t = time.monotonic()
        self.kill()
        self.gone_at = t
        with contextlib.suppress(OSError):  # its shared memory outlives it
            os.unlink(f"/dev/shm/{self.segment.lstrip('/')}")
        return t

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.history() if e.get("event") == name]


#: When a fault left a rank (None: every rank) dead, frozen or cut off:
#: (rank, start, end; None: for good).
Window = tuple[int | None, float, float | None]


# -- one row -------------------------------------------------------------------------
@attrs.define(eq=False)
class Row:
    """One fault in one mode: its processes, and what the fault did when."""

    fault: str
    mode: str
    bound: float  #: a request not ended this long after its arrival has hung
    stop: Stop
    hogs: Hogs
    cluster: Cluster
    decodes: list[MatrixDecode]
    fabric: Fabric | None
    link: Host | None
    windows: list[Window] = attrs.Factory(list)
    fault_at: float = 0.0
    #: When a proof became possible (None: not applicable, the pages died).
    proof_at: float | None = None
    capacity_note: str = ""
    cut: bool = False

    @property
    def decode(self) -> MatrixDecode:
        return self.decodes[-1]

    @property
    def legacy(self) -> bool:
        return self.mode == "legacy"

    def rank(self, r: int) -> Rank:
        return self.cluster.ranks[r]

    def start_client(self, seconds: float) -> None:
        """Users arrive at RATE for ``seconds`` (a count: both modes get as many)."""
        count = round(RATE * seconds)
        self.decode.send_json(
            {"op": "start", "rate": RATE, "pages": PAGES, "bound_s": self.bound, "count": count}
        )

    def victim(self, room: int, npages: int) -> None:
        self.decode.ask("opened", op="victim", room=room, pages=npages)

    def abort(self, room: int) -> float:
        t = time.monotonic()
        self.decode.ask("aborted", op="abort", room=room)
        return t

    def landed(self, room: int, rank: int | None = None) -> int:
        return int(self.decode.ask("landed", op="landed", room=room, rank=rank)["bytes"])


def start_decode(
    mode: str, fabric: Fabric | None, stop: Stop, port: int = 0, first_room: int = 1 << 20
) -> MatrixDecode:
    legacy = mode == "legacy"
    host = fabric["decode"].ip if fabric is not None else "127.0.0.1"
    config = {
        "write_timeout_s": WRITE_S,
        "abort_timeout_s": DEADLINE_S,
        "resend_interval_s": 0.25,
        "heartbeat_interval_s": HEARTBEAT_S,
        "peer_timeout_s": PEER_S,
        "bootstrap_timeout_s": 20.0,
        "host": host,
        "port": port,
        "backend_options": OPTIONS,
        "unsafe_release_at_deadline": legacy,
        "acks_enabled": not legacy,
    }
    args = {
        "backend": "loopback",
        "num_pages": NUM_PAGES,
        "page_bytes": PAGE_BYTES,
        "num_ranks": 2,
        "config": config,
        "first_room": first_room,
    }
    decode = MatrixDecode(args, fabric["decode"].netns if fabric is not None else None)
    stop.opened(decode)
    return decode


def bootstrap_at_same_address(row: Row, port: int, timeout: float = 10.0) -> None:
    """Bootstrap the row's newest decode, started at ``port``, the address of
    one just killed: ZMQ frees it a moment after the old process is reaped,
    so one that could not bind is started again."""
    addresses = [r.address for r in row.cluster.ranks]
    deadline = time.monotonic() + timeout
    while True:
        try:
            row.decode.bootstrap(addresses)
            return
        except ChildError:
            if time.monotonic() > deadline:
                raise
            row.stop.close(row.decode)
            row.decodes[-1] = start_decode(row.mode, row.fabric, row.stop, port, first_room=2 << 20)
            time.sleep(0.05)


def start_row(fault: str, mode: str, bound: float, fabric: Fabric | None, stop: Stop, hogs: Hogs) -> Row:
    decode = start_decode(mode, fabric, stop)  # it imports while the ranks start
    link = fabric["prefill0"] if fabric is not None else None
    where: dict[str, Any] = {}
    if fabric is not None and link is not None:
        where = {"decode_host": fabric["decode"].ip, "rank_host": link.ip, "netns": link.netns}
    try:
        cluster = Cluster(
            num_ranks=2,
            num_pages=NUM_PAGES,
            page_bytes=PAGE_BYTES,
            chunk_pages=1,
            write_timeout_s=WRITE_S,
            abort_timeout_s=DEADLINE_S,
            backend_options=OPTIONS,
            legacy=mode == "legacy",
            start_decode=False,
            **where,
        )
    except BaseException:
        stop.close(decode)
        raise
    row = Row(fault, mode, bound, stop, hogs, cluster, [decode], fabric, link)
    try:
        stop.opened(cluster)
        decode.bootstrap([r.address for r in cluster.ranks])
    except BaseException:
        close_row(row)
        raise
    return row


def close_row(row: Row) -> None:
    # Every process is told at once (its stdin closed), then each is waited for.
    for child in [*row.decodes, *row.cluster.ranks, *row.cluster.extra_ranks]:
        with contextlib.suppress(OSError, ValueError):
            if child.proc.poll() is None:
                child.signal(signal.SIGCONT)
                assert child.proc.stdin is not None
                child.proc.stdin.close()
    for decode in row.decodes:
        row.stop.close(decode)
        if decode.segment:
            with contextlib.suppress(OSError):  # gone with a clean exit; a killed one's is left
                os.unlink(f"/dev/shm/{decode.segment.lstrip('/')}")
    row.stop.close(row.cluster)
    if row.cut and row.link is not None:
        with contextlib.suppress(Exception):
            row.link.heal()


def measure(row: Row, inject: Callable[[Row], None], span_s: float) -> Outcome:
    """The row's users arrive for WARM_S, the fault's ``span_s`` and TAIL_S;
    ``inject`` strikes after WARM_S and returns once the fault cleared (or
    for good)."""
    load = os.getloadavg()[0]
    started = time.monotonic()
    row.start_client(WARM_S + span_s + TAIL_S)
    row.stop.sleep(WARM_S)
    row.fault_at = time.monotonic()
    inject(row)
    row.stop.sleep(TAIL_S)
    # Every user of the schedule arrives, however soon this mode's fault
    # cleared (a restart's length varies): both modes get as many.
    row.stop.sleep(started + WARM_S + span_s + TAIL_S - time.monotonic())
    live = [d for d in row.decodes if d.gone_at is None]
    for d in live:
        d.send_json({"op": "stop"})
    for d in live:
        d.ask("idle", row.bound + 10, op="idle", timeout_s=row.bound + 5)
    capacity = _capacity(row)
    row.stop.sleep(2 * WRITE_S)  # late bytes have their chance to land
    hung_prefill = _hung_prefill(row)
    finals = [d.ask("final", op="final") for d in live]
    load = max(load, os.getloadavg()[0])  # the 1-minute average lags: the busier end
    return _outcome(row, load, time.monotonic(), capacity, hung_prefill, finals)


def _held(decode: MatrixDecode) -> list[tuple[float, int]]:
    return [(float(e["t"]), int(e["pages"])) for e in decode.named("held")]


def _level(series: list[tuple[float, int]], at: float) -> int:
    level = 0
    for t, pages in series:
        if t > at:
            break
        level = pages
    return level


def _capacity(row: Row) -> tuple[float | None, str]:
    """(the longest any page stayed held after a proof for it became
    possible: from the later of the fault's proof point and the room's
    abort, to its release; or None, and why)."""
    if row.proof_at is None or row.decode.gone_at is not None or len(row.decodes) > 1:
        return None, row.capacity_note or "n/a: no proof point"
    decode, proof = row.decode, row.proof_at
    before = _level(_held(decode), row.fault_at)

    def held() -> int:
        series = _held(decode)
        return series[-1][1] if series else 0

    with contextlib.suppress(AssertionError):  # every request ended: the held pages are the fault's
        wait_for(row.stop.until(lambda: held() <= before), CAPACITY_WAIT_S, "pages")
    if held() > before:
        return None, f"{held() - before} pages still held {time.monotonic() - proof:.1f} s after the proof"
    return capacity_back(decode.named("released"), proof), ""


def capacity_back(releases: Sequence[dict[str, Any]], proof_at: float) -> float:
    """The longest any released room (``{"t": released at, "held_for":
    abort to release}``) stayed held after a proof for it became possible:
    from the later of ``proof_at`` and its abort, to its release (0 for
    those released before either)."""
    lags = [min(float(e["held_for"]), float(e["t"]) - proof_at) for e in releases]
    return max([0.0, *lags])


def _hung_prefill(row: Row) -> int:
    """Rooms a live rank still works on, asked for longer ago than the bound."""
    hung = 0
    for rank in row.cluster.ranks:
        if rank.proc.poll() is None:
            hung += sum(1 for _, age in rank.unsettled() if age > row.bound)
    return hung


def false_downs(windows: Sequence[Window], downs: Sequence[dict[str, Any]]) -> int:
    """Rank-downs (``{"rank", "at"}``) of a rank no fault window (rank or
    None for every rank, start, end or None for good) touched in the
    EVIDENCE_S before the call: it was alive and reachable all along."""
    return sum(1 for down in downs if not _touched(windows, down))


def _touched(windows: Sequence[Window], down: dict[str, Any]) -> bool:
    at, rank = float(down["at"]), int(down["rank"])
    return any(
        (who is None or who == rank) and start <= at and (end is None or end >= at - EVIDENCE_S)
        for who, start, end in windows
    )


def down_log(windows: Sequence[Window], downs: Sequence[dict[str, Any]], fault_at: float) -> list[str]:
    """One line per rank-down: which rank, when (from the fault), why, and
    whether it was false."""
    return [
        f"rank {d['rank']} at {float(d['at']) - fault_at:+.2f} s: {d['reason']}"
        + ("" if _touched(windows, d) else " (false)")
        for d in sorted(downs, key=lambda d: float(d["at"]))
    ]


_NUMBERS = re.compile(r"\d+(\.\d+)?")


def _reason(text: str) -> str:
    """A failure's reason with its numbers taken out: one count per kind."""
    return _NUMBERS.sub("N", text)[:100]


def _outcome(
    row: Row,
    load: float,
    ended: float,
    capacity: tuple[float | None, str],
    hung_prefill: int,
    finals: list[dict[str, Any]],
) -> Outcome:
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    recomputed = corrupted = requests = 0
    pinned = 0.0
    downs: list[dict[str, Any]] = []
    proofs: set[str] = set()
    for decode in row.decodes:
        ended_ids = set()
        for e in decode.named("request"):
            ended_ids.add(e["id"])
            outcomes[e["outcome"]] += 1
            if e["outcome"] == "answered" and e["tries"] > 1:
                recomputed += 1
            if e["outcome"] in ("failed", "hung"):
                reasons[_reason(e["reason"])] += 1
        arrived = {e["id"] for e in decode.named("arrived")}
        requests += len(arrived)
        lost = len(arrived - ended_ids)
        if lost and decode.gone_at is not None:  # its users' connections broke: they know at once
            outcomes["failed"] += lost
            reasons["decode's process was killed"] += lost
        elif lost:
            outcomes["hung"] += lost
            reasons["never ended"] += lost
        corrupted += sum(len(e["pages"]) for e in decode.named("corrupt"))
        downs += decode.named("rank_down")
        proofs |= {e["proof"] for e in decode.named("released")}
        pinned += page_seconds(_held(decode), decode.gone_at or ended)
    corrupted += sum(len(f["late_pages"]) for f in finals)
    return Outcome(
        row.fault,
        row.mode,
        row.bound,
        requests=requests,
        answered=outcomes["answered"],
        recomputed=recomputed,
        failed=outcomes["failed"],
        hung=outcomes["hung"] + hung_prefill,
        hung_prefill=hung_prefill,
        wrong_answers=outcomes["wrong"],
        corrupted=corrupted,
        pinned_page_seconds=round(pinned, 3),
        capacity_back_s=None if capacity[0] is None else round(capacity[0], 3),
        capacity_note=capacity[1],
        false_rank_downs=false_downs(row.windows, downs),
        rank_downs=len(downs),
        downs=tuple(down_log(row.windows, downs, row.fault_at)),
        proofs=tuple(sorted(proofs)),
        reasons=tuple(reasons.most_common()),
        load=round(load, 1),
    )


def page_seconds(series: list[tuple[float, int]], end: float) -> float:
    """Page-seconds of a step function sampled at ``series``' times, up to ``end``."""
    total = 0.0
    for (t, pages), (t_next, _) in zip(series, [*series[1:], (end, 0)][: len(series)], strict=True):
        total += pages * max(0.0, min(t_next, end) - t)
    return total
