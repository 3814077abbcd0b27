"""A bare writer process: the plugin's transport driven through its hooks
directly (a pluggy PluginManager, no kvconn runtime), so the suite can check
what the transport itself promises.

The JSON argument names the peers (``{name: metadata hex}``) and the rounds;
a round is ``{"peer": NAME, "segments": [[src, dst, nbytes], ...], "steps":
[...]}`` (and ``"room"``: its chunk's room id, else the round's number; a
room id is unique per decode only), each step one of:

``wait``     read a line from stdin (the parent says go);
``connect``  read a line, the peer's new metadata (hex): a decode restart;
``fill``     fill the source with the round's pattern (else ``post`` does);
``fill_all`` fill the source with the pattern of every round that has no
             ``fill`` step of its own, each in its own rows (so that later
             rounds post back to back, nothing between them); those rows
             must not overlap, or a later round's pattern would stand in an
             earlier one's rows;
``post``     fill the source with the round's pattern and ``on_post``;
``abort``    ``on_abort_notification`` for the round's room, from its peer (a cancel);
``barrier``  ``on_done_barrier`` (deadline fixed before ``post``);
``fence``    ``on_fence``;
``freeze``   SIGSTOP this whole process, right after the step before.

A ``post`` whose ``on_post`` raised reports the error, and the round's
``barrier`` then answers :data:`POST_RAISED` without calling the hook (a
writer whose peer was fenced as owner may raise: the runtime would poison
the room, and nothing of it may land).

``freeze`` is the suite's gate on the transport's in-flight bytes: the
process stops within microseconds of the hook's answer, every thread with
it (a copy thread, a progress thread), so the parent checks the destination
against that answer at leisure and lays fresh canaries before it resumes
the writer. Every step reports one JSON line (``rank_proc.emit``).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from typing import Any

import pluggy

from kvconn import hookspecs
from kvconn.chunk import Chunk, SegmentTable
from kvconn.plugins import get_backend
from kvconn.protocol.messages import Abort
from kvconn.testing.child import emit, load_args, stop_self
from kvconn.testing.patterns import shard_bytes
from kvconn.transport import Settlement

#: A barrier's answer after its round's ``on_post`` raised.
POST_RAISED = "post_raised"


def fill(writer: Any, round_no: int, rows: list[list[int]]) -> None:
    for j, (src, _, nbytes) in enumerate(rows):
        writer.write(src, shard_bytes(round_no, 0, j, nbytes))


def main() -> None:
    args = load_args(sys.argv[1])
    backend = get_backend(args["backend"])
    writer = backend.open_writer(int(args["src_bytes"]), dict(args.get("options", {})))
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(writer, name="transport")
    try:
        for peer, metadata in args["peers"].items():
            writer.connect(peer, bytes.fromhex(metadata))
    except Exception as exc:
        emit({"event": "connect_failed", "error": f"{type(exc).__name__}: {exc}"})
        raise
    timeout = float(args["write_timeout_s"])
    prefilled: set[int] = set()
    emit({"event": "ready", "pid": os.getpid()})
    try:
        for i, spec in enumerate(args["rounds"], start=1):
            rows = spec["segments"]
            chunk = Chunk(int(spec.get("room", i)), 0, True, 0, spec.get("peer", "a"), (), ())
            posted: object = None
            deadline = 0.0
            filled = False
            post_failed = ""
            for step in spec["steps"]:
                event: dict[str, Any] = {"event": step, "round": i}
                if step == "wait" and not sys.stdin.readline():
                    return
                if step == "connect":
                    writer.connect(chunk.peer, bytes.fromhex(sys.stdin.readline().strip()))
                elif step == "fill":
                    fill(writer, i, rows)
                    filled = True
                elif step == "fill_all":
                    batch = [
                        (j, other["segments"])
                        for j, other in enumerate(args["rounds"], start=1)
                        if "fill" not in other["steps"]
                    ]
                    _disjoint_sources(batch)
                    for j, segments in batch:
                        fill(writer, j, segments)
                        prefilled.add(j)
                elif step == "post":
                    if not filled and i not in prefilled:
                        fill(writer, i, rows)
                    deadline = time.monotonic() + timeout
                    try:
                        posted = pm.hook.on_post(chunk=chunk, segments=SegmentTable(rows))
                    except Exception as exc:  # the runtime poisons the room; the suite reads the answer
                        event["error"] = f"{type(exc).__name__}: {exc}"
                        post_failed = event["error"]
                elif step == "abort":
                    abort = Abort(chunk.room, 1, chunk.peer, "conformance")
                    pm.hook.on_abort_notification(abort=abort, known=True)
                elif step == "barrier" and post_failed:
                    event["settlement"] = POST_RAISED
                    event["error"] = post_failed
                elif step == "barrier":
                    settlement = pm.hook.on_done_barrier(chunk=chunk, posted=posted, deadline=deadline)
                    value = settlement.value if isinstance(settlement, Settlement) else repr(settlement)
                    event["settlement"] = value
                elif step == "fence":
                    event["fenced"] = pm.hook.on_fence()
                elif step == "freeze":
                    emit(event)
                    stop_self()
                    continue
                emit(event)
        sys.stdin.read()
    finally:
        writer.close()


def _disjoint_sources(rounds: list[tuple[int, list[list[int]]]]) -> None:
    """Raise if two of ``rounds`` fill the same source bytes: the later
    pattern would be posted for the earlier round (and its bytes, landed,
    would count as still in flight)."""
    spans = sorted((src, src + nbytes, j) for j, rows in rounds for src, _dst, nbytes in rows)
    for (_, end, j), (start, _, k) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"fill_all: rounds {j} and {k} share source rows")


if __name__ == "__main__":
    main()
