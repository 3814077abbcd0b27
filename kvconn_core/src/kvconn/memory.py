"""Page or source memory for transport plugins: host (DRAM, numpy) or GPU
(VRAM, CuPy or else PyTorch), read and written from the host.

Needs numpy (and CuPy or PyTorch with CUDA for VRAM), imported on first use:
kvconn-core itself does not depend on them.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvconn.buffers import Buffer, FlatSpace, buffers_of

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

MEMORY_KINDS = ("dram", "vram")


class Memory:
    """``nbytes`` of zeroed memory at ``addr``: ``kind`` "dram", or "vram" on
    CUDA device ``device``."""

    def __init__(self, nbytes: int, kind: str = "dram", device: int = 0) -> None:
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        if kind not in MEMORY_KINDS:
            raise ValueError(f"memory must be one of {MEMORY_KINDS}, not {kind!r}")
        self.nbytes = nbytes
        self.kind = kind
        self._np: Any = importlib.import_module("numpy")
        self._buf: Any
        if kind == "dram":
            self._lib = "numpy"
            self._buf = self._np.zeros(nbytes, dtype=self._np.uint8)
            self.addr = int(self._buf.ctypes.data)
            return
        try:
            cupy: Any = importlib.import_module("cupy")
        except ImportError:
            cupy = None
        if cupy is not None:
            self._lib = "cupy"
            with cupy.cuda.Device(device):
                self._buf = cupy.zeros(nbytes, dtype=cupy.uint8)
                cupy.cuda.Device().synchronize()  # the zero fill, before a transport writes
            self.addr = int(self._buf.data.ptr)
            return
        try:
            torch: Any = importlib.import_module("torch")
        except ImportError:
            raise RuntimeError(
                "memory=vram needs cupy or torch (with CUDA) to allocate device memory"
            ) from None
        self._lib = "torch"
        self._buf = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        torch.cuda.synchronize(self._buf.device)
        self.addr = int(self._buf.data_ptr())

    def array(self) -> npt.NDArray[np.uint8]:
        """The DRAM buffer itself (no copy); DRAM only."""
        if self.kind != "dram":
            raise TypeError("array() is only available for memory=dram (use read/write)")
        buf: npt.NDArray[np.uint8] = self._buf
        return buf

    def _check(self, offset: int, nbytes: int, what: str) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"{what} range [{offset}, {offset + nbytes}) outside [0, {self.nbytes})")

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check(offset, nbytes, "read")
        part = self._buf[offset : offset + nbytes]
        if self._lib == "numpy":
            return bytes(part.tobytes())
        if self._lib == "cupy":
            return bytes(part.get().tobytes())  # a synchronous device-to-host copy
        return bytes(part.cpu().numpy().tobytes())

    def write(self, offset: int, data: bytes) -> None:
        self._check(offset, len(data), "write")
        src = self._np.frombuffer(data, dtype=self._np.uint8)
        end = offset + len(data)
        if self._lib == "numpy":
            self._buf[offset:end] = src
        elif self._lib == "cupy":
            cupy = importlib.import_module("cupy")
            with self._buf.device:
                self._buf[offset:end] = cupy.asarray(src)
            self._buf.device.synchronize()  # a transport's own threads touch this memory next
        else:
            torch = importlib.import_module("torch")
            self._buf[offset:end] = torch.from_numpy(src.copy()).to(self._buf.device)
            torch.cuda.synchronize(self._buf.device)

    def free(self) -> None:
        self._buf = None


class MemorySpace:
    """A transport endpoint's memory: ``nbytes`` kvconn allocates (of
    ``kind`` on ``device``), or the engine's buffers, which it never frees.
    Offsets are flat over the buffers (:class:`~kvconn.buffers.FlatSpace`)."""

    def __init__(self, source: int | Sequence[Buffer], kind: str = "dram", device: int = 0) -> None:
        self._mem: Memory | None = None
        if isinstance(source, int):
            self._mem = Memory(source, kind, device)
            self.flat = FlatSpace([Buffer(self._mem.addr, source, kind, device, owner=self._mem)])
        else:
            self.flat = FlatSpace(buffers_of(source))
        self.nbytes = self.flat.nbytes
        self.kind = self.flat.kind
        self.device = self.flat.device if self.kind == "vram" else 0

    @property
    def owned(self) -> bool:
        """kvconn allocated it (and frees it)."""
        return self._mem is not None

    @property
    def single(self) -> bool:
        """One buffer: an offset is its address minus :attr:`addr`."""
        return len(self.flat.buffers) == 1

    @property
    def addr(self) -> int:
        """The first buffer's address."""
        return self.flat.buffers[0].address

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """(address, bytes) of every buffer, in offset order."""
        return tuple((b.address, b.nbytes) for b in self.flat.buffers)

    def array(self) -> npt.NDArray[np.uint8]:
        if self._mem is None:
            raise TypeError("array() is for memory kvconn allocated; engine buffers are the engine's")
        return self._mem.array()

    def read(self, offset: int, nbytes: int) -> bytes:
        if self._mem is not None:
            return self._mem.read(offset, nbytes)
        return self.flat.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        if self._mem is not None:
            self._mem.write(offset, data)
        else:
            self.flat.write(offset, data)

    def free(self) -> None:
        """Free what kvconn allocated; engine buffers are only let go of."""
        if self._mem is not None:
            self._mem.free()
        self.flat = FlatSpace([Buffer(1, 1)])
