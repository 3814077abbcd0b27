"""A transport's writer and region driven in this process, without a rank:
the hooks called as the runtime calls them, for a plugin's own unit tests."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pluggy

from kvconn import hookspecs
from kvconn.chunk import Chunk, SegmentTable
from kvconn.testing.kvpattern import EngineShape, dirty_bytes, fill_page, page_matches
from kvconn.testing.patterns import CANARY
from kvconn.transport import Backend, Settlement, register_region, register_writer


def hooks_of(writer: Any) -> pluggy.PluginManager:
    """A plugin manager with only ``writer`` registered, as a rank has."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(writer)
    return pm


def send_chunk(writer: Any, segments: SegmentTable, peer: str, deadline_s: float = 20.0) -> Settlement:
    """Post one last chunk of room 1 to ``peer`` and wait at its done barrier."""
    pm = hooks_of(writer)
    chunk = Chunk(1, 0, True, 0, peer, (), ())
    posted = pm.hook.on_post(chunk=chunk, segments=segments)
    settlement = pm.hook.on_done_barrier(chunk=chunk, posted=posted, deadline=time.monotonic() + deadline_s)
    if not isinstance(settlement, Settlement):
        raise TypeError(f"on_done_barrier answered {settlement!r}, not a Settlement")
    return settlement


def tp_round_trip(
    backend: Backend,
    shape: EngineShape,
    prefill_tp: int,
    decode_tp: int,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    deadline_s: float = 20.0,
) -> list[str]:
    """Every prefill TP rank writes its heads of ``src_pages`` from its own
    engine buffers into every decode TP rank's ``dst_pages``, through
    ``backend``'s engine-memory registration. Returns what went wrong (empty
    when every page is byte-exact and no other page was touched)."""
    room = 9
    problems: list[str] = []
    decodes = []
    for d in range(decode_tp):
        arrays = shape.buffers(decode_tp, fill=CANARY)
        decodes.append((arrays, shape.layout(decode_tp, d), register_region(backend, arrays, {})))
    try:
        for r in range(prefill_tp):
            src = shape.buffers(prefill_tp)
            src_layout = shape.layout(prefill_tp, r)
            for i, page in enumerate(src_pages):
                fill_page(shape, src_layout, src, room, i, page)
            writer = register_writer(backend, src, {})
            try:
                for d, (_, dst_layout, region) in enumerate(decodes):
                    writer.connect(f"decode-{d}", region.metadata)
                    table = src_layout.segments(dst_layout, src_pages, dst_pages)
                    settlement = send_chunk(writer, table, f"decode-{d}", deadline_s)
                    if settlement is not Settlement.LANDED:
                        problems.append(f"rank {r} -> decode {d}: {settlement.name}")
            finally:
                writer.close()
        others = sorted(set(range(shape.pages)) - set(dst_pages))
        for d, (arrays, layout, _) in enumerate(decodes):
            problems += [
                f"decode {d}: page {page} wrong"
                for i, page in enumerate(dst_pages)
                if not page_matches(shape, layout, arrays, room, i, page)
            ]
            if dirty_bytes(layout, arrays, others):
                problems.append(f"decode {d}: a page outside the room was written")
    finally:
        for arrays, _, region in decodes:
            region.close()
            arrays[0][0] = 1  # still the engine's memory, writable after deregistration
    return problems
