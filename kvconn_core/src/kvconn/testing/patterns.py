"""Deterministic page contents, so decode can verify every byte it got."""

from __future__ import annotations

import struct

_MASK = (1 << 64) - 1

#: The byte decode lays in every free page (and a test in every byte it
#: watches): any other value there is a write that landed where or when it
#: must not. The one canary of every test, suite and bench.
CANARY = 0xA5


def shard_bytes(room: int, rank: int, page_index: int, nbytes: int) -> bytes:
    """What ``rank`` writes as its shard of the ``page_index``-th page of
    ``room``: one 8-byte word repeated (never zero, never the canary)."""
    word = (room * 0x9E3779B97F4A7C15 + rank * 0xBF58476D1CE4E5B9 + page_index * 0x94D049BB133111EB) & _MASK
    word |= 1
    reps, rest = divmod(nbytes, 8)
    return struct.pack("<Q", word) * reps + struct.pack("<Q", word)[:rest]


def canary(nbytes: int) -> bytes:
    """What decode lays in free pages: any change reveals a late write."""
    return bytes([CANARY]) * nbytes
