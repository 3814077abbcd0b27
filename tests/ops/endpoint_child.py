"""A decode endpoint and a prefill rank over loopback, in one child process,
serving both registries through :func:`kvconn.metrics.serve_metrics`.

It moves one room to SUCCESS and aborts another (released by proof), prints
``{"port": N, ...}`` as one JSON line, then serves scrapes until stdin
closes. Run as ``python tests/ops/endpoint_child.py ARGS_JSON``.

With ``"unsafe": true`` both run the legacy timeout-only mode instead
(``Config.unsafe_release_at_deadline``, acks off): it prints the port first,
waits for a line on stdin (the parent has seen the counters at 0), then
aborts one room, which decode frees at its 0.5 s deadline without proof,
and prints ``{"released": "unsafe_timeout"}``.
"""

from __future__ import annotations

import json
import sys

from kvconn.config import Config
from kvconn.metrics import serve_metrics
from kvconn.plugins import get_backend
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.waiting import wait_for

PAGE_BYTES = 4096


def main() -> None:
    args = json.loads(sys.argv[1])
    pages = int(args["pages"])
    backend = get_backend("loopback")
    unsafe = bool(args.get("unsafe"))
    if unsafe:
        config = Config(
            write_timeout_s=0.2, abort_timeout_s=0.5, acks_enabled=False, unsafe_release_at_deadline=True
        )
    else:
        config = Config(write_timeout_s=1.0, abort_timeout_s=5.0)
    rank = PrefillRank(backend, 0, 64 * PAGE_BYTES, config)
    decode = DecodeEndpoint(backend, 64, PAGE_BYTES, [rank.address], config)
    server = serve_metrics({"decode": decode.metrics, "prefill-0": rank.metrics}, port=int(args["port"]))
    try:
        if unsafe:
            print(json.dumps({"port": server.port}), flush=True)
            sys.stdin.readline()
            decode.receiver(1, (0, 1)).abort()
            wait_for(lambda: decode.held_pages() == 0, 20, "the deadline's release", poll=0.002)
            print(json.dumps({"released": "unsafe_timeout"}), flush=True)
            sys.stdin.read()
            return
        rx = decode.receiver(1, tuple(range(pages)))
        sender = rank.sender(1)
        wait_for(
            lambda: sender.poll() >= KVPoll.WAITING_FOR_INPUT, 20, "the request reaching the rank", poll=0.002
        )
        for page in range(pages):
            sender.send([page], last=page == pages - 1)
        wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 20, "room 1 landing", poll=0.002)
        rx.finish()
        aborted = decode.receiver(2, (pages, pages + 1))
        wait_for(
            lambda: rank.sender(2).poll() >= KVPoll.WAITING_FOR_INPUT,
            20,
            "room 2 reaching the rank",
            poll=0.002,
        )
        aborted.abort()
        wait_for(lambda: decode.held_pages() == 0, 20, "room 2's release", poll=0.002)
        print(json.dumps({"port": server.port}), flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin
    finally:
        server.close()
        decode.close()
        rank.close()


if __name__ == "__main__":
    main()
