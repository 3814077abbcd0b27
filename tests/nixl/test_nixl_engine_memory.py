"""NIXL over engine-owned buffers: numpy arrays per layer on both sides,
registered as descriptor lists, written through KVLayout segments (TP 2 -> 1
and 1 -> 2), byte for byte; close() frees nothing of the engine's."""

from __future__ import annotations

import pytest

from kvconn.testing.libraries import require_library

require_library("nixl", module_level=True)  # by the library: the plugin installs without it

import numpy as np  # noqa: E402

from kvconn.testing.inprocess import tp_round_trip  # noqa: E402
from kvconn.testing.kvpattern import EngineShape  # noqa: E402
from kvconn.transport import register_region  # noqa: E402
from kvconn_nixl import backend  # noqa: E402
from kvconn_nixl.raw import RawWriter  # noqa: E402

SHAPE = EngineShape(layers=4, pages=32, tokens=16, heads=4, head_bytes=64, order="NHD")


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_heads_of_every_layer_land_in_the_engines_decode_arrays(prefill_tp: int, decode_tp: int) -> None:
    src_pages, dst_pages = [0, 1, 2, 7, 8, 30], [5, 6, 7, 20, 3, 4]
    assert tp_round_trip(backend, SHAPE, prefill_tp, decode_tp, src_pages, dst_pages, deadline_s=20) == []


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
