"""The plugin's page regions, held in a process of the suite's harness
(:mod:`kvconn.conformance.region_host_proc`), never in the process that
reports the verdict: a transport writing outside its region, or region code
that crashes, takes that process down, and the check that was running fails
naming the signal and the last operation, instead of the suite dying with
no verdict.

:class:`RemoteRegion` is a :class:`kvconn.transport.PageRegion` for decode's
endpoint and the checks; its bytes travel through a scratch buffer (a memfd the suite
creates and the host inherits: no name in a /dev/shm the host may not
share, across hosts), in pieces of at most its size; the pipe carries only
commands.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvconn.testing.hosts import Host

#: The scratch buffer's size: a larger read or write goes in pieces.
SCRATCH_BYTES = 64 << 20


class RegionHost:
    """One process holding every region a run opens (as the test process
    held them all before). If it dies, the regions in it are lost: every
    later operation on them fails, and the next region opened starts a new
    host."""

    def __init__(self, backend: str, host: Host | None) -> None:
        self.backend = backend
        fd = os.memfd_create("kvconn-conformance-scratch")
        try:
            os.ftruncate(fd, SCRATCH_BYTES)
            self._scratch = mmap.mmap(fd, SCRATCH_BYTES)
            self.proc = subprocess.Popen(
                [
                    *(host.prefix() if host is not None else ()),
                    sys.executable,
                    "-m",
                    "kvconn.conformance.region_host_proc",
                    json.dumps({"backend": backend, "scratch_fd": fd, "scratch_bytes": SCRATCH_BYTES}),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
                pass_fds=(fd,),
            )
        finally:
            os.close(fd)
        #: The process itself (on another host: under its wrappers); None if
        #: its pid means nothing here (another PID namespace).
        self.pid: int | None = self.proc.pid if host is None else None
        self._lock = threading.Lock()
        self._ids = 0
        self.last = "start"
        #: A check already failed naming this host's death.
        self.reported = False
        self._answer()  # ready

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                continue  # the plugin printed something of its own
            if isinstance(answer, dict):
                return answer
        raise self.crashed()

    def crashed(self) -> AssertionError:
        """The failed check a dead region host makes (a ConformanceFailure)."""
        from kvconn.conformance.harness import ConformanceFailure  # harness imports this module

        code = self.proc.wait(10)
        self.reported = True
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return ConformanceFailure(
            f"the process holding the plugin's regions (pid {self.proc.pid}) {how} during {self.last}: "
            "a write outside a registered region, or the region's own code, crashed it"
        )

    def _ask_locked(self, cmd: Mapping[str, Any], what: str) -> dict[str, Any]:
        self.last = what
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(dict(cmd)) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self.crashed() from None
        answer = self._answer()
        if "error" in answer:
            raise RuntimeError(f"{what}: {answer['error']}")
        return answer

    def open(self, nbytes: int, options: Mapping[str, str]) -> RemoteRegion:
        with self._lock:
            self._ids += 1
            rid = self._ids
            answer = self._ask_locked(
                {"op": "open", "id": rid, "nbytes": nbytes, "options": dict(options)},
                f"open_region({nbytes})",
            )
        return RemoteRegion(self, rid, nbytes, bytes.fromhex(answer["metadata"]))

    def register(
        self, shape: Mapping[str, Any], tp: int, rank: int, options: Mapping[str, str]
    ) -> RemoteRegion:
        """Engine buffers of decode's TP rank ``rank`` of ``tp`` (an
        :class:`~kvconn.testing.kvpattern.EngineShape` as ``shape``),
        allocated in the host and registered with the plugin."""
        with self._lock:
            self._ids += 1
            rid = self._ids
            answer = self._ask_locked(
                {
                    "op": "register",
                    "id": rid,
                    "shape": dict(shape),
                    "tp": tp,
                    "rank": rank,
                    "options": dict(options),
                },
                f"register_region(engine buffers of decode rank {rank} of {tp})",
            )
        return RemoteRegion(self, rid, 0, bytes.fromhex(answer["metadata"]))

    def read(self, rid: int, offset: int, nbytes: int) -> bytes:
        with self._lock:
            pieces = []
            for at in range(0, nbytes, SCRATCH_BYTES):
                n = min(SCRATCH_BYTES, nbytes - at)
                self._ask_locked(
                    {"op": "read", "id": rid, "offset": offset + at, "nbytes": n},
                    f"region {rid}.read({offset + at}, {n})",
                )
                pieces.append(self._scratch[:n])  # a copy: the scratch is reused
        # One piece (every read but those over 64 MiB) is returned as it is.
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def write(self, rid: int, offset: int, data: bytes) -> None:
        view = memoryview(data)
        with self._lock:
            for at in range(0, len(view), SCRATCH_BYTES):
                piece = view[at : at + SCRATCH_BYTES]
                self._scratch[: len(piece)] = piece
                self._ask_locked(
                    {"op": "write", "id": rid, "offset": offset + at, "nbytes": len(piece)},
                    f"region {rid}.write({offset + at}, {len(piece)} bytes)",
                )

    def call(self, rid: int, op: str, **args: Any) -> dict[str, Any]:
        with self._lock:
            return self._ask_locked({"op": op, "id": rid, **args}, f"region {rid}.{op}()")

    def close(self) -> None:
        if self.proc.stdin is not None and self.alive():
            try:
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._scratch.close()


class RemoteRegion:
    """A region held by a :class:`RegionHost`."""

    def __init__(self, host: RegionHost, rid: int, nbytes: int, metadata: bytes) -> None:
        self._host = host
        self._id = rid
        self.nbytes = nbytes
        self.metadata = metadata
        self._closed = False

    @property
    def owner_pid(self) -> int | None:
        """The region host's pid (None on another host)."""
        return self._host.pid

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._host.read(self._id, offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self._host.write(self._id, offset, bytes(data))

    def owner_fence(self) -> bytes:
        self.metadata = bytes.fromhex(self._host.call(self._id, "owner_fence")["metadata"])
        return self.metadata

    def changed_pages(self, pages: Sequence[int], page_bytes: int, value: int) -> list[int]:
        """Those of ``pages`` that do not hold ``value`` in every byte,
        compared in the host (a canary check reads no bytes across)."""
        answer = self._host.call(
            self._id, "changed_pages", pages=list(pages), page_bytes=page_bytes, value=value
        )
        return [int(p) for p in answer["pages"]]

    def wrong_pattern_pages(
        self, room: int, pages: Sequence[int], page_bytes: int, num_ranks: int, ranks: Sequence[int]
    ) -> list[int]:
        """Those of ``pages`` not holding ``room``'s pattern (see
        :func:`kvconn.testing.pages.wrong_pattern_pages`), compared in the host."""
        answer = self._host.call(
            self._id,
            "wrong_pattern_pages",
            room=room,
            pages=list(pages),
            page_bytes=page_bytes,
            num_ranks=num_ranks,
            ranks=list(ranks),
        )
        return [int(p) for p in answer["pages"]]

    def engine_diff(self, room: int, pages: Sequence[int]) -> str:
        """(Engine buffers, :meth:`RegionHost.register`.) "" if ``pages``
        hold ``room``'s pattern and nothing else changed; else what differs."""
        return str(self._host.call(self._id, "engine_diff", room=room, pages=list(pages))["diff"])

    def memory_kind(self) -> str | None:
        """Where the region's memory lives, by CUDA's word (None: the region
        does not say where it starts)."""
        kind = self._host.call(self._id, "memory_kind")["kind"]
        return None if kind is None else str(kind)

    def close(self) -> None:
        """Close it in the host. A host that died since its last answer
        makes this the failed check naming the signal, once."""
        if self._closed:
            return
        self._closed = True
        if self._host.alive():
            self._host.call(self._id, "close")
        elif not self._host.reported:
            raise self._host.crashed()


_hosts: dict[tuple[str, str], RegionHost] = {}
_hosts_lock = threading.Lock()


def open_region(backend: str, nbytes: int, options: Mapping[str, str], host: Host | None) -> RemoteRegion:
    """A region of ``backend`` in the run's region host on ``host`` (started,
    or started again after a crash, as needed)."""
    return _host_of(backend, host).open(nbytes, options)


def _host_of(backend: str, host: Host | None) -> RegionHost:
    """The run's region host on ``host`` (started, or started again after a crash)."""
    key = (backend, "" if host is None else host.name)
    with _hosts_lock:
        found = _hosts.get(key)
        if found is None or not found.alive():
            if found is not None:
                found.close()
            found = _hosts[key] = RegionHost(backend, host)
    return found


def register_region(
    backend: str,
    shape: Mapping[str, Any],
    tp: int,
    rank: int,
    options: Mapping[str, str],
    host: Host | None,
) -> RemoteRegion:
    """Engine buffers registered as a region of ``backend``, in the run's
    region host on ``host`` (see :meth:`RegionHost.register`)."""
    return _host_of(backend, host).register(shape, tp, rank, options)


def close_all() -> None:
    """End every region host (the end of the run)."""
    with _hosts_lock:
        hosts = list(_hosts.values())
        _hosts.clear()
    for host in hosts:
        host.close()
