"""Memory an engine already owns, as kvconn sees it: address ranges.

A serving engine allocates its KV cache itself (per-layer tensors on the
GPU, pinned host arrays) and hands kvconn the ranges to register. kvconn
never copies out of them on the data path and never frees them: a region or
writer opened over :class:`Buffer` s deregisters them on ``close()``, no more.

Several buffers make one flat offset space, in list order: buffer ``i``
occupies ``[start_i, start_i + nbytes_i)`` with ``start_0 = 0`` and no gap.
Segments address that space; one never straddles two buffers
(:class:`FlatSpace` checks it, and turns offsets into addresses).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import attrs
import numpy as np

from kvconn.errors import ArgumentError, ArgumentTypeError

if TYPE_CHECKING:
    import numpy.typing as npt

MEMORY_KINDS = ("dram", "vram")

#: DLPack device types (dlpack.h): what ``__dlpack_device__`` answers.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ArgumentError(f"{attribute.name} must be positive, got {value}")


def _kind(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in MEMORY_KINDS:
        raise ArgumentError(f"memory kind must be one of {MEMORY_KINDS}, not {value!r}")


@attrs.frozen(slots=True)
class Buffer:
    """``nbytes`` at ``address``: host memory (``kind`` "dram") or memory of
    CUDA device ``device`` ("vram").

    ``owner`` is whatever object the range belongs to (a tensor, an array): a
    region or writer keeps it referenced, so the memory outlives its
    registration. It takes no part in equality.
    """

    address: int = attrs.field(validator=_positive)
    nbytes: int = attrs.field(validator=_positive)
    kind: str = attrs.field(default="dram", validator=_kind)
    device: int = 0
    owner: object = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def of(cls, obj: object) -> Buffer:
        """The memory of ``obj``, without a copy: a :class:`Buffer` (itself), a
        torch tensor (CPU or CUDA), anything with ``__cuda_array_interface__``
        (CuPy, Numba), anything with the buffer protocol or
        ``__array_interface__`` (numpy, bytearray, mmap), or a DLPack producer.

        The memory must be contiguous and writable: a region is written into,
        and a writer's transport may register it read-write. Raises TypeError
        naming what is wrong otherwise.
        """
        if isinstance(obj, Buffer):
            return obj
        if _is_torch_tensor(obj):
            return _of_torch(obj)
        cai = getattr(obj, "__cuda_array_interface__", None)
        if cai is not None:
            return _of_cuda_array_interface(obj, cai)
        if hasattr(obj, "__array_interface__") or _has_buffer_protocol(obj):
            return _of_host(obj)
        if hasattr(obj, "__dlpack__"):
            return _of_dlpack(obj)
        raise ArgumentTypeError(
            f"cannot take the memory of a {type(obj).__name__}: expected a Buffer, a torch tensor, or an "
            "object with __cuda_array_interface__, the buffer protocol, __array_interface__ or __dlpack__"
        )


def buffers_of(objs: Sequence[object]) -> tuple[Buffer, ...]:
    """:meth:`Buffer.of` of each; refuses an empty list and mixed memory kinds
    or devices (one transport registration covers one device)."""
    bufs = tuple(Buffer.of(o) for o in objs)
    if not bufs:
        raise ArgumentError("at least one buffer is needed")
    places = {(b.kind, b.device if b.kind == "vram" else 0) for b in bufs}
    if len(places) > 1:
        raise ArgumentError(
            f"buffers live in several places {sorted(places)}: one region or writer needs one"
        )
    return bufs


class FlatSpace:
    """Buffers laid end to end as one offset space, and the way back from
    offsets to addresses (vectorised: no Python work per segment)."""

    __slots__ = ("_bases", "_ends", "_shift", "_starts", "_unit", "buffers", "device", "kind", "nbytes")

    def __init__(self, buffers: Sequence[Buffer]) -> None:
        self.buffers = tuple(buffers)
        if not self.buffers:
            raise ArgumentError("at least one buffer is needed")
        sizes = np.array([b.nbytes for b in self.buffers], dtype=np.int64)
        self._starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        self._ends = self._starts + sizes
        self._bases = np.array([b.address for b in self.buffers], dtype=np.int64)
        #: A flat offset in buffer i plus _shift[i] is its address.
        self._shift = self._bases - self._starts
        #: Every buffer's size when they are all alike (an engine's K and V
        #: buffers), else 0: then an offset's buffer is a division, not a search.
        self._unit = int(sizes[0]) if (sizes == sizes[0]).all() else 0
        self.nbytes = int(sizes.sum())
        self.kind = self.buffers[0].kind
        self.device = self.buffers[0].device

    @property
    def starts(self) -> tuple[int, ...]:
        """Where each buffer begins in the flat space."""
        return tuple(int(s) for s in self._starts)

    def locate(
        self, offsets: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(addresses, buffer indices) of ranges ``[offset, offset + length)``.
        Raises ValueError for the first one outside every buffer or across two."""
        if len(self.buffers) == 1:
            ends = offsets + lengths
            bad = (offsets < 0) | (ends > self.nbytes)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                self._raise(int(offsets[i]), int(lengths[i]))
            return offsets + self._bases[0], np.zeros(len(offsets), dtype=np.int64)
        if not len(offsets):
            return offsets + 0, np.zeros(0, dtype=np.int64)
        # Few passes and fewer new arrays: a chunk of 20,000 segments makes
        # arrays of 160 KB, each new one fresh pages to fault in (glibc maps
        # and trims blocks that large). The checks are whole-array reductions;
        # the range at fault is looked for only when one fails.
        if offsets.min() < 0 or offsets.max() >= self.nbytes:
            self._raise_first(offsets, lengths, (offsets < 0) | (offsets >= self.nbytes))
        if not self._unit:
            index = np.searchsorted(self._starts, offsets, side="right") - 1
            if (offsets + lengths > self._ends[index]).any():
                self._raise_first(offsets, lengths, offsets + lengths > self._ends[index])
            return offsets + self._shift[index], index
        # Buffers all alike: the buffer is a division, the check is on the
        # offset within it.
        index = offsets // self._unit
        within = index * self._unit
        np.subtract(offsets, within, out=within)
        if within.max() + lengths.max() > self._unit and (within + lengths > self._unit).any():
            self._raise_first(offsets, lengths, within + lengths > self._unit)
        address = self._bases[index]
        address += within
        return address, index

    def address(self, offset: int, nbytes: int) -> int:
        """The address of one range (see :meth:`locate`)."""
        addresses, _ = self.locate(np.array([offset], np.int64), np.array([nbytes], np.int64))
        return int(addresses[0])

    def _raise_first(
        self, offsets: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], bad: npt.NDArray[np.bool_]
    ) -> NoReturn:
        i = int(np.flatnonzero(bad)[0])
        self._raise(int(offsets[i]), int(lengths[i]))

    def _raise(self, offset: int, nbytes: int) -> NoReturn:
        raise ArgumentError(
            f"range [{offset}, {offset + nbytes}) lies outside the buffers or across two of them "
            f"(buffer starts {self.starts}, {self.nbytes} bytes in all)"
        )

    # -- host-side access (canaries, verification, an engine's reads) --------
    def read(self, offset: int, nbytes: int) -> bytes:
        if nbytes == 0:
            return b""
        address = self.address(offset, nbytes)
        if self.kind == "dram":
            return ctypes.string_at(address, nbytes)
        out = bytearray(nbytes)
        _cuda_copy(ctypes.addressof(ctypes.c_char.from_buffer(out)), address, nbytes, to_device=False)
        return bytes(out)

    def write(self, offset: int, data: bytes) -> None:
        if not data:
            return
        address = self.address(offset, len(data))
        if self.kind == "dram":
            ctypes.memmove(address, data, len(data))
            return
        src = bytearray(data)
        _cuda_copy(address, ctypes.addressof(ctypes.c_char.from_buffer(src)), len(data), to_device=True)


