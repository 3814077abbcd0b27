"""What the killed-writer checks see of a process that outlived a rank: it
maps the page owner's shared memory, or holds it (or the owner's
``/proc/PID/mem``) open, ready to write into decode's pages without a
mapping. This test process plays the page owner."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing import shared_memory

import pytest

from kvconn.conformance import guard

HOLD = """
import mmap, os, sys, time
how, path = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
if how == "map":
    kept = mmap.mmap(fd, 4096)
    os.close(fd)
elif how == "none":
    os.close(fd)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def owner_memory() -> Iterator[str]:
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        yield "/dev/shm/" + shm.name.lstrip("/")
    finally:
        shm.close()
        shm.unlink()


def _holder(how: str, path: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, how, path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready and proc.stdout.readline().strip() == "ready", f"holder {how} did not start"
    return proc


def test_holders_names_a_mapping_and_open_files_of_the_owners_memory(owner_memory: str) -> None:
    me = os.getpid()
    memory = guard.shared_memory_of(me)
    assert memory, "the owner's shared memory is not among its mappings"
    procs = {
        "map": _holder("map", owner_memory),
        "fd": _holder("fd", owner_memory),
        "procmem": _holder("fd", f"/proc/{me}/mem"),
        "none": _holder("none", owner_memory),
    }
    try:
        lines = {how: f"{proc.pid} python {how}" for how, proc in procs.items()}
        found = guard.holders(list(lines.values()), memory, [me])
        named = {how for how, line in lines.items() if any(f.startswith(line + " ") for f in found)}
        assert named == {"map", "fd", "procmem"}, found
        assert any(f"-> /proc/{me}/mem" in f for f in found), found
        # the memory of another owner: none of them holds it
        assert guard.holders(list(lines.values()), set(), [me + 1_000_000]) == []
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
