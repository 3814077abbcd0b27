"""Region and source memory: numpy in DRAM, or a CUDA device buffer (cupy,
else torch) for ``memory=vram``.

Mooncake's CUDA wheel (``mooncake-transfer-engine``) moves device memory over
tcp by staging each 64 KiB piece through host memory (``cudaMemcpy`` in the
transport threads); the CPU wheel (``-non-cuda``) would dereference a device
pointer, so VRAM is refused unless the CUDA wheel is the one installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

MEMORY_KINDS = ("dram", "vram")
CUDA_DIST = "mooncake-transfer-engine"  # the CPU wheel is mooncake-transfer-engine-non-cuda


def cuda_engine_installed() -> bool:
    """Whether the installed ``mooncake`` package is the CUDA wheel (no import)."""
    try:
        importlib.metadata.version(CUDA_DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@attrs.frozen
class MemoryOptions:
    """``memory`` (``dram`` | ``vram``) and ``gpu_device`` (CUDA device id for
    vram; not ``device``, which is Mooncake's RDMA device filter)."""

    memory: str = "dram"
    gpu_device: int = 0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> MemoryOptions:
        memory = options.get("memory", "dram").strip().lower()
        if memory not in MEMORY_KINDS:
            raise ValueError(f"mooncake memory must be one of {MEMORY_KINDS}, not {memory!r}")
        return cls(memory, int(options.get("gpu_device", "0")))


class Memory:
    """``nbytes`` of zeroed memory at ``addr``, read and written from the host."""

    def __init__(self, nbytes: int, opts: MemoryOptions) -> None:
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        self.nbytes = nbytes
        self.kind = opts.memory
        self._buf: Any
        self._lib = "numpy"
        if opts.memory == "dram":
            self._buf = np.zeros(nbytes, dtype=np.uint8)
            self.addr = int(self._buf.ctypes.data)
            return
        if not cuda_engine_installed():
            raise RuntimeError(
                f"memory=vram needs Mooncake's CUDA wheel ({CUDA_DIST}==0.3.13.post1); "
                "the -non-cuda engine cannot read device memory"
            )
        try:
            cupy: Any = importlib.import_module("cupy")
        except ImportError:
            cupy = None
        if cupy is not None:
            with cupy.cuda.Device(opts.gpu_device):
                self._buf = cupy.zeros(nbytes, dtype=cupy.uint8)
                cupy.cuda.Device().synchronize()
            self.addr = int(self._buf.data.ptr)
            self._lib = "cupy"
            return
        try:
            torch: Any = importlib.import_module("torch")
        except ImportError:
            raise RuntimeError(
                "memory=vram needs cupy or torch (with CUDA) to allocate device memory"
            ) from None
        self._buf = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{opts.gpu_device}")
        torch.cuda.synchronize(self._buf.device)
        self.addr = int(self._buf.data_ptr())
        self._lib = "torch"

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
            return bytes(part.get().tobytes())  # synchronous device-to-host copy
        return bytes(part.cpu().numpy().tobytes())

    def write(self, offset: int, data: bytes) -> None:
        self._check(offset, len(data), "write")
        src = np.frombuffer(data, dtype=np.uint8)
        end = offset + len(data)
        if self._lib == "numpy":
            self._buf[offset:end] = src
        elif self._lib == "cupy":
            cupy = importlib.import_module("cupy")
            with self._buf.device:
                self._buf[offset:end] = cupy.asarray(src)
            self._buf.device.synchronize()  # the engine's threads copy this memory next
        else:
            torch = importlib.import_module("torch")
            self._buf[offset:end] = torch.from_numpy(src.copy()).to(self._buf.device)
            torch.cuda.synchronize(self._buf.device)

    def free(self) -> None:
        self._buf = None