_CUDART_NAMES = ("libcudart.so", "libcudart.so.12", "libcudart.so.11.0")


def _cuda_copy(dst: int, src: int, nbytes: int, to_device: bool) -> None:
    """A synchronous host<->device copy through the CUDA runtime."""
    for name in _CUDART_NAMES:
        try:
            cudart = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise RuntimeError("reading or writing vram from the host needs the CUDA runtime (libcudart)")
    kind = 1 if to_device else 2  # cudaMemcpyHostToDevice / DeviceToHost
    err = cudart.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), kind)
    if err:
        raise RuntimeError(f"cudaMemcpy failed with CUDA error {err}")


# -- Buffer.of, per kind of object ------------------------------------------
def _is_torch_tensor(obj: object) -> bool:
    # Duck-typed: kvconn does not depend on torch, and importing it costs seconds.
    cls = type(obj)
    return cls.__module__.startswith("torch") and all(
        hasattr(obj, a) for a in ("data_ptr", "element_size", "numel", "is_contiguous", "device")
    )


def _of_torch(t: Any) -> Buffer:
    if not t.is_contiguous():
        raise ArgumentTypeError(
            "a torch tensor must be contiguous to be registered (its bytes are one range)"
        )
    nbytes = int(t.numel()) * int(t.element_size())
    device_type = t.device.type
    if device_type == "cpu":
        return Buffer(int(t.data_ptr()), nbytes, "dram", 0, owner=t)
    if device_type == "cuda":
        return Buffer(int(t.data_ptr()), nbytes, "vram", int(t.device.index or 0), owner=t)
    raise ArgumentTypeError(f"torch tensors on {device_type!r} cannot be registered (cpu or cuda only)")


