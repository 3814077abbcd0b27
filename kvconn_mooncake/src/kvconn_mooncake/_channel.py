"""A writer's view of one decode region: its engine, the batches in flight
and the chunks still queued (:class:`Channel`), and a posted chunk's token."""

from __future__ import annotations

import collections
from typing import Any

import attrs

from kvconn.buffers import Buffer, FlatSpace
from kvconn.transport import Settlement
from kvconn_mooncake._batch_status import BatchPoller
from kvconn_mooncake._engine import unpack_buffers, unpack_metadata


class Pieces:
    """A chunk's transfers not yet handed to the engine: source addresses,
    destination addresses and lengths as lists (the binding takes lists),
    consumed from the front."""

    __slots__ = ("_dsts", "_lens", "_next", "_srcs")

    def __init__(self, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        self._srcs, self._dsts, self._lens = srcs, dsts, lens
        self._next = 0

    def __len__(self) -> int:
        return len(self._lens) - self._next

    def take(self, count: int) -> tuple[list[int], list[int], list[int]]:
        """The next ``count`` transfers (fewer if fewer are left)."""
        a, b = self._next, min(self._next + count, len(self._lens))
        self._next = b
        return self._srcs[a:b], self._dsts[a:b], self._lens[a:b]

    def clear(self) -> None:
        self._next = len(self._lens)


@attrs.define(eq=False)
class Channel:
    """One decode region as a writer reaches it, through an engine of its own.

    The engine's P2P handshake with a decode that is frozen (its kernel
    accepts, nothing answers) takes ~61 s, hard-coded, and every call on that
    engine waits behind it, writes to other peers included (measured). With
    an engine per channel only that decode's writes wait. The handshake runs
    on a thread of its own (:meth:`MooncakeWriter._open`), never in a hook;
    a chunk posted meanwhile waits in ``queued`` until the channel is open.
    """

    session: str
    base: int
    nbytes: int
    #: The region's buffers (address, bytes); one for memory kvconn allocated.
    buffers: tuple[tuple[int, int], ...] = ()
    #: Their offsets as addresses at decode.
    space: FlatSpace | None = None
    #: None until the opening thread made one (or after a fence destroyed it).
    engine: Any = None
    #: Non-blocking many-task batch status (None: one transfer per segment).
    poller: BatchPoller | None = None
    #: A handshake succeeded on ``engine``: only then is anything submitted.
    opened: bool = False
    opening: bool = False
    #: A batch failed on this engine: its other tasks may still be queued in
    #: it, so the next fence destroys it even with nothing in ``inflight``.
    suspect: bool = False
    #: (batch id, segments in it, token) in submission order. Pieces to one
    #: peer complete in order, so a poll stops at the first one still pending.
    inflight: collections.deque[tuple[int, int, Posted]] = attrs.field(factory=collections.deque)
    #: Segments in flight (the engine's per-peer cap, ``max_inflight``).
    inflight_n: int = 0
    #: Posted chunks with pieces not yet submitted, in posting order.
    queued: collections.deque[Posted] = attrs.field(factory=collections.deque)
    #: The writer's post count at this channel's last post (least recently
    #: used idle channels give their engine up first).
    last_post: int = 0

    @property
    def idle(self) -> bool:
        """Its engine carries no write and no handshake: every batch it was
        given completed, so handing it to another channel moves nothing."""
        return (
            self.engine is not None
            and not self.opening
            and not self.inflight
            and not self.queued
            and not self.suspect
        )

    @classmethod
    def of(cls, metadata: bytes) -> Channel:
        buffers = unpack_buffers(metadata)
        space = FlatSpace([Buffer(a, n) for a, n in buffers])
        return cls(*unpack_metadata(metadata), buffers=buffers, space=space)

    def same_region(self, other: Channel) -> bool:
        return (self.session, self.buffers) == (other.session, other.buffers)

    def fail_queued(self) -> None:
        """Its queued chunks will never be submitted here: nothing of their
        queued pieces reached an engine."""
        for tok in self.queued:
            tok.fail()
        self.queued.clear()


@attrs.define(eq=False)
class Posted:
    """The token ``on_post`` returns: one chunk's transfers."""

    generation: int
    channel: Channel
    pending: Pieces
    nbytes: int
    inflight: int = 0
    submitted: int = 0
    failed: bool = False
    abandoned: bool = False

    @property
    def done(self) -> bool:
        return not self.pending and self.inflight == 0

    def fail(self) -> None:
        """Nothing more of it is submitted; its barrier answers."""
        self.failed = True
        self.pending.clear()

    def abandon(self) -> None:
        """Its barrier gave up on it (or a fence did): submit nothing more."""
        self.abandoned = True
        self.pending.clear()

    def give_up(self) -> Settlement:
        """The barrier abandons it: settled only if nothing of it ever
        reached an engine (a failed Mooncake write may still land)."""
        self.abandon()
        return Settlement.FAILED_SETTLED if self.submitted == 0 else Settlement.UNSETTLED
