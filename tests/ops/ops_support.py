"""What the operator-artefact tests share: the repo's paths, the metric names
kvconn exports and those a PromQL text uses, and a child process that serves
a real endpoint's metrics."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from kvconn.metrics import ENDPOINT_LABEL, Metrics

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MONITORING = ROOT / "monitoring"
RULES = MONITORING / "prometheus" / "kvconn-rules.yml"
RULE_TESTS = MONITORING / "prometheus" / "kvconn-rules.test.yml"
DASHBOARD = MONITORING / "grafana" / "kvconn-dashboard.json"

# A name made of kvconn_ and word characters, not followed by ':' (a recording
# rule's name: kvconn:...) or preceded by one.
_NAME = re.compile(r"(?<![\w:])kvconn_[a-z0-9_]+(?![\w:])")
#: kvconn_ words that are labels, not metrics.
LABELS = {ENDPOINT_LABEL}


def exported_series() -> set[str]:
    """Every sample name a Metrics() registry can expose (a labelled family
    nothing has counted yet has no samples, so the names come from the types)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
    }
    names: set[str] = set()
    for family in Metrics("decode").registry.collect():
        names.update(family.name + s for s in suffixes[family.type])
    return names


def referenced(text: str) -> set[str]:
    return set(_NAME.findall(text)) - LABELS


class EndpointChild:
    """``endpoint_child.py`` in a process of its own; ``port`` is its exporter's."""

    def __init__(self, pages: int, port: int = 0, unsafe: bool = False) -> None:
        args = {"pages": pages, "port": port, "unsafe": unsafe}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "endpoint_child.py"), json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.next_event(60)["port"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def send_line(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next_event(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise AssertionError(f"the endpoint child printed nothing more in {timeout} s") from None
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
