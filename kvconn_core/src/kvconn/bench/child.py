"""A bench child process that speaks JSON lines: its config on stdin's first
line, replies on stdout, and it serves until stdin closes.

Every wait for it is bounded: a child that does not answer in time is
killed (it is ours: we started it, and we stop it by its pid).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import IO, Any


class Child:
    """``python -m <module> <role>``, configured with ``config``; ``hello`` is
    its first reply carrying ``key`` (e.g. its address, or "ready")."""

    def __init__(self, module: str, role: str, config: Mapping[str, Any], key: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.role = role
        try:
            self.send(config)
            self.hello = self.recv(key, timeout_s=120)
        except BaseException:
            self.close()
            raise

    def send(self, msg: Mapping[str, Any]) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps(msg) + "\n")
        stdin.flush()

    def recv(self, key: str, timeout_s: float = 300) -> Any:
        """The next JSON line with ``key``; a transport library's own lines
        (nixl prints to stdout) are skipped."""
        stdout = self.proc.stdout
        assert stdout is not None
        timer = threading.Timer(timeout_s, self.proc.kill)
        timer.start()
        try:
            while True:
                line = stdout.readline()
                if not line:
                    raise RuntimeError(f"bench {self.role} child exited with {self.proc.wait()}")
                with contextlib.suppress(ValueError):
                    msg = json.loads(line)
                    if isinstance(msg, dict) and key in msg:
                        return msg[key] if len(msg) == 1 else msg
        finally:
            timer.cancel()

    def close(self) -> dict[str, Any]:
        """Close stdin, wait for the exit; the JSON objects it printed last."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        out = ""
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            timer = threading.Timer(60, self.proc.kill)
            timer.start()
            try:
                out = self.proc.stdout.read()
            finally:
                timer.cancel()
                self.proc.stdout.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        last: dict[str, Any] = {}
        for line in out.splitlines():
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict):
                    last.update(msg)
        return last


def read_config() -> dict[str, Any]:
    """In the child: the config the parent sent on stdin's first line."""
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("no config on stdin")
    cfg: dict[str, Any] = json.loads(line)
    return cfg
