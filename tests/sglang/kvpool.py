"""An SGLang-shaped KV pool in numpy: per layer a K and a V buffer of
``[pages * page_size, heads, head_dim]`` bytes (token-major, as SGLang's MHA
pool), handed to a transfer backend as SGLang does, through KVArgs pointers.

Every byte of a prefill page is a function of (buffer, page, token, global
head), so a decode page can be checked byte by byte whatever the TP split.
"""

from __future__ import annotations

from typing import Any

import numpy as np

LAYERS = 2
PAGE_TOKENS = 4
HEAD_BYTES = 8
TOTAL_HEADS = 4
NUM_PAGES = 16


def pattern(buffer: int, page: int, heads: range) -> np.ndarray:
    """The bytes prefill holds for ``page`` of ``buffer`` over global ``heads``."""
    token = np.arange(PAGE_TOKENS)[:, None, None]
    head = np.asarray(heads)[None, :, None]
    byte = np.arange(HEAD_BYTES)[None, None, :]
    values = buffer * 31 + page * 7 + token * 3 + head * 11 + byte * 5 + 1
    return (values % 251).astype(np.uint8)


class Pool:
    """One rank's pool: ``tp_size`` ranks split TOTAL_HEADS evenly."""

    def __init__(self, tp_size: int, tp_rank: int, fill: bool) -> None:
        self.heads = TOTAL_HEADS // tp_size
        self.global_heads = range(tp_rank * self.heads, (tp_rank + 1) * self.heads)
        self.tp_rank = tp_rank
        self.metadata: Any = None
        self.arrays = [
            np.zeros((NUM_PAGES, PAGE_TOKENS, self.heads, HEAD_BYTES), np.uint8) for _ in range(2 * LAYERS)
        ]
        if fill:
            for b, array in enumerate(self.arrays):
                for p in range(NUM_PAGES):
                    array[p] = pattern(b, p, self.global_heads)

    def kv_args(self, kv_args_class: type, metadata: Any = None) -> Any:
        """SGLang's KVArgs over this pool; ``metadata``: SGLang's MetadataBuffers (aux)."""
        args = kv_args_class()
        if metadata is not None:
            args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = metadata.get_buf_infos()
        args.engine_rank = self.tp_rank
        args.kv_data_ptrs = [a.ctypes.data for a in self.arrays]
        args.kv_data_lens = [a.nbytes for a in self.arrays]
        args.kv_item_lens = [a[0].nbytes for a in self.arrays]
        args.page_size = PAGE_TOKENS
        args.kv_head_num = self.heads
        args.gpu_id = 0
        return args

    def page_matches(self, dst_page: int, src_page: int) -> bool:
        return all(
            np.array_equal(a[dst_page], pattern(b, src_page, self.global_heads))
            for b, a in enumerate(self.arrays)
        )

    def page_untouched(self, page: int) -> bool:
        return all(not a[page].any() for a in self.arrays)
