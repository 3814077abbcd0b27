"""A decode endpoint in a process of its own, for faults across hosts
(:mod:`kvconn.testing.host_faults`): the process can be killed with its
host and started again, while the parent cuts links and freezes hosts.

Its pages are :class:`~kvconn.testing.pages.CanaryPages`: every page not in
use holds the canary, so a late write into a page handed back is found.
Driven by JSON lines on stdin, it reports JSON lines on stdout (``emit``,
stamped with the host's shared monotonic clock). Started with ``"prefill":
null`` it imports the transport's library at once (what takes a start its
seconds) and waits for the ranks' addresses::

    {"op": "bootstrap", "prefill": [addresses]}  -> {"event": "ready"} (once bootstrapped)
    {"op": "open", "room": R, "pages": N, "ranks": [r]} -> {"event": "opened", "pages": [...]}
    {"op": "abort", "room": R}                  -> {"event": "aborted"}
    {"op": "landed", "room": R}                 -> {"event": "landed", "bytes": B}
    {"op": "fetch", "room": R, "pages": N}     -> {"event": "fetched", "state": "success", "wrong": W}
                                                  (state "failed", or "refused" with "why")
    {"op": "late"}                              -> {"event": "late", "pages": [...], "held": H}
    {"op": "stream", "rank": r, "pages": N}     (starts a stream of rooms on rank r)
    {"op": "stream_stop"}                       -> {"event": "streamed", "done": D, "failed": F, "wrong": W}
    (on every release)                          -> {"event": "released", "room": R, "proof": ...}
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

from kvconn.config import Config
from kvconn.errors import KvconnError
from kvconn.plugins import get_backend
from kvconn.protocol.hold import Release
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.testing.child import emit, load_args
from kvconn.testing.libraries import LIBRARIES, why_unavailable
from kvconn.testing.pages import CanaryPages

#: Room ids of the background stream start here (the faults' own are small).
STREAM_ROOMS = 1 << 40


class _Stream:
    """Rooms on one rank, one after another, each checked byte for byte: the
    other host's requests that a fault must not fail."""

    def __init__(self, endpoint: DecodeEndpoint, pages: CanaryPages, rank: int, npages: int) -> None:
        self.endpoint, self.pages, self.rank, self.npages = endpoint, pages, rank, npages
        self.done = self.failed = self.wrong = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvconn-host-stream")
        self._thread.start()

    def _run(self) -> None:
        room = STREAM_ROOMS + (self.rank << 20)
        while not self._stop.is_set():
            room += 1
            taken, _ = self.pages.take(self.npages, fresh_first=True)
            try:
                rx = self.endpoint.receiver(room, taken, frozenset({self.rank}))
            except Exception:
                self.pages.untake(taken)
                self.failed += 1
                time.sleep(0.05)
                continue
            self._wait(rx, room, taken)

    def _wait(self, rx: Receiver, room: int, taken: list[int]) -> None:
        while True:
            state = rx.poll()
            if state is KVPoll.SUCCESS:
                if self.pages.wrong_pattern(room, taken, [self.rank]):
                    self.wrong += 1
                self.done += 1
                self.pages.give_back(rx.finish())
                return
            if state is KVPoll.FAILED:
                self.failed += 1  # its pages come back by the release callback, on proof
                rx.abort()
                return
            time.sleep(0.002)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(timeout=60)
        return {"done": self.done, "failed": self.failed, "wrong": self.wrong}


def main() -> None:
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    args = load_args(sys.argv[1])
    page_bytes, num_ranks = int(args["page_bytes"]), int(args["num_ranks"])
    holder: list[CanaryPages] = []
    prefill = args["prefill"]
    if prefill is None:  # the ranks start meanwhile: import now, bootstrap once they are up
        if args["backend"] in LIBRARIES:
            why_unavailable(args["backend"])
        prefill = json.loads(sys.stdin.readline())["prefill"]

    def on_release(release: Release) -> None:
        holder[0].give_back(release.pages)  # canary first, then free: checked for late writes
        emit({"event": "released", "room": release.room, "proof": release.proof.value})

    endpoint = DecodeEndpoint(
        get_backend(args["backend"]),
        int(args["num_pages"]),
        page_bytes,
        list(prefill),
        Config(**args["config"]),
        on_release=on_release,
    )
    holder.append(CanaryPages(endpoint.region, int(args["num_pages"]), page_bytes, num_ranks))
    pages = holder[0]
    receivers: dict[int, tuple[Receiver, list[int]]] = {}
    stream: _Stream | None = None
    emit({"event": "ready"})
    for line in sys.stdin:
        cmd: dict[str, Any] = json.loads(line)
        op = cmd["op"]
        if op == "open":
            taken, _ = pages.take(int(cmd["pages"]), fresh_first=True)
            ranks = frozenset(cmd["ranks"]) if cmd.get("ranks") is not None else None
            receivers[cmd["room"]] = (endpoint.receiver(cmd["room"], taken, ranks), taken)
            emit({"event": "opened", "room": cmd["room"], "pages": taken})
        elif op == "abort":
            receivers[cmd["room"]][0].abort()
            emit({"event": "aborted", "room": cmd["room"]})
        elif op == "landed":
            landed = sum(pages.dirty_bytes(p) for p in receivers[cmd["room"]][1])
            emit({"event": "landed", "room": cmd["room"], "bytes": landed})
        elif op == "fetch":  # a whole request: open, wait for it (bounded), check, give back
            taken, _ = pages.take(int(cmd["pages"]), fresh_first=True)
            try:
                rx = endpoint.receiver(cmd["room"], taken)
            except KvconnError as exc:  # refused (a rank down): asked nothing, the pages are ours
                pages.untake(taken)
                emit({"event": "fetched", "room": cmd["room"], "state": "refused", "wrong": 0, "why": str(exc)})
                continue
            deadline = time.monotonic() + float(cmd.get("timeout_s", 30.0))
            while (state := rx.poll()) not in (KVPoll.SUCCESS, KVPoll.FAILED) and time.monotonic() < deadline:
                time.sleep(0.002)
            wrong = len(pages.wrong_pattern(cmd["room"], taken)) if state is KVPoll.SUCCESS else 0
            if state is KVPoll.SUCCESS:
                pages.give_back(rx.finish())
            else:
                rx.abort()
            emit({"event": "fetched", "room": cmd["room"], "state": state.name.lower(), "wrong": wrong})
        elif op == "late":
            # Pages handed back whose canary changed: a write landed after release.
            emit(
                {
                    "event": "late",
                    "pages": pages.changed(pages.returned_pages()),
                    "held": endpoint.held_pages(),
                }
            )
        elif op == "stream":
            stream = _Stream(endpoint, pages, int(cmd["rank"]), int(cmd["pages"]))
        elif op == "stream_stop" and stream is not None:
            emit({"event": "streamed", **stream.stop()})
            stream = None
    endpoint.close()


if __name__ == "__main__":
    main()
