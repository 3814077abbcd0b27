"""kvconn.buffers: engine memory taken without a copy, and the flat offset space."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconn.buffers import Buffer, FlatSpace, buffers_of


class _DLPackOnly:
    """Exposes its array through DLPack alone (as a CPU tensor of another
    library would)."""

    def __init__(self, arr: np.ndarray[Any, Any]) -> None:
        self._arr = arr

    def __dlpack__(self, stream: object = None) -> object:
        return self._arr.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _FakeDeviceArray:
    """What CuPy exposes, minus the GPU: the address is only read, never touched."""

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None = None) -> None:
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": "<f2",
            "strides": strides,
            "version": 3,
        }


def test_numpy_bytearray_and_mmap_are_taken_in_place() -> None:
    arr = np.zeros((4, 16), dtype=np.float16)
    buf = Buffer.of(arr)
    assert (buf.address, buf.nbytes, buf.kind, buf.device) == (arr.ctypes.data, arr.nbytes, "dram", 0)
    assert buf.owner is arr
    raw = bytearray(100)
    assert Buffer.of(raw).nbytes == 100
    m = mmap.mmap(-1, 4096)
    assert Buffer.of(m).nbytes == 4096
    FlatSpace([Buffer.of(arr)]).write(2, b"\x01\x02")
    assert arr.reshape(-1).view(np.uint8)[2:4].tolist() == [1, 2]  # the engine sees the write: no copy
    del buf
    m.close()


def test_dlpack_producer_gives_its_data_pointer() -> None:
    arr = np.arange(64, dtype=np.int32)
    buf = Buffer.of(_DLPackOnly(arr))
    assert (buf.address, buf.nbytes, buf.kind) == (arr.ctypes.data, 256, "dram")
    sliced = np.arange(64, dtype=np.int32)[8:]
    assert Buffer.of(_DLPackOnly(sliced)).address == sliced.ctypes.data


def test_cuda_array_interface_is_vram_with_its_size() -> None:
    buf = Buffer.of(_FakeDeviceArray(0x7F0000000000, (2, 8, 4)))
    assert (buf.address, buf.nbytes, buf.kind) == (0x7F0000000000, 2 * 8 * 4 * 2, "vram")
    with pytest.raises(TypeError, match="C-contiguous"):
        Buffer.of(_FakeDeviceArray(0x7F0000000000, (2, 8, 4), strides=(8, 16, 2)))


def test_non_contiguous_read_only_and_foreign_objects_are_refused_by_name() -> None:
    arr = np.zeros((8, 8), dtype=np.uint8)
    with pytest.raises(TypeError, match="C-contiguous"):
        Buffer.of(arr[:, ::2])
    with pytest.raises(TypeError, match="read-only"):
        Buffer.of(b"immutable bytes")
    with pytest.raises(TypeError, match="cannot take the memory of a object"):
        Buffer.of(object())
    with pytest.raises(ValueError, match="positive"):
        Buffer(0x1000, 0)
    with pytest.raises(ValueError, match="memory kind"):
        Buffer(0x1000, 10, "hbm")
    with pytest.raises(ValueError, match="several places"):
        buffers_of([Buffer(0x1000, 10), Buffer(0x2000, 10, "vram")])


def test_flat_space_maps_offsets_to_addresses_and_refuses_straddling() -> None:
    a, b, c = np.zeros(100, np.uint8), np.zeros(50, np.uint8), np.zeros(10, np.uint8)
    space = FlatSpace(buffers_of([a, b, c]))
    assert space.starts == (0, 100, 150) and space.nbytes == 160
    addresses, index = space.locate(np.array([0, 99, 100, 149, 150]), np.array([100, 1, 50, 1, 10]))
    assert index.tolist() == [0, 0, 1, 1, 2]
    assert addresses.tolist() == [
        a.ctypes.data,
        a.ctypes.data + 99,
        b.ctypes.data,
        b.ctypes.data + 49,
        c.ctypes.data,
    ]
    for offset, n in ((99, 2), (140, 20), (-1, 1), (155, 10)):
        with pytest.raises(ValueError, match="outside the buffers or across two"):
            space.locate(np.array([offset]), np.array([n]))
    space.write(148, b"xy")
    space.write(150, b"z")
    assert bytes(b[48:]) == b"xy" and bytes(c[:1]) == b"z" and space.read(148, 2) == b"xy"


@given(
    st.integers(2, 4),
    st.lists(st.tuples(st.integers(-2, 70), st.integers(0, 20)), min_size=1, max_size=8),
)
def test_flat_space_of_buffers_alike_locates_as_a_search_does(
    count: int, ranges: list[tuple[int, int]]
) -> None:
    """Buffers all of one size (an engine's K and V) find a range's buffer by
    a division: every range's address and buffer as a plain reference says,
    or a refusal when one lies outside or across two."""
    size = 16
    alike = FlatSpace([Buffer(1000 * (i + 1), size) for i in range(count)])
    offsets = np.array([o for o, _ in ranges], dtype=np.int64)
    lengths = np.array([n for _, n in ranges], dtype=np.int64)
    # The reference: a range lies in buffer offset // size, start to end.
    expected = []
    for o, n in ranges:
        i = o // size
        inside = 0 <= o < count * size and o + n <= (i + 1) * size
        expected.append((1000 * (i + 1) + o - i * size, i) if inside else None)
    if all(e is not None for e in expected):
        addresses, index = alike.locate(offsets, lengths)
        assert list(zip(addresses.tolist(), index.tolist(), strict=True)) == expected
    else:
        with pytest.raises(ValueError, match="outside the buffers or across two"):
            alike.locate(offsets, lengths)


def test_torch_tensors_are_taken_in_place() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros((2, 4, 16, 8), dtype=torch.float16)
    buf = Buffer.of(t)
    assert (buf.address, buf.nbytes, buf.kind) == (t.data_ptr(), t.numel() * 2, "dram")
    FlatSpace([buf]).write(0, b"\x00\x3c")  # fp16 1.0, little-endian
    assert float(t.view(-1)[0]) == 1.0  # the engine's tensor sees it: no copy
    assert Buffer.of(t[1]).address == t[1].data_ptr()
    with pytest.raises(TypeError, match="contiguous"):
        Buffer.of(t.transpose(1, 2))
