"""One process that imports SGLang once and forks the tests' SGLang processes.

Importing SGLang is most of what a test process of tests/sglang costs
(10-60 s each on the 2-core CI machine, minutes under load); the processes
the tests start differ only in what they do after that. This process
imports what they import (the stand-ins, torch, SGLang's disaggregation
modules, the kvconn plugin, applied), then, per request on stdin, forks a
child that runs one role:

- ``prefill``: prefill_child.py's instance (its bootstrap server, ranks and
  SGLang's prefill queues; spec as prefill_child.py takes it);
- ``metrics_decode``: metrics_decode_child.py's decode process (prometheus'
  multiprocess folder in its env: nothing here imported prometheus_client).

Each child starts from the same state a fresh process would be in after
those imports: no thread runs here (the kernel's count of this process's
threads, native ones included, is checked before every fork: a fork copies
only the forking thread, and a lock another thread held stays held), no
process group, socket or manager exists. A child dies with this process
(PR_SET_PDEATHSIG), so a zygote killed mid-test leaves none behind. It sets its env, connects to the
Unix socket the test listens on and talks JSON lines there; its stdout goes
to stderr so nothing it prints can reach this process's answers. The test
stops and kills a child by its pid (this process reaps it at once, so its
pid is gone as a real exit's is). Closing stdin kills the children left
and ends this process.

Protocol, one JSON object a line: ``{"role": ..., "spec": {...}, "env":
{...}, "socket": PATH}`` in, ``{"pid": N}`` out.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import prefill_child  # the stand-ins, torch and SGLang's modules

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PR_SET_PDEATHSIG = 1
_children: set[int] = set()


def os_threads() -> int:
    """This process's threads as the kernel counts them (torch's or
    SGLang's native ones too, which ``threading`` does not see)."""
    return len(os.listdir("/proc/self/task"))


def _die_with_parent(zygote: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != zygote:  # it died before the prctl: no signal will come
        os._exit(1)


def _reap(signum: int, frame: Any) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _children.discard(pid)


def _run_child(zygote: int, role: str, spec: dict[str, Any], env: dict[str, str], path: str) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        _die_with_parent(zygote)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(2, 1)  # stray prints go to stderr, never into the zygote's answers
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.environ.update(env)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        rfile, wfile = conn.makefile("r"), conn.makefile("w")
        if role == "prefill":
            prefill_child.serve_instance(spec, rfile, wfile)
        elif role == "metrics_decode":
            import metrics_decode_child

            metrics_decode_child.run(rfile, wfile)
        else:
            raise ValueError(f"unknown role {role!r}")
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    prefill_child.load_plugins()  # as every SGLang process does: hooks applied before the fork
    assert MULTIPROC_ENV not in os.environ and "prometheus_client" not in sys.modules, (
        "prometheus_client must be imported after the fork (its multiprocess mode is read at import)"
    )
    signal.signal(signal.SIGCHLD, _reap)
    assert os_threads() == 1, f"{os_threads()} threads after the imports: the zygote cannot fork safely"
    prefill_child.reply({"zygote": os.getpid()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            threads = os_threads()
            if threads != 1:
                prefill_child.reply({"error": f"{threads} threads in the zygote: no safe fork"})
                continue
            zygote = os.getpid()
            # No reaping until the pid is recorded: a child that exits at
            # once must not be reaped before it is known (its pid reused).
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            try:
                pid = os.fork()
                if pid == 0:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                    _run_child(zygote, cmd["role"], cmd.get("spec", {}), cmd.get("env", {}), cmd["socket"])
                _children.add(pid)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            prefill_child.reply({"pid": pid})
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for pid in list(_children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in list(_children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
