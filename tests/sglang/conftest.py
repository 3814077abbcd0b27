"""Harness for driving SGLang's own disaggregation classes with kvconn.

Runs where SGLang is installed (``scripts/setup-sglang-venv.sh`` makes the
venv CI uses); elsewhere every test here is skipped with the reason. GPU-only
modules SGLang imports are stood in for here (standins.py), never in
kvconn_sglang.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
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


#: The session's zygote (below), started with the session's SGLang import.
_zygotes: list[Zygote] = []


@pytest.fixture(scope="session")
def sglang_with_kvconn(request: pytest.FixtureRequest) -> Any:
    """SGLang's plugin loader run once, as every SGLang process runs it."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(SGLANG_MISSING)
    os.environ.update(KVCONN_ENV)
    if not _zygotes and any("zygote" in item.fixturenames for item in request.session.items):
        # It imports SGLang while this process does: two cores, both busy.
        _zygotes.append(Zygote())
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
    """A prefill process (prefill_child.py) hosting one or more TP ranks, on
    stdin/stdout (a subclass sets up the process and ``_rfile``/``_wfile``)."""

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
        self.pid = self.proc.pid
        self._init_io(self.proc.stdout, self.proc.stdin)

    def _init_io(self, rfile: Any, wfile: Any) -> None:
        self._rfile, self._wfile = rfile, wfile
        self.addresses: list[str] = []
        #: Its SGLang bootstrap server, as a request names it (host:port).
        self.bootstrap = ""
        self.stopped = False

    def wait_ready(self, timeout_s: float = 240) -> None:
        answer = self._read(timeout_s)
        ready = answer["ready"]
        self.addresses = [ready[k] for k in sorted(ready, key=int)]
        self.bootstrap = answer["bootstrap"]

    def call(self, timeout_s: float = 30, **cmd: Any) -> Any:
        self._wfile.write(json.dumps(cmd) + "\n")
        self._wfile.flush()
        answer = self._read(timeout_s)
        if "error" in answer:
            raise AssertionError(f"prefill child failed {cmd['op']}: {answer['error']}")
        return answer

    def _read(self, timeout_s: float) -> Any:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._rfile.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0]:
            raise AssertionError(f"prefill child gave no answer within {timeout_s} s (alive: {self.alive()})")
        return json.loads(line[0])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGSTOP: the process keeps its connections but answers nothing."""
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        """SIGKILL, and return once the process is gone."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.stopped:
            self.resume()
        if self.alive():
            self.kill()
        self.proc.wait(timeout=30)


class ForkedPrefill(PrefillChild):
    """prefill_child.py's instance forked by the zygote (SGLang imported
    once), talking over a Unix socket; stopped and killed by its pid (the
    zygote reaps it: gone as a real exit is)."""

    def __init__(self, zygote: Zygote, spec: dict[str, Any], env: dict[str, str]) -> None:
        self.pid, conn = zygote.fork("prefill", spec, env)
        self._conn = conn
        self._init_io(conn.makefile("r"), conn.makefile("w"))

    def alive(self) -> bool:
        return running(self.pid)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while running(self.pid):
            assert time.monotonic() < deadline, f"forked prefill {self.pid} still there 30 s after SIGKILL"
            time.sleep(0.01)

    def close(self) -> None:
        if self.stopped:
            self.resume()
        if self.alive():
            self.kill()
        self._rfile.close()
        self._wfile.close()
        self._conn.close()


def running(pid: int) -> bool:
    """``pid`` exists and is no zombie (the zygote reaps its children at once)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before, or while, it was read
        return False


class Zygote:
    """zygote.py: imports SGLang once, forks the tests' SGLang processes."""

    def __init__(self) -> None:
        # A short folder: a Unix socket's path is at most 107 bytes.
        self.folder = Path(tempfile.mkdtemp(prefix="kvconn-sgl-"))
        env = {**os.environ, **KVCONN_ENV, "PYTHONUNBUFFERED": "1"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        # numpy's and scipy's OpenBLAS start a thread pool at import; a fork
        # must find no thread but the forking one (zygote.py checks it).
        env["OPENBLAS_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._count = 0
        self._lock = threading.Lock()
        self._started = False

    def _answer(self, timeout_s: float) -> Any:
        assert self.proc.stdout is not None
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0]:
            raise AssertionError(f"the zygote gave no answer within {timeout_s} s (rc={self.proc.poll()})")
        answer = json.loads(line[0])
        if "error" in answer:
            raise AssertionError(f"the zygote: {answer['error']}")
        return answer

    def fork(self, role: str, spec: dict[str, Any], env: dict[str, str]) -> tuple[int, socket.socket]:
        """A child running ``role``, and its connection."""
        with self._lock:
            if not self._started:
                self._answer(300)  # its imports: seconds alone, minutes on a loaded machine
                self._started = True
            self._count += 1
            path = str(self.folder / f"child-{self._count}.sock")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(60)
            pid = 0
            try:
                assert self.proc.stdin is not None
                cmd = {"role": role, "spec": spec, "env": env, "socket": path}
                self.proc.stdin.write(json.dumps(cmd) + "\n")
                self.proc.stdin.flush()
                pid = int(self._answer(30)["pid"])
                conn, _ = listener.accept()
            except BaseException:
                if pid:  # forked, but it never connected: it must not outlive the test
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                raise
            finally:
                listener.close()
                os.unlink(path)
        conn.settimeout(None)
        return pid, conn

    def prefill(
        self,
        tp_size: int,
        ranks: list[int],
        transport: str = "loopback",
        env: dict[str, str] | None = None,
        bootstrap_port: int = 0,
    ) -> ForkedPrefill:
        """``bootstrap_port``: its bootstrap server's (0: a free one)."""
        spec = {"tp_size": tp_size, "ranks": ranks, "bootstrap_port": bootstrap_port}
        return ForkedPrefill(self, spec, {**KVCONN_ENV, "KVCONN_SGLANG_TRANSPORT": transport, **(env or {})})

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # it kills the children left, then exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """One process that imports SGLang once and forks the tests' prefill
    (and metrics decode) processes: imports are what those processes cost.
    It needs no SGLang in this process (test_sglang_metrics imports none)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(SGLANG_MISSING)
    if not _zygotes:
        _zygotes.append(Zygote())
    try:
        yield _zygotes[0]
    finally:
        close_zygotes()


def close_zygotes() -> None:
    while _zygotes:
        _zygotes.pop().close()


def pytest_sessionfinish() -> None:
    close_zygotes()  # one sglang_with_kvconn started for tests that never ran


@pytest.fixture(scope="module")
def prefill_children(zygote: Zygote) -> Iterator[dict[int, PrefillChild]]:
    """A TP-1 and a TP-2 prefill instance."""
    children: dict[int, PrefillChild] = {}
    try:
        for tp, ranks in ((1, [0]), (2, [0, 1])):
            children[tp] = zygote.prefill(tp, ranks)
        for child in children.values():
            child.wait_ready()
        yield children
    finally:
        for child in children.values():
            child.close()
