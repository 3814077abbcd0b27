"""Conformance checks for memory the engine owns: regions and writers
registered over per-layer numpy buffers (DRAM), pages spread over many
buffers through :class:`~kvconn.layout.KVLayout`, and heterogeneous tensor
parallelism in both directions (two writers filling one decode page with
their heads; one writer filling two decode regions), plus MLA (one writer
per decode rank).

Each check runs bare writer processes (:mod:`kvconn.conformance.engine_writer_proc`)
that drive the plugin's hooks. Decode's buffers live in the harness's region
host process (:mod:`kvconn.conformance.region_host`), never in the process
that gives the verdict: a write outside them that crashes a process crashes
that one, and the check fails naming the signal and the last operation.
The host then compares every byte of every buffer: a byte that went to
another layer, head, token or page, or a byte written outside the room's
pages, fails the check.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest

from kvconn.conformance import region_host
from kvconn.conformance.harness import Child, ConformanceFailure, Settings, decode_host, prefill_host
from kvconn.conformance.plugin import require_capability
from kvconn.conformance.region_host import RemoteRegion
from kvconn.conformance.stakes import at_stake
from kvconn.conformance.writing import healthy_write_timeout
from kvconn.testing.kvpattern import EngineShape
from kvconn.transport import Settlement

ENGINE_ROOM = 0xE0_0001
#: Pages the checks send: runs that merge and pages scattered out of order.
SRC_PAGES = [0, 1, 2, 3, 9, 5, 30, 31, 12]
DST_PAGES = [4, 5, 6, 7, 20, 1, 2, 3, 28]
SHAPES = {
    # 16 layers x K/V: 32 buffers, 4 KiB pages (16 tokens x 2 heads x 64 bytes on a TP-1 rank)
    "many_buffers": EngineShape(layers=16, pages=32, tokens=16, heads=2, head_bytes=64),
    "hnd": EngineShape(layers=4, pages=32, tokens=16, heads=4, head_bytes=64, order="HND"),
    "nhd": EngineShape(layers=4, pages=32, tokens=16, heads=4, head_bytes=64, order="NHD"),
    "mla": EngineShape(layers=4, pages=32, tokens=16, heads=2, head_bytes=64, replicated=True),
}


@attrs.define
class _Decode:
    peer: str
    layout_hex: str
    region: RemoteRegion


def _engine_transfer(settings: Settings, shape: EngineShape, prefill_tp: int, decode_tp: int) -> None:
    """Every prefill rank of ``prefill_tp`` writes the room into every decode
    rank of ``decode_tp``; then every decode byte is checked."""
    require_capability("dram" in settings.capabilities.memory, "memory kind 'dram' not declared")
    register = getattr(settings.backend, "register_region", None)
    require_capability(register is not None, "register_region / register_writer not implemented")
    decodes: list[_Decode] = []
    children: list[Child] = []
    what = f"engine memory {shape.order}{' mla' if shape.replicated else ''} tp {prefill_tp}->{decode_tp}"
    try:
        for d in range(decode_tp):
            region = region_host.register_region(
                settings.backend_name,
                shape.to_args(),
                decode_tp,
                d,
                settings.options_on(decode_host()),
                decode_host(),
            )
            decodes.append(_Decode(f"decode-{d}", shape.layout(decode_tp, d).to_bytes().hex(), region))
        for r in range(prefill_tp):
            host = prefill_host(r)
            args: dict[str, Any] = {
                "backend": settings.backend_name,
                "options": settings.options_on(host),
                "shape": shape.to_args(),
                "tp": prefill_tp,
                "rank": r,
                "room": ENGINE_ROOM,
                "src_pages": SRC_PAGES,
                "dst_pages": DST_PAGES,
                "write_timeout_s": healthy_write_timeout(settings),
                "decodes": [
                    {"peer": dec.peer, "metadata": dec.region.metadata.hex(), "layout": dec.layout_hex}
                    for dec in decodes
                ],
            }
            children.append(Child("kvconn.conformance.engine_writer_proc", args, host=host))
        for r, child in enumerate(children):
            child.expect(60, f"{what}: writer {r} starts", event="ready")
            for dec in decodes:
                event = child.expect(
                    60 + healthy_write_timeout(settings), f"{what}: writer {r} settles into {dec.peer}", event="settled", peer=dec.peer
                )
                if event["settlement"] != Settlement.LANDED.value:
                    raise ConformanceFailure(
                        f"{what}: a healthy write by rank {r} settled {event['settlement']!r}"
                    )
        for dec in decodes:  # at once: a LANDED that came early is caught before the bytes do come
            found = dec.region.engine_diff(ENGINE_ROOM, DST_PAGES)
            if found:
                raise ConformanceFailure(f"{what}: {dec.peer}: {found}")
        settled = sum(1 for child in children for e in child.history() if e.get("event") == "settled")
        at_stake(
            settled,
            prefill_tp * decode_tp,
            f"{settled} writes LANDED by {prefill_tp} ranks into {decode_tp} decode ranks' "
            f"{shape.num_buffers} buffers, {len(DST_PAGES)} pages each, every byte of every buffer compared",
            "every prefill rank's write into every decode rank",
        )
    finally:
        for child in children:
            child.close()
        for dec in decodes:
            dec.region.close()


@pytest.mark.kvconn_conformance
class EngineMemoryChecks:
    """Mixed into :class:`~kvconn.conformance.ConformanceSuite`."""

    backend_name: ClassVar[str | None] = None

    @pytest.mark.parametrize("layout", ["many_buffers", "hnd"])
    def test_engine_buffers_byte_exact(self, kvconn_settings: Settings, layout: str) -> None:
        """A writer over an engine's per-layer buffers fills decode's per-layer
        buffers: every page, every layer, byte-exact, nothing else touched."""
        _engine_transfer(kvconn_settings, SHAPES[layout], 1, 1)

    @pytest.mark.parametrize("layout", ["hnd", "nhd"])
    def test_engine_tp_fan_in(self, kvconn_settings: Settings, layout: str) -> None:
        """Two prefill ranks (TP 2) each write their heads into the same
        pages of one decode rank (TP 1): contiguous (HND) or strided (NHD)."""
        _engine_transfer(kvconn_settings, SHAPES[layout], 2, 1)

    @pytest.mark.parametrize("layout", ["hnd", "nhd"])
    def test_engine_tp_fan_out(self, kvconn_settings: Settings, layout: str) -> None:
        """One prefill rank (TP 1) writes each of two decode ranks (TP 2) its heads."""
        _engine_transfer(kvconn_settings, SHAPES[layout], 1, 2)

    def test_engine_mla(self, kvconn_settings: Settings) -> None:
        """MLA: of two prefill ranks, one writes whole pages; the other posts nothing."""
        _engine_transfer(kvconn_settings, SHAPES["mla"], 2, 1)
