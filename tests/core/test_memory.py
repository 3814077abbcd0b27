"""kvconn.memory: host memory for transport plugins (VRAM runs on GPU hosts: docs/gpu.md)."""

from __future__ import annotations

import importlib.util

import pytest

from kvconn.memory import Memory


def test_dram_is_zeroed_addressable_and_bounds_checked() -> None:
    mem = Memory(1 << 16)
    assert mem.addr and mem.read(0, 16) == bytes(16)
    mem.write(100, b"abc")
    assert mem.read(99, 5) == b"\0abc\0" and mem.array()[101] == ord("b")
    with pytest.raises(ValueError, match="outside"):
        mem.write((1 << 16) - 2, b"abc")
    with pytest.raises(ValueError, match="outside"):
        mem.read(-1, 2)
    with pytest.raises(ValueError, match="memory must be one of"):
        Memory(16, "hbm")
    with pytest.raises(ValueError, match="positive"):
        Memory(0)


@pytest.mark.skipif(
    bool(importlib.util.find_spec("cupy") or importlib.util.find_spec("torch")),
    reason="a GPU library is installed",
)
def test_vram_without_a_gpu_library_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="needs cupy or torch"):
        Memory(1 << 16, "vram")
