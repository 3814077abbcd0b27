"""``kvconn conformance`` run as a user runs it, from this venv's script."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

KVCONN = str(Path(sys.executable).with_name("kvconn"))


def conformance(
    backend: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 240
) -> tuple[int, str]:
    """Exit code and output of ``kvconn conformance BACKEND -q ARGS``."""
    proc = subprocess.run(
        [KVCONN, "conformance", backend, "-q", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1") if env is None else dict(env),
    )
    return proc.returncode, proc.stdout + proc.stderr
