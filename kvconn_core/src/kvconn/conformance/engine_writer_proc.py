"""A bare writer process over engine-owned buffers: the plugin's transport
registers a prefill rank's per-layer numpy buffers and writes one room into
one or more decode regions through :class:`~kvconn.layout.KVLayout`
segments, its hooks driven directly (no kvconn runtime).

Arguments (JSON): ``backend``, ``options``, ``shape`` (an
:class:`~kvconn.testing.kvpattern.EngineShape`), ``tp`` and ``rank`` (this
writer's), ``room``, ``src_pages``, ``dst_pages``, ``write_timeout_s`` and
``decodes``: per decode region ``{"peer", "metadata" (hex), "layout" (hex)}``.
Reports ``ready``, then per decode ``settled`` with the settlement and the
segment count, then waits for stdin to close.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pluggy

from kvconn import hookspecs
from kvconn.chunk import Chunk
from kvconn.layout import KVLayout
from kvconn.plugins import get_backend
from kvconn.testing.child import emit
from kvconn.testing.kvpattern import EngineShape, fill_page
from kvconn.transport import Settlement, register_writer


def main() -> None:
    args = json.loads(sys.argv[1])
    shape = EngineShape.from_args(args["shape"])
    tp, rank, room = int(args["tp"]), int(args["rank"]), int(args["room"])
    layout = shape.layout(tp, rank)
    arrays = shape.buffers(tp)
    src_pages, dst_pages = list(args["src_pages"]), list(args["dst_pages"])
    for index, page in enumerate(src_pages):
        fill_page(shape, layout, arrays, room, index, page)
    writer = register_writer(get_backend(args["backend"]), arrays, dict(args.get("options", {})))
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(writer, name="transport")
    try:
        for decode in args["decodes"]:
            writer.connect(decode["peer"], bytes.fromhex(decode["metadata"]))
        emit({"event": "ready", "pid": os.getpid()})
        for decode in args["decodes"]:
            dst_layout = KVLayout.from_bytes(bytes.fromhex(decode["layout"]))
            segments = layout.segments(dst_layout, src_pages, dst_pages)
            chunk = Chunk(room, 0, True, rank, decode["peer"], tuple(src_pages), tuple(dst_pages))
            deadline = time.monotonic() + float(args["write_timeout_s"])
            posted = pm.hook.on_post(chunk=chunk, segments=segments)
            settlement = pm.hook.on_done_barrier(chunk=chunk, posted=posted, deadline=deadline)
            value = settlement.value if isinstance(settlement, Settlement) else repr(settlement)
            event: dict[str, Any] = {
                "event": "settled",
                "peer": decode["peer"],
                "settlement": value,
                "segments": len(segments),
            }
            emit(event)
        sys.stdin.read()
    finally:
        writer.close()


if __name__ == "__main__":
    main()
