"""What the region host process (:mod:`kvconn.conformance.region_host_proc`)
does with a plugin region besides reading and writing its bytes: engine
buffers registered as a region, and checked byte by byte where they live;
the CUDA pointer query of a ``memory=vram`` region. It runs there, never in
the process that reports the verdict, because it touches memory the
plugin's writers write into.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvconn.layout import KVLayout
from kvconn.testing.kvpattern import EngineShape, wrong_buffers
from kvconn.testing.patterns import CANARY
from kvconn.transport import Backend, PageRegion, register_region


@attrs.define
class EngineRegion:
    """Decode's per-layer buffers of one TP rank, as the engine allocates
    them (canary everywhere), registered with the plugin as a region."""

    shape: EngineShape
    layout: KVLayout
    arrays: list[npt.NDArray[np.uint8]]
    region: PageRegion

    @classmethod
    def open(
        cls, backend: Backend, shape: EngineShape, tp: int, rank: int, options: Mapping[str, str]
    ) -> EngineRegion:
        arrays = shape.buffers(tp, fill=CANARY)
        region = register_region(backend, arrays, options)
        return cls(shape, shape.layout(tp, rank), arrays, region)

    @property
    def metadata(self) -> bytes:
        return self.region.metadata

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.region.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self.region.write(offset, data)

    def close(self) -> None:
        self.region.close()

    def diff(self, room: int, dst_pages: Sequence[int]) -> str:
        """ "" if ``dst_pages`` hold ``room``'s pattern in every buffer and
        no other page changed, else what differs (the engine's view: its
        arrays, not the region's read)."""
        bad = {
            p: wrong_buffers(self.shape, self.layout, self.arrays, room, i, p)
            for i, p in enumerate(dst_pages)
        }
        wrong = [p for p, buffers in bad.items() if buffers]
        if wrong:
            buffers = sorted({b for p in wrong for b in bad[p]})
            return (
                f"pages {wrong} hold wrong bytes after LANDED, in buffers {buffers[:8]} "
                "(a slice written into another buffer, head, token or page)"
            )
        others = sorted(set(range(self.shape.pages)) - set(dst_pages))
        for b, (arr, part) in enumerate(zip(self.arrays, self.layout.buffers, strict=True)):
            stray = arr.reshape(-1, part.page_bytes)[others] != CANARY
            if stray.any():
                return f"{int(stray.sum())} bytes landed outside the room's pages in buffer {b}"
        return ""


def region_address(region: Any) -> int | None:
    """Where the region's memory starts, if it says: a public ``address``
    (or ``addr``), else the :class:`kvconn.memory.Memory` it holds."""
    for owner in (region, getattr(region, "_mem", None)):
        for name in ("address", "addr"):
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def cuda_memory_type(address: int) -> str:
    """CUDA's word on where ``address`` lives: device, host, or unknown."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    # The calling thread needs a context; the device's primary one is the
    # one CuPy and PyTorch allocate in.
    context = ctypes.c_void_p()
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) == 0:
        cuda.cuCtxSetCurrent(context)
    value = ctypes.c_uint(0)
    pointer_memory_type = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    err = cuda.cuPointerGetAttribute(ctypes.byref(value), pointer_memory_type, ctypes.c_ulonglong(address))
    if err != 0:
        return f"unknown to CUDA (error {err}), i.e. not device"
    return {1: "host", 2: "device", 3: "array", 4: "unified"}.get(value.value, f"type {value.value}")


def memory_kind(region: Any) -> str | None:
    """Where a region's memory lives, by CUDA's word; None if the region
    does not say where it starts."""
    address = region_address(region)
    if address is None:
        return None
    try:
        return cuda_memory_type(address)
    except OSError as exc:  # no libcuda: no device memory either
        return f"unknown to CUDA ({exc}), i.e. not device"
