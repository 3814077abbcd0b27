"""Helpers shared by the operator-artefact tests: the repo's paths, promtool,
and a child process that serves a real endpoint's metrics."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MONITORING = ROOT / "monitoring"
RULES = MONITORING / "prometheus" / "kvconn-rules.yml"
RULE_TESTS = MONITORING / "prometheus" / "kvconn-rules.test.yml"
DASHBOARD = MONITORING / "grafana" / "kvconn-dashboard.json"


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian/Ubuntu: apt-get install prometheus)")
    return path


class EndpointChild:
    """``endpoint_child.py`` in a process of its own; ``port`` is its exporter's."""

    def __init__(self, pages: int, port: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "endpoint_child.py"), json.dumps({"pages": pages, "port": port})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self._first_event(60)["port"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def _first_event(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise AssertionError(f"the endpoint child printed nothing in {timeout} s") from None
        event: dict[str, Any] = json.loads(line)
        return event

    def close(self) -> str:
        """Stop it (closing stdin asks it to), kill it if it hangs; its stderr."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


@pytest.fixture
def endpoint_child() -> Iterator[EndpointChild]:
    child = EndpointChild(pages=3)
    yield child
    child.close()
