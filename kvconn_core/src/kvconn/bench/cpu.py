"""What this machine's CPUs did during a measurement (Linux ``/proc/stat``).

On a shared VM the hypervisor runs other guests on our virtual CPUs ("steal");
every thread of an abort's path then waits for a CPU it was promised, and the
release latency grows for reasons no code of ours has. The bench reports the
shares beside its latency figures so a reader can tell the two apart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

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
