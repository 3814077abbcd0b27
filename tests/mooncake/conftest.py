from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from kvconn.runtime.procs import wait_until_stopped
from kvconn.testing import waiting

# The engine's minimum timeout, so frozen-peer tests take ~5 s, not 30 s.
ENV = {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_STATUS_TIMEOUT_SEC": "5", "MC_LOG_LEVEL": "WARNING"}
STARTUP_S = 60.0


class Child:
    """One spawned endpoint process; every wait is bounded."""

    def __init__(self) -> None:
        from _child import serve

        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc: Any = ctx.Process(target=serve, args=(child_conn, ENV), daemon=True)
        self.proc.start()
        child_conn.close()
        assert self.proc.pid is not None
        self.pid: int = self.proc.pid
        self._started = False

    def ready(self) -> Child:
        if not self._started:
            self._started = True
            assert self.recv(STARTUP_S) == self.pid
        return self

    def send(self, op: str, *args: Any) -> None:
        self.conn.send((op, args))

    def recv(self, timeout: float = 60.0) -> Any:
        """``timeout``: seconds of an idle machine (longer while it is loaded)."""
        if not waiting.wait(self.conn.poll, timeout):
            raise TimeoutError(f"child {self.pid} did not answer within {timeout} s of an idle machine")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"child {self.pid}: {value}")
        return value

    def call(self, op: str, *args: Any, timeout: float = 60.0) -> Any:
        self.ready()
        self.send(op, *args)
        return self.recv(timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)
        if sig == signal.SIGSTOP:
            wait_until_stopped(self.pid)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.conn.send(("exit", ()))
            except OSError:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
            self.proc.join(5)
        self.conn.close()


@pytest.fixture(scope="module")
def spawn() -> Iterator[Any]:
    """Start children in parallel; they are all stopped (by pid) at the end."""
    children: list[Child] = []

    def start(n: int = 1) -> list[Child]:
        new = [Child() for _ in range(n)]
        children.extend(new)
        return [c.ready() for c in new]

    yield start
    for c in children:
        c.stop()
