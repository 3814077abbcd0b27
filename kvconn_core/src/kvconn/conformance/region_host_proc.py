"""The process that holds the plugin's page regions for the suite, so that
a stray write of a transport (or its region code) crashing a process
crashes this one, never the one that reports the verdict.

Driven by JSON lines on stdin (``kvconn.conformance.region_host``), one
answer line each on stdout; bytes go through the scratch buffer the parent
created (a memfd it inherits: ``scratch_fd``), never through the pipe::

    {"op": "open", "id": I, "nbytes": n, "options": {...}}  -> {"metadata": hex}
    {"op": "read", "id": I, "offset": o, "nbytes": n}      -> {} (bytes in the scratch)
    {"op": "write", "id": I, "offset": o, "nbytes": n}     -> {} (bytes from the scratch)
    {"op": "owner_fence", "id": I}                         -> {"metadata": hex}
    {"op": "close", "id": I}                               -> {}
    {"op": "register", "id": I, "shape": {...}, "tp": T, "rank": R, "options": {...}}
        -> {"metadata": hex}  (engine buffers, canary everywhere, registered)
    {"op": "engine_diff", "id": I, "room": R, "pages": [...]} -> {"diff": "" or what differs}
    {"op": "memory_kind", "id": I}                         -> {"kind": CUDA's word, or null}
    {"op": "changed_pages", "id": I, "pages": [...], "page_bytes": n, "value": v}
        -> {"pages": those not all v} (compared here: no bytes cross the scratch)
    {"op": "wrong_pattern_pages", "id": I, "room": R, "pages": [...], "page_bytes": n,
     "num_ranks": N, "ranks": [...]}                      -> {"pages": those not holding R's pattern}

An answer with ``error`` carries the exception the region raised.
"""

from __future__ import annotations

import json
import mmap
import sys
from typing import Any

from kvconn.conformance.host_side import EngineRegion, memory_kind
from kvconn.plugins import get_backend
from kvconn.testing.child import load_args
from kvconn.testing.kvpattern import EngineShape
from kvconn.testing.pages import changed_pages, wrong_pattern_pages
from kvconn.transport import owner_fence


def main() -> None:
    args = load_args(sys.argv[1])
    backend = get_backend(args["backend"])
    regions: dict[int, Any] = {}
    scratch = mmap.mmap(int(args["scratch_fd"]), int(args["scratch_bytes"]))
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        answer: dict[str, Any] = {}
        try:
            if op == "open":
                region = backend.open_region(int(cmd["nbytes"]), dict(cmd["options"]))
                regions[int(cmd["id"])] = region
                answer["metadata"] = region.metadata.hex()
            elif op == "read":
                n = int(cmd["nbytes"])
                scratch[:n] = regions[int(cmd["id"])].read(int(cmd["offset"]), n)
            elif op == "write":
                n = int(cmd["nbytes"])
                regions[int(cmd["id"])].write(int(cmd["offset"]), scratch[:n])
            elif op == "owner_fence":
                answer["metadata"] = owner_fence(regions[int(cmd["id"])]).hex()
            elif op == "close":
                regions.pop(int(cmd["id"])).close()
            elif op == "register":
                shape = EngineShape.from_args(cmd["shape"])
                engine = EngineRegion.open(backend, shape, int(cmd["tp"]), int(cmd["rank"]), cmd["options"])
                regions[int(cmd["id"])] = engine
                answer["metadata"] = engine.metadata.hex()
            elif op == "engine_diff":
                answer["diff"] = regions[int(cmd["id"])].diff(int(cmd["room"]), list(cmd["pages"]))
            elif op == "changed_pages":
                answer["pages"] = changed_pages(
                    regions[int(cmd["id"])], list(cmd["pages"]), int(cmd["page_bytes"]), int(cmd["value"])
                )
            elif op == "wrong_pattern_pages":
                answer["pages"] = wrong_pattern_pages(
                    regions[int(cmd["id"])],
                    int(cmd["room"]),
                    list(cmd["pages"]),
                    int(cmd["page_bytes"]),
                    int(cmd["num_ranks"]),
                    list(cmd["ranks"]),
                )
            elif op == "memory_kind":
                answer["kind"] = memory_kind(regions[int(cmd["id"])])
        except Exception as exc:
            answer["error"] = f"{type(exc).__name__}: {exc}"
        out.write(json.dumps(answer) + "\n")
        out.flush()
    for region in regions.values():
        region.close()
    scratch.close()


if __name__ == "__main__":
    main()
