"""An SGLang scheduler process's kvconn side, as SGLang runs it with
``--enable-metrics``: ``PROMETHEUS_MULTIPROC_DIR`` set (by the parent)
before anything imports prometheus_client, one decode endpoint, and
:class:`kvconn_sglang.metrics.Relay`. Its prefill rank is a process of its
own (:mod:`kvconn.testing.prefill_proc`, self-driving).

It lands one room of 3 pages and aborts another (released by proof),
relays, prints ``{"ready": true}``, then waits for stdin to close.
Run as ``python tests/ops/sglang_decode_child.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.testing.waiting import wait_for
from kvconn_sglang.metrics import MULTIPROC_ENV, Relay

PAGE_BYTES = 4096


def main() -> None:
    assert os.environ.get(MULTIPROC_ENV), "the parent sets the multiprocess folder"
    env = {k: v for k, v in os.environ.items() if k != MULTIPROC_ENV}  # prefill: another engine
    args = {
        "backend": "loopback",
        "rank": 0,
        "num_ranks": 1,
        "page_bytes": PAGE_BYTES,
        "chunk_pages": 1,
        "write_timeout_s": 1.0,
    }
    rank = subprocess.Popen(
        [sys.executable, "-m", "kvconn.testing.prefill_proc", json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert rank.stdout is not None and rank.stdin is not None
    address = json.loads(rank.stdout.readline())["address"]
    config = Config(write_timeout_s=1.0, abort_timeout_s=5.0)
    decode = DecodeEndpoint(get_backend("loopback"), 64, PAGE_BYTES, [address], config)
    relay = Relay(lambda: [("decode-0", decode.metrics)], interval_s=0.2)
    try:
        rx = decode.receiver(1, (0, 1, 2))
        wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 20, "room 1 landing", poll=0.002)
        rx.finish()
        decode.receiver(2, (3, 4)).abort()
        wait_for(lambda: decode.held_pages() == 0, 20, "room 2's release", poll=0.002)
        relay.relay_once()
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.read()
    finally:
        relay.close()
        decode.close()
        rank.stdin.close()
        rank.wait(15)


if __name__ == "__main__":
    main()
