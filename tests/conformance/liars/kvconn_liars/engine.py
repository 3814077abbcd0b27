"""The liars' engine memory: a region registered over buffers the engine
owns (private memory of decode's process), and the writer's way into it,
Linux ``process_vm_writev`` (root, or ptrace permission over decode).

The region keeps its buffer list where a registration table would be, and
reads it through a pointer word it keeps next to it (its metadata names that
word's address): ``liar-stray`` overwrites the word after each chunk, and the
region's next read or its close crashes its process.
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Sequence

from kvconn.buffers import Buffer

_libc = ctypes.CDLL(None, use_errno=True)
_writev = _libc.process_vm_writev
_writev.restype = ctypes.c_ssize_t
_writev.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def process_write(pid: int, dst: int, src: int, nbytes: int) -> None:
    """``nbytes`` from ``src`` here to ``dst`` in process ``pid``."""
    local, remote = _Iovec(src, nbytes), _Iovec(dst, nbytes)
    done = _writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if done != nbytes:
        raise OSError(ctypes.get_errno(), f"process_vm_writev into {pid}: {os.strerror(ctypes.get_errno())}")


class EngineRegion:
    """Decode's engine buffers, registered: the metadata names this process,
    each buffer's address and size, and the table word."""

    def __init__(self, buffers: Sequence[Buffer]) -> None:
        self._buffers = list(buffers)  # keeps their owners (the arrays) referenced
        n = len(self._buffers)
        self._entries = (ctypes.c_uint64 * (2 * n))(
            *[v for b in self._buffers for v in (b.address, b.nbytes)]
        )
        #: Where the region reads its entries through (the stray lie's target).
        self._table = ctypes.c_uint64(ctypes.addressof(self._entries))
        self._count = n
        self.nbytes = sum(b.nbytes for b in self._buffers)
        self.metadata = json.dumps(
            {
                "pid": os.getpid(),
                "buffers": [[b.address, b.nbytes] for b in self._buffers],
                "table": ctypes.addressof(self._table),
            }
        ).encode()

    def _spans(self) -> list[tuple[int, int]]:
        raw = ctypes.string_at(self._table.value, 16 * self._count)  # through the table word
        words = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
        return list(zip(words[::2], words[1::2], strict=True))

    def _locate(self, offset: int, nbytes: int) -> int:
        start = 0
        for address, size in self._spans():
            if start <= offset and offset + nbytes <= start + size:
                return address + offset - start
            start += size
        raise ValueError(f"range ({offset}, {nbytes}) outside the region or across two buffers")

    def read(self, offset: int, nbytes: int) -> bytes:
        return ctypes.string_at(self._locate(offset, nbytes), nbytes)

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self._locate(offset, len(data)), data, len(data))

    def close(self) -> None:
        self._spans()  # a deregistration walks the table
        self._buffers.clear()


class ProcessPeer:
    """A registered region of another process, written with process_vm_writev."""

    def __init__(self, info: dict[str, object]) -> None:
        self.pid = int(info["pid"])  # type: ignore[call-overload]
        self.spans = [(int(a), int(n)) for a, n in info["buffers"]]  # type: ignore[attr-defined]
        self.nbytes = sum(n for _, n in self.spans)
        #: Just past the buffer list: the region's table word.
        self.tail = int(info["table"])  # type: ignore[call-overload]
        self.name = f"pid {self.pid}"

    def address(self, offset: int, nbytes: int) -> int:
        start = 0
        for address, size in self.spans:
            if start <= offset and offset + nbytes <= start + size:
                return address + offset - start
            start += size
        raise ValueError(f"segment ({offset}, {nbytes}) outside the peer or across two of its buffers")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        process_write(self.pid, dst, src, nbytes)

    def close(self) -> None:
        pass
