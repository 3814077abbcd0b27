"""NIXL over engine-owned buffers: numpy arrays per layer on both sides,
registered as descriptor lists, written through KVLayout segments (TP 2 -> 1
and 1 -> 2), byte for byte; close() frees nothing of the engine's."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvconn.testing.libraries import require_library

require_library("nixl", module_level=True)  # by the library: the plugin installs without it

import numpy as np  # noqa: E402
import pluggy  # noqa: E402

from kvconn import hookspecs  # noqa: E402
from kvconn.chunk import Chunk, SegmentTable  # noqa: E402
from kvconn.testing.kvpattern import EngineShape, fill_page, page_matches  # noqa: E402
from kvconn.transport import Settlement, register_region, register_writer  # noqa: E402
from kvconn_nixl import backend  # noqa: E402
from kvconn_nixl.raw import RawWriter  # noqa: E402

SHAPE = EngineShape(layers=4, pages=32, tokens=16, heads=4, head_bytes=64, order="NHD")


def _send(writer: Any, segments: SegmentTable, peer: str = "decode") -> Settlement:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(writer)
    c = Chunk(1, 0, True, 0, peer, (), ())
    posted = pm.hook.on_post(chunk=c, segments=segments)
    settlement = pm.hook.on_done_barrier(chunk=c, posted=posted, deadline=time.monotonic() + 20)
    assert isinstance(settlement, Settlement)
    return settlement


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_heads_of_every_layer_land_in_the_engines_decode_arrays(prefill_tp: int, decode_tp: int) -> None:
    src_pages, dst_pages = [0, 1, 2, 7, 8, 30], [5, 6, 7, 20, 3, 4]
    decodes = []
    for d in range(decode_tp):
        arrays = SHAPE.buffers(decode_tp, fill=0xA5)
        decodes.append((arrays, SHAPE.layout(decode_tp, d), register_region(backend, arrays, {})))
    try:
        for r in range(prefill_tp):
            src = SHAPE.buffers(prefill_tp)
            src_layout = SHAPE.layout(prefill_tp, r)
            for i, page in enumerate(src_pages):
                fill_page(SHAPE, src_layout, src, 9, i, page)
            writer = register_writer(backend, src, {})
            try:
                for d, (_, dst_layout, region) in enumerate(decodes):
                    writer.connect(f"decode-{d}", region.metadata)
                    table = src_layout.segments(dst_layout, src_pages, dst_pages)
                    assert _send(writer, table, f"decode-{d}") is Settlement.LANDED
            finally:
                writer.close()
        for arrays, layout, _ in decodes:
            for i, page in enumerate(dst_pages):
                assert page_matches(SHAPE, layout, arrays, 9, i, page), f"page {page} wrong"
            other = sorted(set(range(SHAPE.pages)) - set(dst_pages))
            page_bytes = layout.buffers[0].page_bytes
            assert all((a.reshape(-1, page_bytes)[other] == 0xA5).all() for a in arrays)
    finally:
        for arrays, _, region in decodes:
            region.close()
            arrays[0][0] = 1  # still the engine's memory, writable after deregistration


def test_raw_nixl_writes_the_same_bytes_from_engine_buffers() -> None:
    dst = [np.zeros(1 << 16, np.uint8) for _ in range(3)]
    src = [np.full(1 << 16, 0x11 * (i + 1), np.uint8) for i in range(3)]
    region = register_region(backend, dst, {})
    raw = RawWriter(src, {})
    try:
        raw.connect("decode", region.metadata)
        rows = np.array([(0, 2 << 16, 100), ((1 << 16) + 5, 10, 1 << 12), (2 << 16, 1 << 16, 1 << 16)])
        assert raw.transfer("decode", rows) == 100 + (1 << 12) + (1 << 16)
        assert (dst[2][:100] == 0x11).all() and (dst[0][10 : 10 + (1 << 12)] == 0x22).all()
        assert (dst[1] == 0x33).all() and not dst[0][:10].any()
        with pytest.raises(ValueError, match="across two"):
            raw.transfer("decode", np.array([((1 << 16) - 4, 0, 8)]))
    finally:
        raw.close()
        region.close()
