"""A prefill process for the SGLang tests: SGLang's KVArgs over a numpy pool,
kvconn_sglang's manager and senders built as SGLang's prefill scheduler
builds them (through the plugin's get_kv_class), driven over stdin/stdout
with one JSON object per line.

Run as ``python prefill_child.py '{"tp_size": 2, "ranks": [0, 1]}'``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import standins

standins.install()

import torch  # noqa: E402
from kvpool import Pool  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import MetadataBuffers  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    load_plugins()
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend("kvconn")
    manager_class = get_kv_class(backend, KVClassType.MANAGER)
    sender_class = get_kv_class(backend, KVClassType.SENDER)
    kv_args_class = get_kv_class(backend, KVClassType.KVARGS)
    tp_size = spec["tp_size"]
    server_args = SimpleNamespace(tp_size=tp_size, enable_dp_attention=False)
    pools = {r: Pool(tp_size, r, fill=True) for r in spec["ranks"]}
    # SGLang's own aux rows (first output token, logprobs, the room id ...), on CPU as in SGLang.
    metadata = {r: MetadataBuffers(8, 16, torch.float32, 0) for r in pools}
    managers = {
        r: manager_class(pool.kv_args(kv_args_class, metadata[r]), DisaggregationMode.PREFILL, server_args)
        for r, pool in pools.items()
    }
    senders: dict[tuple[int, int], Any] = {}
    reply({"ready": {r: m.rank.address for r, m in managers.items()}})
    for line in sys.stdin:
        cmd = json.loads(line)
        op, room = cmd["op"], cmd.get("room")
        if op == "begin":
            # SGLang's bootstrap queue: a sender per rank, polled until decode's
            # metadata arrived, then init(num_pages, aux_index).
            deadline = time.monotonic() + cmd["wait_s"]
            states = {}
            for r, m in managers.items():
                sender = senders[(r, room)] = sender_class(m, "bootstrap", room)
                while (state := sender.poll()) == KVPoll.Bootstrapping and time.monotonic() < deadline:
                    time.sleep(0.005)
                states[r] = int(state)
                if state == KVPoll.WaitingForInput:
                    # What SGLang's prefill writes into its slot before the last chunk.
                    slot = cmd.get("aux_slot", 0)
                    metadata[r].bootstrap_room[slot, 0] = room
                    metadata[r].output_ids[slot, 0] = cmd.get("first_token", 0)
                    sender.init(cmd["num_pages"], slot)
            reply({"states": states})
        elif op == "send":
            for r in managers:
                senders[(r, room)].send(cmd["pages"])
            reply({"sent": len(cmd["pages"])})
        elif op == "poll":
            reply({"states": {r: int(senders[(r, room)].poll()) for r in managers}})
        elif op == "abort":
            # SGLang's prefill aborting a request it is sending (AbortReq).
            for r in managers:
                senders[(r, room)].abort()
            reply({"aborted": room})
        elif op == "clear":
            for r in managers:
                senders.pop((r, room)).clear()
            reply({"cleared": room})
        else:
            reply({"error": f"unknown op {op!r}"})


def reply(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
