"""The bench's CPU shares (busy, stolen by the hypervisor, idle) from /proc/stat."""

from __future__ import annotations

import sys

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
