"""A decode endpoint in its own process, so the suite can freeze the page
owner (SIGSTOP) while writes to it are in flight.

It lays a canary in every page it owns and, like an engine, hands released
pages out again at once: the release callback writes a fresh canary. Driven
by JSON lines on stdin, it reports JSON lines on stdout (``emit``)::

    {"op": "open", "room": R, "pages": [...]}   -> {"event": "opened"}
    {"op": "abort", "room": R}                  -> {"event": "aborted"}
    {"op": "changed", "pages": [...]}           -> {"event": "changed", "pages": [...]}
    {"op": "finish", "room": R, "within": s}     -> {"event": "finished", "state": ..., "bad": [...]}
        (waits until the room succeeded or failed; ``bad``: its pages that
        do not hold what the ranks write for it)
    (on every release)                          -> {"event": "released", "room": R, "proof": ...}
    (the endpoint cannot start)                 -> {"event": "failed", "error": ...}
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.protocol.hold import Release
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.testing.child import emit, load_args
from kvconn.testing.pages import CanaryPages
from kvconn.testing.patterns import canary


def main() -> None:
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    args = load_args(sys.argv[1])
    page_bytes = int(args["page_bytes"])
    fresh = canary(page_bytes)
    endpoint: DecodeEndpoint | None = None

    def on_release(release: Release) -> None:
        assert endpoint is not None
        for page in release.pages:  # handed out again at once
            endpoint.region.write(page * page_bytes, fresh)
        emit({"event": "released", "room": release.room, "proof": release.proof.value})

    try:
        endpoint = DecodeEndpoint(
            get_backend(args["backend"]),
            int(args["num_pages"]),
            page_bytes,
            list(args["prefill"]),
            Config(**args["config"]),
            on_release=on_release,
        )
    except Exception as exc:  # a rank refused the bootstrap (its connect raised): say why
        emit({"event": "failed", "error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)
    pages = CanaryPages(endpoint.region, int(args["num_pages"]), page_bytes, int(args.get("num_ranks", 1)))
    receivers: dict[int, Receiver] = {}
    opened: dict[int, list[int]] = {}
    emit({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        cmd: dict[str, Any] = json.loads(line)
        op = cmd["op"]
        if op == "open":
            receivers[cmd["room"]] = endpoint.receiver(cmd["room"], cmd["pages"])
            opened[cmd["room"]] = list(cmd["pages"])
            emit({"event": "opened", "room": cmd["room"]})
        elif op == "abort":
            receivers[cmd["room"]].abort()
            emit({"event": "aborted", "room": cmd["room"]})
        elif op == "changed":
            bad = [p for p in cmd["pages"] if endpoint.region.read(p * page_bytes, page_bytes) != fresh]
            emit({"event": "changed", "pages": bad})
        elif op == "finish":
            rx, deadline = receivers[cmd["room"]], time.monotonic() + float(cmd["within"])
            while rx.poll().name not in ("SUCCESS", "FAILED") and time.monotonic() < deadline:
                time.sleep(0.01)
            state = rx.poll().name
            bad = pages.wrong_pattern(cmd["room"], opened[cmd["room"]]) if state == "SUCCESS" else []
            emit({"event": "finished", "room": cmd["room"], "state": state, "bad": bad})
    endpoint.close()


if __name__ == "__main__":
    main()
