"""Page or source memory for transport plugins: host (DRAM, numpy) or GPU
(VRAM, CuPy or else PyTorch), read and written from the host.

Needs numpy (and CuPy or PyTorch with CUDA for VRAM), imported on first use:
kvconn-core itself does not depend on them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
