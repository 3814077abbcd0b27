"""A real vLLM engine (engine_harness's) in a process on a host of
:mod:`kvconn.testing.hosts`: its own network, PID and mount namespaces, so
that it reaches the other engine only over the link between their hosts.

The parent talks to it over a socket pair handed down through ``ip netns
exec``, ``unshare`` and the host's shell (a multiprocessing Connection on
the inherited descriptor), so :class:`HostEngine` is an :class:`Engine`:
``call``, ``add``, ``finished``, ``stats`` and ``close`` work as for an
engine on this host. Its ``pid`` is the engine process as this process sees
it, to freeze it.

Run as ``python host_engine.py FD SPEC_JSON`` by :class:`HostEngine` only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_harness import Engine  # noqa: E402


class _HostProcess:
    """What Engine reads of its process (``multiprocessing.Process``'s
    names), for a command started on a host."""

    def __init__(self, popen: subprocess.Popen[bytes], pid: int) -> None:
        self.popen, self.pid = popen, pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        # The wrapper (unshare) goes; its --kill-child takes the host's pid 1
        # and so every process of the engine's PID namespace with it.
        with contextlib.suppress(OSError):
            self.popen.send_signal(signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)


class HostEngine(Engine):
    """An engine process on host ``on`` (a :class:`kvconn.testing.hosts.Host`)."""

    def __init__(
        self,
        on: Any,
        model: Path,
        role: str | None,
        /,
        start_timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        """``on``: the host; ``extra``: KvconnConnector's
        kv_connector_extra_config (its ``host`` is the connector's address);
        ``env``: added to the engine process's environment."""
        ours, theirs = socket.socketpair()
        spec = json.dumps({"model": str(model), "role": role, "extra": extra})
        popen = on.popen(
            [sys.executable, str(HERE / "host_engine.py"), str(theirs.fileno()), spec],
            pass_fds=(theirs.fileno(),),
            env={**os.environ, **(env or {})},
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self.process = _HostProcess(popen, on.main_pid(popen))  # type: ignore[assignment]
        self.on = on
        self.role = role
        self.start_timeout_s = start_timeout_s
        self._info = None
        self.events = {}

    @property
    def pid(self) -> int:
        return int(self.process.pid)  # type: ignore[arg-type]


def main() -> None:
    from engine_harness import _serve

    fd, spec = int(sys.argv[1]), json.loads(sys.argv[2])
    _serve(Connection(fd), spec["model"], spec["role"], spec["extra"], None, 1)


if __name__ == "__main__":
    main()
