"""SGLang's KV pool, as SGLang hands it to a transfer backend, as kvconn memory.

SGLang gives a backend raw pointers (``KVArgs``): per buffer (each layer's K,
then each layer's V; one latent buffer per layer with MLA) its address
``kv_data_ptrs[i]``, size ``kv_data_lens[i]`` and the bytes of one page
``kv_item_lens[i]``. Its MHA pool stores a layer as ``[tokens, heads,
head_dim]``, token-major, which is kvconn's "NHD" page order. kvconn
registers those buffers in place (no copy) and never frees them.

SGLang's aux buffers (``aux_data_ptrs`` / ``_lens`` / ``_item_lens``: the
first output token, logprobs, hidden states, the room id its decode checks)
hold one row per request slot: they become kvconn's per-room extras, written
with a room's last chunk under the same acks and proofs as its pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvconn.buffers import Buffer
from kvconn.layout import ExtraSlots, KVLayout, PagedBuffer


class KVArgsError(ValueError):
    """SGLang's KVArgs do not describe memory kvconn can register."""


@attrs.frozen(slots=True)
class EngineKV:
    """One rank's KV pool: the buffers to register and how pages lie in them."""

    buffers: tuple[Buffer, ...]
    layout: KVLayout


def engine_kv(
    kv_args: Any, tp_size: int, tp_rank: int, is_mla: bool, kind: str = "dram", heads: int | None = None
) -> EngineKV:
    """Buffers and layout of the KV pool described by SGLang's ``kv_args``.

    ``tp_size`` / ``tp_rank``: this side's attention tensor parallelism (each
    rank holds ``heads`` of the KV heads, by default ``kv_args.kv_head_num``;
    with MLA every rank holds the whole latent and ``is_mla`` replicates it).
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
    heads = 0 if is_mla else int(kv_args.kv_head_num if heads is None else heads)
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
    device = int(getattr(kv_args, "gpu_id", 0) or 0)
    buffers = [
        Buffer(int(ptr), int(nbytes), kind=kind, device=device)
        for ptr, nbytes in zip(ptrs, lens, strict=True)
    ]
    sizes = [int(n) for n in lens]
    extras = []
    aux = _aux(kv_args)
    for i, (ptr, nbytes, item) in enumerate(aux):
        if item <= 0 or nbytes < item:
            raise KVArgsError(f"aux buffer {i}: {nbytes} bytes cannot hold a slot of {item} bytes")
        # SGLang's aux rows live in host memory (MetadataBuffers on "cpu").
        extras.append(ExtraSlots(len(buffers), item, nbytes // item))
        buffers.append(Buffer(ptr, nbytes, kind="dram"))
        sizes.append(nbytes)
    layout = KVLayout(tuple(parts), tuple(sizes), tp_size, tp_rank, replicated=is_mla, extras=tuple(extras))
    return EngineKV(tuple(buffers), layout)


def _aux(kv_args: Any) -> list[tuple[int, int, int]]:
    ptrs = list(getattr(kv_args, "aux_data_ptrs", None) or [])
    lens = list(getattr(kv_args, "aux_data_lens", None) or [])
    items = list(getattr(kv_args, "aux_item_lens", None) or [])
    if not len(ptrs) == len(lens) == len(items):
        raise KVArgsError(
            f"aux_data_ptrs, aux_data_lens and aux_item_lens must be of one length, "
            f"got {len(ptrs)}, {len(lens)}, {len(items)}"
        )
    return [(int(p), int(n), int(i)) for p, n, i in zip(ptrs, lens, items, strict=True)]


__all__ = ["EngineKV", "KVArgsError", "engine_kv"]
