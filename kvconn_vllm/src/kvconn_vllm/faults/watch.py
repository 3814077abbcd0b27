"""Inside an engine process: what happens to its KV blocks, seen from vLLM's
own block pool and KV tensors, whatever connector moves them.

* Every block that goes back to the free pool is filled with a canary
  value, and checked every engine step while it stays free and once more
  when the pool hands it out again: a changed canary is a write that landed
  after the block was freed (a late write, or a late read's completion
  notice acting on blocks already reused).
* A finished request whose blocks prefill keeps for a transfer has its
  blocks hashed then (``sent``); a request whose KV decode reports received
  has its blocks hashed at that moment, before its own forward runs
  (``received``). The parent compares the two: a read or write that moved a
  later request's bytes shows as a mismatch.
* When each request's blocks come back to the pool (``released``).

vLLM is imported by the caller; this module only needs torch tensors.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

#: The value free blocks are filled with (float32 KV: any finite value no
#: forward of a random-weight model produces exactly, block-wide).
CANARY = 12345.5


@attrs.define
class LateWrite:
    """A free block whose canary changed: ``owner`` last held it."""

    block: int
    owner: str
    freed_at: float
    seen_at: float
    #: "free" (seen by the per-step check) or "realloc" (seen when the pool
    #: handed the block out again).
    when: str


class BlockWatch:
    """Watches one engine's KV blocks (``views``: per layer, a tensor whose
    first dimension is the block)."""

    def __init__(self, views: list[Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.views = views
        self.clock = clock
        self.enabled = False
        #: Free blocks filled with the canary: block -> (owner, freed at).
        self.watched: dict[int, tuple[str, float]] = {}
        self.owner: dict[int, str] = {}
        self.late_writes: list[LateWrite] = []
        #: Request -> blocks it holds (vLLM's ids), refreshed every step.
        self.blocks_of: dict[str, list[int]] = {}
        #: Request -> when its last block went back to the pool.
        self.released: dict[str, float] = {}

    # -- hashes ----------------------------------------------------------
    def digests(self, blocks: Iterable[int]) -> list[str]:
        """blake2b of each block's bytes over every layer."""
        out = []
        for block in blocks:
            h = hashlib.blake2b(digest_size=16)
            for view in self.views:
                h.update(view[block].contiguous().numpy().tobytes())
            out.append(h.hexdigest())
        return out

    # -- the pool --------------------------------------------------------
    def note_owners(self, req_to_blocks: dict[str, list[int]]) -> None:
        """Each step: which request holds which block."""
        self.blocks_of = req_to_blocks
        for req, blocks in req_to_blocks.items():
            for block in blocks:
                self.owner[block] = req

    def on_freed(self, blocks: Iterable[int]) -> None:
        """Blocks just back in the free pool."""
        if not self.enabled:
            return
        now = self.clock()
        owners: set[str] = set()
        for block in blocks:
            owner = self.owner.pop(block, "?")
            owners.add(owner)
            self.watched[block] = (owner, now)
            for view in self.views:
                view[block].fill_(CANARY)
        for owner in owners:
            still = [b for b in self.blocks_of.get(owner, ()) if b in self.owner]
            if not still:
                self.released.setdefault(owner, now)

    def on_allocated(self, blocks: Iterable[int]) -> None:
        """Blocks the pool just handed out: their canary must be intact."""
        blocks = [b for b in blocks if b in self.watched]
        if blocks:
            self._check(blocks, "realloc")
            for block in blocks:
                self.watched.pop(block, None)

    def check(self) -> None:
        """Each step: every watched free block still holds the canary."""
        if self.watched:
            self._check(list(self.watched), "free")

    def _check(self, blocks: list[int], when: str) -> None:
        import torch

        index = torch.tensor(blocks, dtype=torch.long)
        changed = torch.zeros(len(blocks), dtype=torch.bool)
        for view in self.views:
            changed |= (view.index_select(0, index) != CANARY).reshape(len(blocks), -1).any(dim=1)
        now = self.clock()
        for block, bad in zip(blocks, changed.tolist(), strict=True):
            if bad:
                owner, freed_at = self.watched[block]
                self.late_writes.append(LateWrite(block, owner, freed_at, now, when))
                for view in self.views:  # re-armed: a later write counts again
                    view[block].fill_(CANARY)


def block_views(tensors: Iterable[Any], num_blocks: int) -> list[Any]:
    """Each KV tensor with its block dimension moved first (views: no copy).
    The block dimension is the first of ``num_blocks`` entries."""
    views = []
    for tensor in tensors:
        for tensor_part in tensor if isinstance(tensor, list | tuple) else (tensor,):
            dims = [d for d, n in enumerate(tensor_part.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"a KV tensor of shape {tuple(tensor_part.shape)} has no {num_blocks}-block dim")
            views.append(tensor_part.movedim(dims[0], 0))
    return views
