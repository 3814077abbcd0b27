"""What this machine's CPUs did during a measurement (Linux ``/proc/stat``).

On a shared VM the hypervisor runs other guests on our virtual CPUs ("steal");
every thread of an abort's path then waits for a CPU it was promised, and the
release latency grows for reasons no code of ours has. The bench reports the
shares beside its latency figures so a reader can tell the two apart.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvconn.bench.stats import bucket_bound

T = TypeVar("T")

FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def sample() -> tuple[int, ...] | None:
    """Cumulative ticks of every CPU, in :data:`FIELDS` order (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
    except OSError:
        return None
    if len(first) < len(FIELDS) + 1 or first[0] != "cpu":
        return None
    return tuple(int(x) for x in first[1 : len(FIELDS) + 1])


def shares(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> dict[str, float]:
    """Percent of CPU time between two samples: ``busy`` (our guest's work),
    ``steal`` (taken by the hypervisor) and ``idle``. Empty if unknown."""
    if before is None or after is None:
        return {}
    d = dict(zip(FIELDS, (b - a for a, b in zip(before, after, strict=True)), strict=True))
    total = sum(d.values())
    if total <= 0:
        return {}
    busy = d["user"] + d["nice"] + d["system"] + d["irq"] + d["softirq"]
    return {
        "busy": 100 * busy / total,
        "steal": 100 * d["steal"] / total,
        "idle": 100 * (d["idle"] + d["iowait"]) / total,
    }


def process_seconds(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, every thread) process ``pid`` has used so
    far; this process if ``None``. ``None`` if unknown (exited, not Linux)."""
    if pid is None or pid == os.getpid():
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name (field 2) may hold spaces: split after its ')'
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Meter:
    """CPU used by the bench's processes (this one: decode's page owner; the
    rank child; the raw child) and the machine's shares, around one measurement."""

    def __init__(self, pids: Mapping[str, int | None]) -> None:
        self._pids = dict(pids)
        self._start: dict[str, float | None] = {}
        self._machine: tuple[int, ...] | None = None
        self.result: dict[str, float] = {}

    def __enter__(self) -> Meter:
        self._start = {name: process_seconds(pid) for name, pid in self._pids.items()}
        self._machine = sample()
        self.result = {}
        return self

    def __exit__(self, *exc: object) -> None:
        self.result = dict(shares(self._machine, sample()))
        for name, pid in self._pids.items():
            t0, t1 = self._start.get(name), process_seconds(pid)
            if t0 is not None and t1 is not None:
                self.result[name] = t1 - t0


def thread_seconds() -> dict[str, tuple[float, float]]:
    """(CPU seconds, seconds waiting for a CPU) of every thread of this
    process so far, summed by thread name: a Python thread's own, another's
    (ZMQ's, a transport library's) as the kernel names it. From
    ``/proc/self/task/*/schedstat`` (nanoseconds; ``stat`` counts 10 ms
    ticks). Empty where there is none."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, tuple[float, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited = (int(x) / 1e9 for x in f.read().split()[:2])
            name = names.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        old = out.get(name, (0.0, 0.0))
        out[name] = (old[0] + ran, old[1] + waited)
    return out


def part_of(thread: str) -> str:
    """Which part of a bench process a thread's CPU is: ``kvconn`` (its
    listener, transfer workers, fences and ZMQ's I/O threads), ``copy``
    (the loopback transport's NIC thread), ``engine`` (the bench's stand-in
    for an engine: decode's main thread, a rank's driver) or ``other``."""
    if thread.startswith(("kvconn-listen", "kvconn-worker", "kvconn-fence", "ZMQbg")):
        return "kvconn"
    if thread.startswith("kvconn-loopback"):
        return "copy"
    if thread in ("MainThread", "kvconn-driver") or thread.startswith("bench-decode"):
        return "engine"
    return "other"


def by_part(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """CPU seconds between two :func:`thread_seconds` by :func:`part_of`,
    and ``wait``: the seconds all threads spent waiting for a CPU."""
    parts = {"kvconn": 0.0, "copy": 0.0, "engine": 0.0, "other": 0.0, "wait": 0.0}
    for name, (ran, waited) in after.items():
        ran0, waited0 = before.get(name, (0.0, 0.0))
        parts[part_of(name)] += max(0.0, ran - ran0)
        parts["wait"] += max(0.0, waited - waited0)
    return parts


class CallTimer:
    """CPU seconds a thread spends inside kvconn's API (an engine's thread:
    the bench's stand-in engines), each call timed with ``time.thread_time``,
    the clock's own cost subtracted."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.counts = 0
        self._count_cost = 0.0
        clock = time.thread_time
        costs = []
        for _ in range(200):
            t0 = clock()
            costs.append(clock() - t0)
        self._cost = statistics.median(costs)

    def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.thread_time() - t0
            self.calls += 1

    def counted(self, fn: Callable[[], T]) -> T:
        """``fn()``, counted, not timed: for a call on every pass of a loop
        (``Receiver.poll``), whose timing would cost four times the call;
        :meth:`per_counted` says what one costs."""
        self.counts += 1
        return fn()

    def per_counted(self, fn: Callable[[], object], n: int = 500) -> None:
        """Time ``n`` calls of ``fn`` (a counted call) back to back: the CPU
        each counted call is taken to cost."""
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        self._count_cost = (time.thread_time() - t0) / n

    @property
    def total(self) -> float:
        """CPU seconds in kvconn: the timed calls, and the counted ones at
        the cost :meth:`per_counted` measured."""
        return max(0.0, self.seconds - self.calls * self._cost) + self.counts * self._count_cost


def per_request(before: Mapping[str, Any], after: Mapping[str, Any], requests: int) -> dict[str, Any]:
    """A run's cost per request between two snapshots (``ModeRun._cpu``), by part (microseconds of CPU, not wall time: it holds under load):
    decode's kvconn threads and its calls on the engine's thread, the
    stand-in engine's own; each rank's the same, and the transport's
    copy; page faults; and the time threads waited for a CPU."""
    n = max(1, requests)
    calls = after["calls"][0] - before["calls"][0]
    decode = by_part(before["threads"], after["threads"])
    parts: dict[str, Any] = {
        "decode": {
            "kvconn": (decode["kvconn"] + calls) / n * 1e6,
            "kvconn_threads": decode["kvconn"] / n * 1e6,
            "kvconn_calls": calls / n * 1e6,
            "engine": max(0.0, decode["engine"] - calls) / n * 1e6,
            "other": decode["other"] / n * 1e6,
            "cpu_wait": decode["wait"] / n * 1e6,
            "page_faults": (after["faults"] - before["faults"]) / n,
        },
        "ranks": [],
    }
    for r, (b, a) in enumerate(zip(before["ranks"], after["ranks"], strict=True)):
        threads = by_part(b["threads"], a["threads"])  # (ran, waited) pairs, as JSON lists
        rank_calls = a["calls_s"] - b["calls_s"]
        chunks = max(1, a["chunks"] - b["chunks"])
        own = [(le, n - dict(b["abort_own"]).get(le, 0)) for le, n in a["abort_own"]]
        acks = own[-1][1] if own else 0
        kvconn = threads["kvconn"] + rank_calls
        parts["ranks"].append(
            {
                "rank": r,
                "kvconn": kvconn / n * 1e6,
                "kvconn_per_chunk": kvconn / chunks * 1e6,
                "kvconn_calls": rank_calls / n * 1e6,
                "copy": threads["copy"] / n * 1e6,
                "engine": max(0.0, threads["engine"] - rank_calls) / n * 1e6,
                "other": threads["other"] / n * 1e6,
                "cpu_wait": threads["wait"] / n * 1e6,
                "page_faults": (a["faults"] - b["faults"]) / n,
                "chunks": chunks,
                # kvconn's own share of a release at this rank, ms
                "abort_own_ms": {
                    "acks": acks,
                    "mean": (a["abort_own_sum"] - b["abort_own_sum"]) / acks * 1e3 if acks else 0.0,
                    **{f"p{q}_at_most": (bucket_bound(own, q / 100) or 0.0) * 1e3 for q in (50, 99)},
                },
            }
        )
    ranks = parts["ranks"]
    parts["kvconn_decode"] = parts["decode"]["kvconn"]
    parts["kvconn_rank_per_chunk"] = max((r["kvconn_per_chunk"] for r in ranks), default=0.0)
    parts["page_faults"] = parts["decode"]["page_faults"] + sum(r["page_faults"] for r in ranks)
    parts["total"] = sum(parts["decode"][k] for k in ("kvconn", "engine", "other")) + sum(
        r[k] for r in ranks for k in ("kvconn", "copy", "engine", "other")
    )
    return parts
