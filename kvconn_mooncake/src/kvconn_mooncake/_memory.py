"""Region and source memory: numpy in DRAM, or a CUDA device buffer (cupy,
else torch) for ``memory=vram``.

Mooncake's CUDA wheel (``mooncake-transfer-engine``) moves device memory over
tcp by staging each 64 KiB piece through host memory (``cudaMemcpy`` in the
transport threads); the CPU wheel (``-non-cuda``) would dereference a device
pointer, so VRAM is refused unless the CUDA wheel is the one installed.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence

import attrs

from kvconn.buffers import Buffer, buffers_of
from kvconn.memory import MEMORY_KINDS, Memory, MemorySpace
from kvconn_mooncake._options import read as read_options

__all__ = [
    "CUDA_DIST",
    "MEMORY_KINDS",
    "Memory",
    "MemoryOptions",
    "MemorySpace",
    "cuda_engine_installed",
    "open_memory",
    "open_space",
    "register_space",
    "unregister_space",
]
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
        opts = read_options(options)
        return cls(opts.choice("memory", "dram", MEMORY_KINDS), opts.integer("gpu_device", 0, low=0))


def open_memory(nbytes: int, opts: MemoryOptions) -> Memory:
    """Zeroed region or source memory; VRAM only with the CUDA engine."""
    if opts.memory == "vram" and not cuda_engine_installed():
        raise RuntimeError(
            f"memory=vram needs Mooncake's CUDA wheel ({CUDA_DIST}==0.3.13.post1); "
            "the -non-cuda engine cannot read device memory"
        )
    return Memory(nbytes, opts.memory, opts.gpu_device)


def open_space(source: int | Sequence[Buffer], opts: MemoryOptions) -> MemorySpace:
    """Memory to allocate (``source`` bytes, of the kind ``opts`` names) or
    the engine's buffers; VRAM only with the CUDA engine."""
    kind = opts.memory if isinstance(source, int) else buffers_of(source)[0].kind
    if kind == "vram" and not cuda_engine_installed():
        raise RuntimeError(
            f"vram needs Mooncake's CUDA wheel ({CUDA_DIST}==0.3.13.post1); "
            "the -non-cuda engine cannot read device memory"
        )
    return MemorySpace(source, opts.memory, opts.gpu_device)


def register_space(engine: object, space: MemorySpace) -> None:
    """Register every buffer with ``engine``: one call, or its batch form."""
    ranges = space.ranges()
    if len(ranges) == 1:
        rc = engine.register_memory(*ranges[0])  # type: ignore[attr-defined]
    else:
        rc = engine.batch_register_memory([a for a, _ in ranges], [n for _, n in ranges])  # type: ignore[attr-defined]
    if rc != 0:
        raise RuntimeError(
            f"mooncake register_memory of {len(ranges)} buffers ({space.nbytes} bytes) returned {rc}"
        )


def unregister_space(engine: object, space: MemorySpace) -> None:
    ranges = space.ranges()
    if len(ranges) == 1:
        engine.unregister_memory(ranges[0][0])  # type: ignore[attr-defined]
    else:
        engine.batch_unregister_memory([a for a, _ in ranges])  # type: ignore[attr-defined]
