"""What a prefill rank writes: a chunk of a room's pages, lowered to byte segments."""

from __future__ import annotations

import attrs


@attrs.frozen(slots=True)
class Segment:
    """One contiguous copy: ``nbytes`` from the writer's source region at ``src``
    into the page owner's region at ``dst`` (both byte offsets)."""

    src: int
    dst: int
    nbytes: int


@attrs.frozen(slots=True)
class Chunk:
    """A unit of transfer work for one room, as dequeued by a prefill worker.

    ``src_pages`` index the prefill rank's source pool, ``dst_pages`` the
    decode pool; the core lowers them to :class:`Segment` s before posting.
    """

    room: int
    index: int
    last: bool
    rank: int
    peer: str
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
