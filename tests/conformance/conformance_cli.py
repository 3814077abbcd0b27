"""``kvconn conformance`` run as a user runs it, from this venv's script."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from kvconn.testing import hosts

KVCONN = str(Path(sys.executable).with_name("kvconn"))


def conformance(
    backend: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 240
) -> tuple[int, str]:
    """Exit code and output of ``kvconn conformance BACKEND -q ARGS``."""
    proc = subprocess.Popen(
        [KVCONN, "conformance", backend, "-q", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1") if env is None else dict(env),
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return proc.returncode, out


def stop(proc: subprocess.Popen[str]) -> None:
    """End a run that is still going (a timeout, a Ctrl-C of the tests) the
    way it tears down: SIGTERM, on which it closes the hosts it made; SIGKILL
    only if it has not exited 30 s later, and then its namespaces are swept."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    with contextlib.suppress(OSError):
        hosts.sweep_stale()
