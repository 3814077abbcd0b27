"""Where a page's bytes lie in an engine's KV cache, on one side of a transfer.

An engine's page (block) is not one range: it is a slot in each of many
buffers (per layer, a K and a V buffer, or one latent buffer with MLA; vLLM
also keeps K and V of a layer in one tensor, one after the other). With
tensor parallelism each rank holds some of the KV heads of every page, and
a prefill rank writes into a decode rank only the heads both hold.

A :class:`KVLayout` describes one side (a prefill rank's source buffers, or
a decode rank's page buffers): per :class:`PagedBuffer`, the bytes of one
page, their stride and offset in a registered buffer, and the page's shape
(tokens x heads, HND or NHD) for head slicing; plus optional per-room
:class:`ExtraSlots` (aux metadata, state) that travel with a room's last
chunk. Offsets are flat, as transports see them: the side's registered
buffers laid end to end in list order (``buffer_nbytes``).

:meth:`KVLayout.segments` lowers (source pages, destination pages) for a
(prefill rank, decode rank) pair to one :class:`~kvconn.chunk.SegmentTable`
over every buffer, in numpy: the per-pair pattern of a page is computed once
and cached; a chunk then costs a few array operations whatever its number of
pages, buffers and segments. Runs of pages contiguous on both sides merge
into one segment (never across two buffers).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from kvconn.buffers import Buffer, buffers_of
from kvconn.chunk import SegmentTable
from kvconn.errors import KvconnError

if TYPE_CHECKING:
    import numpy.typing as npt

ORDERS = ("HND", "NHD")
_FORMAT = 1


class LayoutError(KvconnError, ValueError):
    """A layout that does not describe memory, or two that cannot exchange
    pages. (Also a ValueError: what it was before.)"""


def _at_least(low: int) -> attrs._ValidatorType[int]:
    def check(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise LayoutError(
                f"{type(instance).__name__}.{attribute.name} must be an int >= {low}, got {value!r}"
            )

    return check


@attrs.frozen(slots=True)
class PagedBuffer:
    """Pages in one registered buffer (or one part of it).

    ``page_bytes``: bytes of one page on this side (this rank's heads only).
    ``page_stride``: bytes from one page to the next (0: ``page_bytes``).
    ``offset``: where page 0 starts in the buffer. ``buffer``: index of the
    registered buffer (-1: the same as this entry's index in the layout).
    ``tokens`` and ``heads``: a page's tokens and this rank's KV heads, for
    head slicing between tensor-parallel ranks (0: the page is not sliced;
    every pair exchanges whole pages). ``order``: "HND" (each head's tokens
    together: a range of heads is contiguous) or "NHD" (each token's heads
    together: a range of heads is one strided piece per token).
    """

    page_bytes: int = attrs.field(validator=_at_least(1))
    num_pages: int = attrs.field(validator=_at_least(1))
    page_stride: int = attrs.field(default=0, validator=_at_least(0))
    offset: int = attrs.field(default=0, validator=_at_least(0))
    buffer: int = attrs.field(default=-1, validator=_at_least(-1))
    tokens: int = attrs.field(default=0, validator=_at_least(0))
    heads: int = attrs.field(default=0, validator=_at_least(0))
    order: str = "HND"

    def __attrs_post_init__(self) -> None:
        if self.order not in ORDERS:
            raise LayoutError(f"order must be one of {ORDERS}, not {self.order!r}")
        if self.page_stride and self.page_stride < self.page_bytes:
            raise LayoutError(
                f"page_stride {self.page_stride} is shorter than a page ({self.page_bytes} bytes)"
            )
        if bool(self.tokens) != bool(self.heads):
            raise LayoutError("tokens and heads go together: both 0 (unsliced) or both set")
        if self.tokens and self.page_bytes % (self.tokens * self.heads):
            raise LayoutError(
                f"a page of {self.page_bytes} bytes does not split into {self.tokens} x {self.heads}"
            )

    @property
    def stride(self) -> int:
        return self.page_stride or self.page_bytes

    @property
    def extent(self) -> int:
        """Bytes of the buffer the pages span, from its start."""
        return self.offset + (self.num_pages - 1) * self.stride + self.page_bytes

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token (0 if unsliced)."""
        return self.page_bytes // (self.tokens * self.heads) if self.tokens else 0


@attrs.frozen(slots=True)
class ExtraSlots:
    """Per-room data outside the pages (SGLang's aux metadata, model state):
    ``num_slots`` slots of ``slot_bytes`` in registered buffer ``buffer``. A
    room's slot is written with its last chunk, by one prefill rank per
    decode rank, and covered by the same acks and proofs as its pages."""

    buffer: int = attrs.field(validator=_at_least(0))
    slot_bytes: int = attrs.field(validator=_at_least(1))
    num_slots: int = attrs.field(validator=_at_least(1))
    slot_stride: int = attrs.field(default=0, validator=_at_least(0))
    offset: int = attrs.field(default=0, validator=_at_least(0))

    @property
    def stride(self) -> int:
        return self.slot_stride or self.slot_bytes

    @property
    def extent(self) -> int:
        return self.offset + (self.num_slots - 1) * self.stride + self.slot_bytes


def _paged_buffers(value: Iterable[PagedBuffer]) -> tuple[PagedBuffer, ...]:
    parts = tuple(value)
    if not all(isinstance(p, PagedBuffer) for p in parts):
        raise LayoutError("KVLayout.buffers must be PagedBuffer values")
    return parts


def _extra_slots(value: Iterable[ExtraSlots]) -> tuple[ExtraSlots, ...]:
    extras = tuple(value)
    if not all(isinstance(e, ExtraSlots) for e in extras):
        raise LayoutError("KVLayout.extras must be ExtraSlots values")
    return extras


def _sizes(value: Iterable[int]) -> tuple[int, ...]:
    sizes = tuple(value)
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise LayoutError(f"buffer_nbytes must be positive ints, got {sizes!r}")
    return sizes


@attrs.frozen(slots=True, cache_hash=True)
class KVLayout:
    """One side's KV memory: ``buffers`` (pages in each registered buffer),
    the sizes of the registered buffers (``buffer_nbytes``, in registration
    order), this side's place in tensor parallelism (``tp_rank`` of
    ``tp_size``), and per-room ``extras``.

    ``replicated`` (MLA): every rank holds the whole page; decode rank ``d``
    is written by prefill rank ``d % prefill tp_size`` alone. The same rule
    picks who writes a room's extras.
    """

    buffers: tuple[PagedBuffer, ...] = attrs.field(converter=_paged_buffers)
    buffer_nbytes: tuple[int, ...] = attrs.field(converter=_sizes)
    tp_size: int = attrs.field(default=1, validator=_at_least(1))
    tp_rank: int = attrs.field(default=0, validator=_at_least(0))
    replicated: bool = False
    extras: tuple[ExtraSlots, ...] = attrs.field(default=(), converter=_extra_slots)

    def __attrs_post_init__(self) -> None:
        if not self.buffers:
            raise LayoutError("a layout needs at least one paged buffer")
        if self.tp_rank >= self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} outside a tp_size of {self.tp_size}")
        for i, part in enumerate(self.buffers):
            index = i if part.buffer < 0 else part.buffer
            self._check_fits(f"buffers[{i}]", index, part.extent)
        for i, extra in enumerate(self.extras):
            self._check_fits(f"extras[{i}]", extra.buffer, extra.extent)

    def _check_fits(self, what: str, index: int, extent: int) -> None:
        if index >= len(self.buffer_nbytes):
            raise LayoutError(f"{what} names buffer {index}; {len(self.buffer_nbytes)} are registered")
        if extent > self.buffer_nbytes[index]:
            raise LayoutError(
                f"{what} spans {extent} bytes of buffer {index}, which has {self.buffer_nbytes[index]}"
            )

    # -- building ----------------------------------------------------------
    @classmethod
    def uniform(
        cls,
        buffer_nbytes: Sequence[int],
        num_pages: int,
        tokens: int,
        heads: int,
        head_bytes: int,
        order: str = "HND",
        tp_size: int = 1,
        tp_rank: int = 0,
        replicated: bool = False,
        extras: Sequence[ExtraSlots] = (),
        kv_buffers: int | None = None,
    ) -> KVLayout:
        """The common case: the first ``kv_buffers`` registered buffers (all
        by default) each hold ``num_pages`` pages of ``tokens`` x ``heads`` x
        ``head_bytes`` from their start (an engine's per-layer K and V
        tensors); the rest hold extras."""
        n = len(buffer_nbytes) if kv_buffers is None else kv_buffers
        part = PagedBuffer(tokens * heads * head_bytes, num_pages, tokens=tokens, heads=heads, order=order)
        return cls(
            tuple(attrs.evolve(part, buffer=i) for i in range(n)),
            tuple(buffer_nbytes),
            tp_size,
            tp_rank,
            replicated,
            tuple(extras),
        )

    @property
    def num_pages(self) -> int:
        """Pages every buffer holds."""
        return min(p.num_pages for p in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(self.buffer_nbytes)

    @property
    def num_slots(self) -> int:
        """Extra slots every extras buffer holds (0 without extras)."""
        return min((e.num_slots for e in self.extras), default=0)

    def buffer_starts(self) -> tuple[int, ...]:
        starts, at = [], 0
        for n in self.buffer_nbytes:
            starts.append(at)
            at += n
        return tuple(starts)

    # -- the wire ----------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The layout as decode's Hello carries it to each prefill rank."""
        return json.dumps(
            {
                "format": _FORMAT,
                "buffer_nbytes": list(self.buffer_nbytes),
                "tp": [self.tp_size, self.tp_rank],
                "replicated": self.replicated,
                "buffers": [attrs.astuple(p) for p in self.buffers],
                "extras": [attrs.astuple(e) for e in self.extras],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> KVLayout:
        """Parse :meth:`to_bytes`; LayoutError names what is wrong."""
        try:
            raw = json.loads(data)
            if raw["format"] != _FORMAT:
                raise LayoutError(f"layout format {raw['format']!r}, this kvconn reads {_FORMAT}")
            tp_size, tp_rank = raw["tp"]
            return cls(
                tuple(PagedBuffer(*p) for p in raw["buffers"]),
                tuple(raw["buffer_nbytes"]),
                tp_size,
                tp_rank,
                bool(raw["replicated"]),
                tuple(ExtraSlots(*e) for e in raw["extras"]),
            )
        except LayoutError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise LayoutError(f"malformed layout: {exc!r}") from None

    # -- lowering ----------------------------------------------------------
    def writes_to(self, dst: KVLayout) -> bool:
        """Whether this (prefill) side has any byte of a page for ``dst``."""
        return bool(_plan(self, dst).groups)

    def segments(self, dst: KVLayout, src_pages: Sequence[int], dst_pages: Sequence[int]) -> SegmentTable:
        """Segments copying this side's ``src_pages`` into ``dst``'s
        ``dst_pages`` (page ``src_pages[i]`` into ``dst_pages[i]``): this rank's
        share of each page, in every buffer."""
        if len(src_pages) != len(dst_pages):
            raise LayoutError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
        plan = _plan(self, dst)
        if not plan.groups or not len(src_pages):
            return SegmentTable(())
        src = np.asarray(src_pages, dtype=np.int64)
        dpg = np.asarray(dst_pages, dtype=np.int64)
        _check_pages(src, self.num_pages, "source")
        _check_pages(dpg, dst.num_pages, "destination")
        return SegmentTable(_lower(plan, src, dpg))

    def writes_extras_to(self, dst: KVLayout) -> bool:
        """Whether this (prefill) side writes ``dst``'s per-room extras: one
        rank per decode rank does, ``dst.tp_rank % tp_size``."""
        return bool(self.extras) and dst.tp_rank % self.tp_size == self.tp_rank

    def extra_segments(self, dst: KVLayout, src_slot: int, dst_slot: int) -> SegmentTable:
        """Segments copying this side's extras slot ``src_slot`` into ``dst``'s
        ``dst_slot`` (empty if another prefill rank writes ``dst``'s extras)."""
        if len(self.extras) != len(dst.extras):
            raise LayoutError(f"{len(self.extras)} extras buffers here, {len(dst.extras)} at the destination")
        if not self.writes_extras_to(dst):
            return SegmentTable(())
        if not 0 <= src_slot < self.num_slots or not 0 <= dst_slot < dst.num_slots:
            raise LayoutError(
                f"extras slot {src_slot} -> {dst_slot} outside {self.num_slots} -> {dst.num_slots} slots"
            )
        src_starts, dst_starts = self.buffer_starts(), dst.buffer_starts()
        rows = []
        for i, (s, d) in enumerate(zip(self.extras, dst.extras, strict=True)):
            if s.slot_bytes != d.slot_bytes:
                raise LayoutError(f"extras[{i}]: slots of {s.slot_bytes} bytes here, {d.slot_bytes} there")
            rows.append(
                (
                    src_starts[s.buffer] + s.offset + src_slot * s.stride,
                    dst_starts[d.buffer] + d.offset + dst_slot * d.stride,
                    s.slot_bytes,
                )
            )
        return SegmentTable(rows)


def checked_buffers(objs: Sequence[object], layout: KVLayout) -> tuple[Buffer, ...]:
    """``objs`` as buffers (:func:`kvconn.buffers.buffers_of`), refused unless
    they are the buffers ``layout`` describes, size for size."""
    buffers = buffers_of(objs)
    sizes = tuple(b.nbytes for b in buffers)
    if sizes != layout.buffer_nbytes:
        raise LayoutError(f"buffers of {sizes} bytes for a layout of {layout.buffer_nbytes}")
    return buffers


def _check_pages(pages: npt.NDArray[np.int64], num_pages: int, side: str) -> None:
    if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise LayoutError(f"{side} pages outside 0..{num_pages - 1}")


@attrs.frozen(slots=True)
class _Group:
    """Buffers whose page pattern has the same number of rows ``k``: arrays
    of shape (buffers,) for bases and strides, (buffers, k) for the pattern."""

    src_base: npt.NDArray[np.int64]
    dst_base: npt.NDArray[np.int64]
    src_stride: npt.NDArray[np.int64]
    dst_stride: npt.NDArray[np.int64]
    src_off: npt.NDArray[np.int64]
    dst_off: npt.NDArray[np.int64]
    lens: npt.NDArray[np.int64]
    #: One row a page (k = 1): the (source, destination) page steps that
    #: would make a buffer's row of one page continue the previous page's,
    #: ``step x stride == bytes`` on both sides (empty: rows never merge).
    merge_steps: tuple[tuple[int, int], ...]


def _merge_steps(
    lens: npt.NDArray[np.int64], src_stride: npt.NDArray[np.int64], dst_stride: npt.NDArray[np.int64]
) -> tuple[tuple[int, int], ...]:
    steps = set()
    for n, ss, ds in zip(lens.tolist(), src_stride.tolist(), dst_stride.tolist(), strict=True):
        if n % ss == 0 and n % ds == 0:
            steps.add((n // ss, n // ds))
    return tuple(sorted(steps))


@attrs.frozen(slots=True)
class _Plan:
    groups: tuple[_Group, ...]


@functools.lru_cache(maxsize=256)
def _plan(src: KVLayout, dst: KVLayout) -> _Plan:
    """What a page of ``src`` sends to a page of ``dst``, per buffer: computed
    once per pair of layouts."""
    if len(src.buffers) != len(dst.buffers):
        raise LayoutError(f"{len(src.buffers)} paged buffers here, {len(dst.buffers)} at the destination")
    if src.replicated != dst.replicated:
        raise LayoutError("one side replicates pages (MLA) and the other does not")
    src_starts, dst_starts = src.buffer_starts(), dst.buffer_starts()
    by_rows: dict[int, list[tuple[int, int, int, int, npt.NDArray[np.int64]]]] = {}
    for i, (s, d) in enumerate(zip(src.buffers, dst.buffers, strict=True)):
        pattern = _page_pattern(i, s, d, src, dst)
        if not len(pattern):
            continue
        src_base = src_starts[i if s.buffer < 0 else s.buffer] + s.offset
        dst_base = dst_starts[i if d.buffer < 0 else d.buffer] + d.offset
        by_rows.setdefault(len(pattern), []).append((src_base, dst_base, s.stride, d.stride, pattern))
    groups = []
    for parts in by_rows.values():
        patterns = np.stack([p[4] for p in parts])  # (buffers, k, 3)
        src_stride = np.array([p[2] for p in parts], dtype=np.int64)
        dst_stride = np.array([p[3] for p in parts], dtype=np.int64)
        lens = np.ascontiguousarray(patterns[:, :, 2])
        groups.append(
            _Group(
                np.array([p[0] for p in parts], dtype=np.int64),
                np.array([p[1] for p in parts], dtype=np.int64),
                src_stride,
                dst_stride,
                np.ascontiguousarray(patterns[:, :, 0]),
                np.ascontiguousarray(patterns[:, :, 1]),
                lens,
                _merge_steps(lens[:, 0], src_stride, dst_stride) if lens.shape[1] == 1 else (),
            )
        )
    return _Plan(tuple(groups))


def _page_pattern(
    i: int, s: PagedBuffer, d: PagedBuffer, src: KVLayout, dst: KVLayout
) -> npt.NDArray[np.int64]:
    """Rows (offset in the source page, offset in the destination page,
    bytes) of what source rank ``src.tp_rank`` writes into a page of decode
    rank ``dst.tp_rank`` in buffer ``i``, merged where contiguous."""
    empty = np.empty((0, 3), dtype=np.int64)
    if src.replicated or (not s.tokens and not d.tokens):
        if s.page_bytes != d.page_bytes:
            raise LayoutError(f"buffers[{i}]: pages of {s.page_bytes} bytes here, {d.page_bytes} there")
        if src.replicated:
            writer = dst.tp_rank % src.tp_size
        elif src.tp_size == dst.tp_size:
            writer = dst.tp_rank
        else:
            raise LayoutError(
                f"buffers[{i}]: tp {src.tp_size} -> {dst.tp_size} needs tokens and heads to slice pages by head"
            )
        if writer != src.tp_rank:
            return empty
        return np.array([[0, 0, s.page_bytes]], dtype=np.int64)
    if not (s.tokens and d.tokens):
        raise LayoutError(f"buffers[{i}]: sliced by heads on one side only")
    if s.tokens != d.tokens or s.head_bytes != d.head_bytes:
        raise LayoutError(
            f"buffers[{i}]: {s.tokens} tokens x {s.head_bytes} bytes per head here, "
            f"{d.tokens} x {d.head_bytes} there"
        )
    if s.heads * src.tp_size != d.heads * dst.tp_size:
        raise LayoutError(
            f"buffers[{i}]: {s.heads} heads x tp {src.tp_size} here, {d.heads} heads x tp {dst.tp_size} there"
        )
    s0, d0 = src.tp_rank * s.heads, dst.tp_rank * d.heads
    low, high = max(s0, d0), min(s0 + s.heads, d0 + d.heads)
    if low >= high:
        return empty
    heads = np.arange(low, high, dtype=np.int64)
    tokens = np.arange(s.tokens, dtype=np.int64)
    hb = s.head_bytes
    # One row per (token, head) of the shared heads, then merged: HND on
    # both sides folds into one row, NHD into one per token (or one, if the
    # pair shares every head of both pages).
    t, h = (a.ravel() for a in np.meshgrid(tokens, heads, indexing="ij"))
    src_off = _unit_offsets(s, t, h - s0)
    dst_off = _unit_offsets(d, t, h - d0)
    order = np.argsort(src_off, kind="stable")
    return _merge(src_off[order], dst_off[order], np.full(len(order), hb, dtype=np.int64))


def _unit_offsets(
    part: PagedBuffer, token: npt.NDArray[np.int64], head: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    hb = part.head_bytes
    if part.order == "HND":
        return (head * part.tokens + token) * hb
    return (token * part.heads + head) * hb


def _merge(
    src: npt.NDArray[np.int64],
    dst: npt.NDArray[np.int64],
    lens: npt.NDArray[np.int64],
    breaks: npt.NDArray[np.int64] | None = None,
) -> npt.NDArray[np.int64]:
    """Rows (src, dst, bytes) with every row that continues the previous one
    on both sides folded into it; a row at an index in ``breaks`` always
    starts anew."""
    n = len(src)
    if not n:
        return np.empty((0, 3), dtype=np.int64)
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    ends_src = src[:-1] + lens[:-1]
    np.not_equal(src[1:], ends_src, out=starts[1:])
    starts[1:] |= dst[1:] != dst[:-1] + lens[:-1]
    if breaks is not None:
        starts[breaks] = True
    first = np.flatnonzero(starts)
    rows = np.empty((len(first), 3), dtype=np.int64)
    rows[:, 0] = src[first]
    rows[:, 1] = dst[first]
    rows[:, 2] = np.add.reduceat(lens, first)
    return rows


def _lower(
    plan: _Plan, src_pages: npt.NDArray[np.int64], dst_pages: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Every group's rows, buffer by buffer, page by page, pattern row by row;
    merged, never across two buffers."""
    out = []
    n = len(src_pages)
    for g in plan.groups:
        buffers, k = g.src_off.shape
        if k == 1 and not _any_step(g.merge_steps, src_pages, dst_pages):
            out.append(_rows_unmerged(g, src_pages, dst_pages))
            continue
        # (buffers, pages, k): base + page * stride + offset in the page
        src = (
            g.src_base[:, None, None]
            + src_pages[None, :, None] * g.src_stride[:, None, None]
            + g.src_off[:, None, :]
        )
        dst = (
            g.dst_base[:, None, None]
            + dst_pages[None, :, None] * g.dst_stride[:, None, None]
            + g.dst_off[:, None, :]
        )
        lens = np.broadcast_to(g.lens[:, None, :], (buffers, n, k))
        out.append(_merge(src.ravel(), dst.ravel(), lens.ravel(), np.arange(0, buffers * n * k, n * k)))
    return out[0] if len(out) == 1 else np.concatenate(out)


def _any_step(
    steps: tuple[tuple[int, int], ...], src_pages: npt.NDArray[np.int64], dst_pages: npt.NDArray[np.int64]
) -> bool:
    """Whether two consecutive pages step by one of ``steps`` on both sides
    (so some buffer's rows of the two merge)."""
    if len(src_pages) < 2 or not steps:
        return False
    ds, dd = np.diff(src_pages), np.diff(dst_pages)
    return any(bool(((ds == a) & (dd == b)).any()) for a, b in steps)


def _rows_unmerged(
    g: _Group, src_pages: npt.NDArray[np.int64], dst_pages: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """A one-row-a-page group's rows, buffer by buffer, page by page, when
    none merge (scattered pages: the common case): what ``_merge`` would
    return, written in place without its passes."""
    rows = np.empty((len(g.src_base), len(src_pages), 3), dtype=np.int64)
    np.multiply(g.src_stride[:, None], src_pages[None, :], out=rows[:, :, 0])
    rows[:, :, 0] += (g.src_base + g.src_off[:, 0])[:, None]
    np.multiply(g.dst_stride[:, None], dst_pages[None, :], out=rows[:, :, 1])
    rows[:, :, 1] += (g.dst_base + g.dst_off[:, 0])[:, None]
    rows[:, :, 2] = g.lens[:, 0][:, None]
    return rows.reshape(-1, 3)
