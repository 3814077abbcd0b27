"""A bench child process that speaks JSON lines: its config on stdin's first
line, replies on stdout, and it serves until stdin closes.

Every wait for it is bounded: a child that does not answer in time is
killed (it is ours: we started it, and we stop it by its pid).

A child's stderr (its tracebacks, a transport library's log lines) goes to a
temporary file unless :data:`VERBOSE`: a child that dies is reported as one
line, the last line it wrote there (a traceback's exception), not as a screen
of interleaved tracebacks from every process.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import IO, Any

#: Children write their stderr to ours (``kvconn bench --verbose``).
VERBOSE = False


class ChildError(RuntimeError):
    """A bench child process exited before it answered."""


class StderrLog:
    """Where one child's stderr goes: a temporary file, read back for the cause
    of a failure; ours when :data:`VERBOSE`."""

    def __init__(self) -> None:
        self.file = (  # closed in close(), when the child is gone
            None if VERBOSE else tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        )

    def cause(self) -> str:
        """The last line the child wrote (a traceback ends with its exception)."""
        if self.file is None:
            return "see its output above"
        self.file.flush()
        self.file.seek(0)
        lines = [line.strip() for line in self.file.read().splitlines() if line.strip()]
        return lines[-1] if lines else "it wrote nothing to stderr"

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def exited(what: str, code: int, log: StderrLog) -> ChildError:
    """The one-line error for a child that exited with ``code``."""
    how = "after Ctrl-C" if code in (-signal.SIGINT, 130) else f"with {code}"
    return ChildError(f"{what} exited {how}: {log.cause()}")


def quiet_interrupts() -> None:
    """In a child: ignore Ctrl-C, which the terminal sends to every process of
    the bench at once. The parent tears the run down and closes our stdin, and
    we exit then, without a traceback of our own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Child:
    """``python -m <module> <role>``, configured with ``config``; ``hello`` is
    its first reply carrying ``key`` (e.g. its address, or "ready")."""

    def __init__(self, module: str, role: str, config: Mapping[str, Any], key: str) -> None:
        self.stderr = StderrLog()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr.file,
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
                    raise exited(f"bench {self.role} child", self.proc.wait(), self.stderr)
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
        self.stderr.close()
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