def _contiguous_nbytes(shape: Sequence[int], typestr: str, strides: Sequence[int] | None) -> int:
    itemsize = np.dtype(typestr).itemsize
    count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if strides is not None:
        expected, step = [], itemsize
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if count > 1 and [s for s, d in zip(strides, shape, strict=True) if d > 1] != [
            s for s, d in zip(reversed(expected), shape, strict=True) if d > 1
        ]:
            raise ArgumentTypeError(
                f"memory must be C-contiguous to be registered, strides are {tuple(strides)}"
            )
    return count * itemsize


def _of_cuda_array_interface(obj: Any, cai: dict[str, Any]) -> Buffer:
    address, readonly = cai["data"]
    if readonly:
        raise ArgumentTypeError("read-only device memory cannot be registered")
    nbytes = _contiguous_nbytes(cai["shape"], cai["typestr"], cai.get("strides"))
    device = getattr(obj, "device", None)
    index = getattr(device, "id", None)  # CuPy
    if index is None:
        index = getattr(device, "index", None)  # torch-like
    if index is None:
        index = getattr(obj, "__dlpack_device__", lambda: (_DL_CUDA, 0))()[1]
    return Buffer(int(address), nbytes, "vram", int(index or 0), owner=obj)


def _has_buffer_protocol(obj: object) -> bool:
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _of_host(obj: Any) -> Buffer:
    # np.frombuffer needs the buffer protocol; __array_interface__ alone goes through asarray.
    try:
        view = memoryview(obj)
    except TypeError:
        arr = np.asarray(obj)
        if not arr.flags.c_contiguous:
            raise ArgumentTypeError("memory must be C-contiguous to be registered") from None
        if not arr.flags.writeable:
            raise ArgumentTypeError("read-only memory cannot be registered") from None
        return Buffer(int(arr.ctypes.data), int(arr.nbytes), "dram", 0, owner=obj)
    if not view.c_contiguous:
        raise ArgumentTypeError("memory must be C-contiguous to be registered")
    if view.readonly:
        raise ArgumentTypeError("read-only memory cannot be registered")
    if view.nbytes == 0:
        raise ArgumentError("an empty buffer cannot be registered")
    arr = np.frombuffer(view, dtype=np.uint8)
    return Buffer(int(arr.ctypes.data), view.nbytes, "dram", 0, owner=obj)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def _of_dlpack(obj: Any) -> Buffer:
    """Read the DLTensor a ``__dlpack__`` capsule points to, without consuming
    it: the capsule (kept as the owner, with ``obj``) frees the tensor's
    context when it is collected, as an unconsumed capsule does."""
    capsule = obj.__dlpack__()
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    pointer = get_pointer(capsule, b"dltensor")
    # DLManagedTensor starts with its DLTensor.
    tensor = _DLTensor.from_address(pointer)
    ndim = tensor.ndim
    shape = [tensor.shape[i] for i in range(ndim)]
    itemsize = (tensor.dtype.bits * tensor.dtype.lanes + 7) // 8
    strides = [tensor.strides[i] * itemsize for i in range(ndim)] if tensor.strides else None
    nbytes = _contiguous_nbytes(shape, f"V{itemsize}", strides)
    address = int(tensor.data or 0) + int(tensor.byte_offset)
    device_type, device_id = tensor.device.device_type, tensor.device.device_id
    owner = (obj, capsule)
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        return Buffer(address, nbytes, "dram", 0, owner=owner)
    if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        return Buffer(address, nbytes, "vram", device_id, owner=owner)
    raise ArgumentTypeError(f"DLPack device type {device_type} cannot be registered (CPU or CUDA only)")
