"""SGLang's KV pool, as SGLang hands it to a transfer backend, as kvconn memory.

SGLang gives a backend raw pointers (``KVArgs``): per buffer (each layer's K,
then each layer's V; one latent buffer per layer with MLA) its address
``kv_data_ptrs[i]``, size ``kv_data_lens[i]`` and the bytes of one page
``kv_item_lens[i]``. Its MHA pool stores a layer as ``[tokens, heads,
head_dim]``, token-major, which is kvconn's "NHD" page order. kvconn
registers those buffers in place (no copy) and never frees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvconn.buffers import Buffer
from kvconn.layout import KVLayout, PagedBuffer


class KVArgsError(ValueError):
    """SGLang's KVArgs do not describe memory kvconn can register."""


@attrs.frozen(slots=True)
class EngineKV:
    """One rank's KV pool: the buffers to register and how pages lie in them."""

    buffers: tuple[Buffer, ...]
    layout: KVLayout


def engine_kv(kv_args: Any, tp_size: int, tp_rank: int, is_mla: bool, kind: str = "dram") -> EngineKV:
    """Buffers and layout of the KV pool described by SGLang's ``kv_args``.

    ``tp_size`` / ``tp_rank``: this side's attention tensor parallelism (each
    rank holds ``kv_args.kv_head_num`` of the heads; with MLA every rank
    holds the whole latent and ``is_mla`` replicates it).
    """
    ptrs: Sequence[int] = list(kv_args.kv_data_ptrs)
    lens: Sequence[int] = list(kv_args.kv_data_lens)
    items: Sequence[int] = list(kv_args.kv_item_lens)
    if not ptrs or not len(ptrs) == len(lens) == len(items):
        raise KVArgsError(
            f"kv_data_ptrs, kv_data_lens and kv_item_lens must be non-empty and of one length, "
            f"got {len(ptrs)}, {len(lens)}, {len(items)}"
        )
    page_tokens = int(kv_args.page_size)
    heads = 0 if is_mla else int(kv_args.kv_head_num)
    parts = []
    for i, (nbytes, item) in enumerate(zip(lens, items, strict=True)):
        if item <= 0 or nbytes < item:
            raise KVArgsError(f"buffer {i}: {nbytes} bytes cannot hold a page of {item} bytes")
        if heads and item % (page_tokens * heads):
            raise KVArgsError(
                f"buffer {i}: a page of {item} bytes is not {page_tokens} tokens x {heads} heads"
            )
        parts.append(
            PagedBuffer(
                item,
                nbytes // item,
                buffer=i,
                tokens=page_tokens if heads else 0,
                heads=heads,
                order="NHD",
            )
        )
    buffers = tuple(
        Buffer(int(ptr), int(nbytes), kind=kind, device=int(getattr(kv_args, "gpu_id", 0) or 0))
        for ptr, nbytes in zip(ptrs, lens, strict=True)
    )
    layout = KVLayout(tuple(parts), tuple(int(n) for n in lens), tp_size, tp_rank, replicated=is_mla)
    return EngineKV(buffers, layout)


__all__ = ["EngineKV", "KVArgsError", "engine_kv"]
