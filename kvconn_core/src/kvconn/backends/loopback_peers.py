"""The loopback writer's two kinds of peer: decode's shared-memory segment
mapped here (pieces are memmoves), or engine-owned memory of another
process on this host (pieces are ``process_vm_writev`` calls into it)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import mmap
import os
import select
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING

import numpy as np

from kvconn.buffers import Buffer, FlatSpace
from kvconn.runtime.procs import pid_namespace, proc_stat

if TYPE_CHECKING:
    import numpy.typing as npt

#: Region metadata of engine-owned memory starts with this; a shared-memory
#: segment's is its name, which never does.
_PROCESS_TAG = b"pvm1:"
#: Most ranges one process_vm_writev takes (the kernel's UIO_MAXIOV).
_IOV_MAX = 1024

_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_writev = _libc.process_vm_writev
_process_vm_writev.restype = ctypes.c_ssize_t
_process_vm_writev.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def _address(buf: memoryview | mmap.mmap) -> tuple[int, ctypes.c_char]:
    anchor = ctypes.c_char.from_buffer(buf)
    return ctypes.addressof(anchor), anchor


#: madvise's MADV_POPULATE_WRITE (Linux 5.14; Python names it from 3.13).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def populate(mapping: mmap.mmap) -> None:
    """Fault every page of ``mapping`` in now, as a NIC's memory
    registration pins its pages, rather than one by one on first touch in
    the middle of transfers (then each process's first write to each 4 KiB
    of a region is a page fault, and a bench's CPU per request depends on
    how many distinct pages it happened to touch). Where the kernel cannot,
    pages fault in on first touch, as before."""
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(_MADV_POPULATE_WRITE)


#: Segments this process (or the one it forked from, which shares its
#: resource tracker) created and has not closed, by name: the creating pid
#: and the segment. Attaching to one must leave its registration.
_CREATED_HERE: dict[str, tuple[int, shared_memory.SharedMemory]] = {}


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:
        raise ValueError(f"shared memory {shm.name} is closed")
    return buf


class _ShmPeer:
    """Decode's shared-memory region, mapped here: pieces are memmoves."""

    def __init__(self, name: str) -> None:
        self.shm = shared_memory.SharedMemory(name=name)
        # Attaching registers the segment with this process's resource
        # tracker, which would unlink decode's memory when we exit. Not if
        # decode is this process: the tracker keeps one entry a name, so
        # unregistering here would make decode's unlink fail in the tracker
        # (a KeyError traceback at exit).
        if self.shm._name not in _CREATED_HERE:  # type: ignore[attr-defined]
            resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        populate(self.shm._mmap)  # type: ignore[attr-defined]
        base, self.anchor = _address(_buffer(self.shm))
        self.nbytes = self.shm.size
        self.space = FlatSpace([Buffer(base, self.nbytes)])

    def steps(self, pieces: npt.NDArray[np.int64], step_bytes: int) -> list[tuple[int, int]]:
        return [(i, i + 1) for i in range(len(pieces))]

    def copy(self, pieces: npt.NDArray[np.int64], first: int, end: int) -> str | None:
        for src, dst, n in pieces[first:end].tolist():
            ctypes.memmove(dst, src, n)
        return None

    def close(self) -> None:
        del self.anchor
        self.shm.close()


class _ProcessPeer:
    """Engine-owned memory of another process on this host: pieces are
    process_vm_writev calls into it."""

    def __init__(self, metadata: bytes) -> None:
        try:
            meta = json.loads(metadata[len(_PROCESS_TAG) :])
            self.pid = int(meta["pid"])
            start_time = int(meta["start_time"])
            namespace = str(meta["pid_namespace"])
            buffers = [Buffer(int(a), int(n)) for a, n in meta["buffers"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed loopback region metadata: {exc}") from None
        if not namespace or namespace != pid_namespace():
            raise ValueError(
                "decode's pid is not visible from here: loopback needs one host and pid namespace"
            )
        self.pidfd = os.pidfd_open(self.pid)
        try:
            # Checked after the pidfd is held: it then names this very process.
            if proc_stat(self.pid)[1] != start_time:
                raise ValueError(f"decode process {self.pid} is gone (its pid now names another process)")
        except BaseException:
            os.close(self.pidfd)
            raise
        self.space = FlatSpace(buffers)
        self.nbytes = self.space.nbytes
        self._exited = select.poll()
        self._exited.register(self.pidfd, select.POLLIN)

    def steps(self, pieces: npt.NDArray[np.int64], step_bytes: int) -> list[tuple[int, int]]:
        # Consecutive pieces of up to step_bytes together (at least one), at
        # most _IOV_MAX of them: one system call each.
        if not len(pieces):
            return []
        before = np.cumsum(pieces[:, 2]) - pieces[:, 2]
        group = before // step_bytes
        firsts = [*np.flatnonzero(np.diff(group, prepend=-1)).tolist(), len(pieces)]
        steps = []
        for first, end in itertools.pairwise(firsts):
            steps += [(i, min(i + _IOV_MAX, end)) for i in range(first, end, _IOV_MAX)]
        return steps

    def copy(self, pieces: npt.NDArray[np.int64], first: int, end: int) -> str | None:
        if self._exited.poll(0):
            return f"decode process {self.pid} exited"
        rows = pieces[first:end]
        # struct iovec is {void *base; size_t len}: two 64-bit words a range.
        local = np.ascontiguousarray(rows[:, [0, 2]], dtype=np.uint64)
        remote = np.ascontiguousarray(rows[:, [1, 2]], dtype=np.uint64)
        want = int(rows[:, 2].sum())
        n = len(rows)
        done = _process_vm_writev(self.pid, local.ctypes.data, n, remote.ctypes.data, n, 0)
        if done != want:
            err = ctypes.get_errno()
            return (
                f"process_vm_writev wrote {done} of {want} bytes: {os.strerror(err) if done < 0 else 'short'}"
            )
        return None

    def close(self) -> None:
        os.close(self.pidfd)


_Peer = _ShmPeer | _ProcessPeer
