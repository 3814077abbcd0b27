"""The bench's CPU shares (busy, stolen by the hypervisor, idle) from /proc/stat."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvconn.bench import cpu


def test_shares_split_ticks_into_busy_steal_and_idle() -> None:
    before = (100, 0, 50, 1000, 10, 0, 5, 20)
    # +60 user, +10 nice, +20 system, +80 idle, +0 iowait, +5 irq, +5 softirq, +20 steal
    after = (160, 10, 70, 1080, 10, 5, 10, 40)
    got = cpu.shares(before, after)
    assert got == pytest.approx({"busy": 50.0, "steal": 10.0, "idle": 40.0})


def test_unknown_or_empty_intervals_give_no_shares() -> None:
    sample = (1, 2, 3, 4, 5, 6, 7, 8)
    assert cpu.shares(None, sample) == {}
    assert cpu.shares(sample, sample) == {}


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/stat is Linux's")
def test_sample_reads_this_machine() -> None:
    first = cpu.sample()
    assert first is not None and len(first) == len(cpu.FIELDS)
    sum(range(10**6))  # some CPU time passes
    second = cpu.sample()
    assert second is not None and all(b >= a for a, b in zip(first, second, strict=True))


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/<pid>/stat is Linux's")
def test_process_seconds_counts_a_child_and_forgets_it_once_reaped() -> None:
    assert cpu.process_seconds() == pytest.approx(time.process_time(), abs=0.05)
    # The child burns 0.3 s of CPU by its own precise clock, says so, then
    # waits. /proc rounds user and system time down to clock ticks each, so
    # up to two ticks (20 ms at 100 Hz) may be missing from the sum.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\n"
            "print('burnt', flush=True)\nsys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "burnt\n"
        used = cpu.process_seconds(child.pid)
        assert used is not None and 0.25 <= used < 30
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert cpu.process_seconds(child.pid) is None
