"""Harness for driving SGLang's own disaggregation classes with kvconn.

Runs where SGLang is installed (``scripts/setup-sglang-venv.sh`` makes the
venv CI uses); elsewhere every test here is skipped with the reason. GPU-only
modules SGLang imports are stood in for here (standins.py), never in
kvconn_sglang.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# The adapter's pure parts (routing, settings) are tested without installing it;
# SGLang finds it through its entry point only once it is installed.
sys.path.insert(0, str(HERE.parents[1] / "kvconn_sglang" / "src"))

SGLANG_MISSING = "sglang is not installed in this interpreter: run scripts/setup-sglang-venv.sh (CI does)"

if importlib.util.find_spec("sglang") is not None:
    import standins

    standins.install()

#: Short kvconn deadlines for every process the tests start (decode reads
#: them in-process, the prefill children inherit them).
KVCONN_ENV = {
    "KVCONN_SGLANG_TRANSPORT": "loopback",
    "KVCONN_SGLANG_WRITE_TIMEOUT_S": "2",
    "KVCONN_SGLANG_ABORT_TIMEOUT_S": "60",
    "KVCONN_SGLANG_RESEND_INTERVAL_S": "0.2",
}


@pytest.fixture(scope="session")
def sglang_with_kvconn() -> Any:
    """SGLang's plugin loader run once, as every SGLang process runs it."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(SGLANG_MISSING)
    os.environ.update(KVCONN_ENV)
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if "kvconn" not in {m.value for m in utils.TransferBackend}:
        pytest.fail(
            "load_plugins() did not register kvconn: is kvconn_sglang installed (pip install -e ./kvconn_sglang)?"
        )
    return utils


@pytest.fixture(scope="session")
def gloo_group(sglang_with_kvconn: Any) -> Iterator[Any]:
    """A one-rank gloo group: SGLang all-reduces polls and holds over its TP group."""
    import torch.distributed as dist

    from kvconn.testing.cluster import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD


class PrefillChild:
    """A prefill process (prefill_child.py) hosting one or more TP ranks."""

    def __init__(self, tp_size: int, ranks: list[int], transport: str = "loopback") -> None:
        spec = json.dumps({"tp_size": tp_size, "ranks": ranks})
        env = {**os.environ, **KVCONN_ENV, "PYTHONUNBUFFERED": "1", "KVCONN_SGLANG_TRANSPORT": transport}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "prefill_child.py"), spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.addresses: list[str] = []
        #: Its SGLang bootstrap server, as a request names it (host:port).
        self.bootstrap = ""
        self.stopped = False
        self.pid = self.proc.pid

    def wait_ready(self, timeout_s: float = 240) -> None:
        answer = self._read(timeout_s)
        ready = answer["ready"]
        self.addresses = [ready[k] for k in sorted(ready, key=int)]
        self.bootstrap = answer["bootstrap"]

    def call(self, timeout_s: float = 30, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = self._read(timeout_s)
        if "error" in answer:
            raise AssertionError(f"prefill child failed {cmd['op']}: {answer['error']}")
        return answer

    def _read(self, timeout_s: float) -> Any:
        assert self.proc.stdout is not None
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0]:
            raise AssertionError(f"prefill child gave no answer within {timeout_s} s (rc={self.proc.poll()})")
        return json.loads(line[0])

    def stop(self) -> None:
        """SIGSTOP: the process keeps its connections but answers nothing."""
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def close(self) -> None:
        if self.stopped:
            self.resume()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def prefill_children(sglang_with_kvconn: Any) -> Iterator[dict[int, PrefillChild]]:
    """A TP-1 and a TP-2 prefill, started together (each imports SGLang)."""
    children = {1: PrefillChild(1, [0]), 2: PrefillChild(2, [0, 1])}
    try:
        for child in children.values():
            child.wait_ready()
        yield children
    finally:
        for child in children.values():
            child.close()
