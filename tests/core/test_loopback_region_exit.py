"""A loopback region decode kept open (its endpoint closed with pages held)
loses its name when the process exits, quietly: the resource tracker would
unlink it too, but with a warning on stderr that breaks a one-line exit
(``kvconn bench`` interrupted while a room is held)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory in /dev/shm")

KEPT_AT_EXIT = """
    import os, sys
    from kvconn.backends.loopback import LoopbackRegion
    region = LoopbackRegion(1 << 16)
    region.write(0, b"held")
    name = region.metadata.decode()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a normal exit of a fork: its atexit hooks run, and must leave the parent's region
    os.waitpid(pid, 0)
    print(name, os.path.exists("/dev/shm/" + name), flush=True)
    # exits with the region open, as after DecodeEndpoint.close() with pages held
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


def test_a_region_open_at_exit_is_unlinked_without_a_warning() -> None:
    done = run(KEPT_AT_EXIT)
    assert done.returncode == 0, done.stderr
    name, there_after_fork = done.stdout.split()
    assert there_after_fork == "True", "a forked child's exit unlinked its parent's region"
    assert done.stderr == ""
    assert not Path("/dev/shm", name).exists()


def test_a_closed_region_is_not_unlinked_twice() -> None:
    done = run("""
        from kvconn.backends.loopback import LoopbackRegion
        LoopbackRegion(4096).close()
    """)
    assert done.returncode == 0
    assert done.stderr == ""
