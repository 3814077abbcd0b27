"""kvconn.testing.shm on real processes: what a SIGKILLed group leaves in /dev/shm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvconn.testing.shm import held_by_group, remove_unheld
from kvconn.testing.waiting import wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

# A child that maps one /dev/shm file and keeps another open, then waits.
CHILD = """
import mmap, sys, time
mapped = open(sys.argv[1], "w+b"); mapped.truncate(4096)
view = mmap.mmap(mapped.fileno(), 4096); mapped.close()
kept = open(sys.argv[2], "w")
print("ready", flush=True)
time.sleep(60)
"""


def test_a_killed_groups_files_are_removed_and_files_still_held_are_kept() -> None:
    tag = uuid.uuid4().hex[:12]
    mapped, kept, ours = (Path(f"/dev/shm/kvconn-test-{tag}-{n}") for n in ("mapped", "kept", "ours"))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(mapped), str(kept)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with ours.open("w") as still_ours:
            held = held_by_group(proc.pid)
            assert {mapped, kept} <= held
            assert ours not in held  # not the group's
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            assert mapped.exists() and kept.exists()  # a SIGKILLed process unlinks nothing
            assert sorted(remove_unheld(held | {ours})) == sorted([mapped, kept])
            assert not mapped.exists() and not kept.exists()
            assert ours.exists()  # still held (by this process): kept
            still_ours.write("x")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for path in (mapped, kept, ours):
            path.unlink(missing_ok=True)
    wait_for(lambda: proc.poll() is not None, 5, "the child is reaped")


def test_engine_files_made_during_a_run_and_held_by_none_are_removed() -> None:
    from kvconn.testing.shm import engine_files

    tag = uuid.uuid4().hex[:12]
    before = engine_files()
    orphan, held, other = (Path(f"/dev/shm/{n}{tag}") for n in ("sem.mp-", "sglang_", "kvconn-test-"))
    for path in (orphan, held, other):
        path.write_bytes(b"x")
    try:
        with open(held):  # this process holds it open: still in use
            made = engine_files() - before
            assert {orphan, held} <= made and other not in made
            # only this test's own: another test's engine may run beside it
            assert remove_unheld(made & {orphan, held}) == [orphan]
        assert not orphan.exists() and held.exists() and other.exists()
    finally:
        for path in (orphan, held, other):
            path.unlink(missing_ok=True)
