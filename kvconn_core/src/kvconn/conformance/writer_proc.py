"""A bare writer process: the plugin's transport driven through its hooks
directly (a pluggy PluginManager, no kvconn runtime), so the suite can check
what the transport itself promises.

``mode`` ``barrier``: for every round read a line from stdin, fill the
source, ``on_post`` then ``on_done_barrier``, and report the settlement at
once: the parent reads the destination right then (LANDED means landed).

``mode`` ``fence``: post one round, SIGSTOP itself (a frozen writer), and
once resumed (past its deadline) wait at the barrier and call ``on_fence``;
report, then the parent checks that nothing more lands.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pluggy

from kvconn import hookspecs
from kvconn.chunk import Chunk, Segment
from kvconn.conformance.rank_proc import emit, stop_self
from kvconn.plugins import get_backend
from kvconn.testing.patterns import shard_bytes
from kvconn.transport import Settlement

PEER = "conformance-owner"


def fill(writer: Any, round_no: int, segments: list[Segment]) -> None:
    for j, seg in enumerate(segments):
        writer.write(seg.src, shard_bytes(round_no, 0, j, seg.nbytes))


def main() -> None:
    args = json.loads(sys.argv[1])
    backend = get_backend(args["backend"])
    writer = backend.open_writer(int(args["src_bytes"]), dict(args.get("options", {})))
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(writer, name="transport")
    writer.connect(PEER, bytes.fromhex(args["metadata"]))
    timeout = float(args["write_timeout_s"])
    rounds = [[Segment(*s) for s in r] for r in args["rounds"]]
    emit({"event": "ready", "pid": os.getpid()})
    try:
        for i, segments in enumerate(rounds, start=1):
            if args["mode"] == "barrier" and not sys.stdin.readline():
                return
            fill(writer, i, segments)
            chunk = Chunk(i, 0, True, 0, PEER, (), ())
            posted = pm.hook.on_post(chunk=chunk, segments=segments)
            deadline = time.monotonic() + timeout
            if args["mode"] == "fence":
                emit({"event": "posted", "round": i})
                stop_self()
            settlement = pm.hook.on_done_barrier(chunk=chunk, posted=posted, deadline=deadline)
            value = settlement.value if isinstance(settlement, Settlement) else repr(settlement)
            event: dict[str, Any] = {"event": "settled", "round": i, "settlement": value}
            if args["mode"] == "fence":
                event["fenced"] = pm.hook.on_fence()
            emit(event)
        sys.stdin.read()
    finally:
        writer.close()


if __name__ == "__main__":
    main()
