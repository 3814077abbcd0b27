"""A prefill process for the SGLang tests: SGLang's KVArgs over a numpy pool,
kvconn_sglang's manager built as SGLang's prefill builds it (through the
plugin's get_kv_class), and SGLang's own prefill queues from the installed
wheel driving the senders: ``PrefillBootstrapQueue`` (create_sender,
pop_bootstrapped, finalize_bootstrap -> init(num_pages, metadata slot)) and
the scheduler's ``process_disagg_prefill_inflight_queue`` (Success / Failed,
then SGLang frees the request's source KV), and its ``ShutdownReq`` handler
(``Scheduler.handle_shutdown``, with the plugin's hook). Driven over
stdin/stdout (or the zygote's socket), one JSON object per line.

Run as ``python prefill_child.py '{"tp_size": 2, "ranks": [0, 1]}'`` (the
tests fork it from zygote.py instead, which imported SGLang once); with
``"host": ADDRESS`` its bootstrap server and the address it registers there
are that host's (a prefill on another host: tests/sglang/test_sglang_hosts.py;
its kvconn rank then binds KVCONN_SGLANG_HOST).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any, TextIO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import standins

standins.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from kvpool import PAGE_TOKENS, Pool  # noqa: E402
from sglang.srt.disaggregation import prefill  # noqa: E402
from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402


class _Recorder:
    """Any attribute or call is accepted and ignored (SGLang's time stats, traces)."""

    def __getattr__(self, name: str) -> Any:
        return _Recorder()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Scheduler(prefill.SchedulerDisaggregationPrefillMixin):  # type: ignore[misc]
    """SGLang's prefill scheduler methods over just the state they read."""

    def __init__(self, **state: Any) -> None:
        self.__dict__.update(state)


class Rank:
    """One prefill TP rank: its manager, SGLang's bootstrap queue, and the
    scheduler state process_disagg_prefill_inflight_queue reads."""

    def __init__(
        self, utils: Any, tp_size: int, tp_rank: int, group: Any, bootstrap_port: int, host: str
    ) -> None:
        backend = utils.TransferBackend("kvconn")
        self.pool = Pool(tp_size, tp_rank, fill=True)
        # SGLang's own aux rows (first output token, logprobs, the room id ...), on CPU as in SGLang.
        self.metadata = MetadataBuffers(8, 16, torch.float32, 0)
        kv_args = self.pool.kv_args(utils.get_kv_class(backend, utils.KVClassType.KVARGS), self.metadata)
        # Each rank registers its kvconn address with the instance's bootstrap server.
        server_args = SimpleNamespace(
            tp_size=tp_size,
            enable_dp_attention=False,
            host=host,
            disaggregation_bootstrap_port=bootstrap_port,
        )
        manager_class = utils.get_kv_class(backend, utils.KVClassType.MANAGER)
        self.manager = manager_class(kv_args, utils.DisaggregationMode.PREFILL, server_args)
        self.released: list[str] = []  # rids whose source KV SGLang freed
        self.slots = ReqToMetadataIdxAllocator(8)
        self.scheduler = _Scheduler(
            attn_cp_cpu_group=group,
            attn_tp_cpu_group=group,
            token_to_kv_pool_allocator=SimpleNamespace(page_size=PAGE_TOKENS),
            processed_tokens_counter=0,
            output_streamer=SimpleNamespace(stream_output=lambda *a, **k: None),
            metrics_reporter=SimpleNamespace(enable_metrics=False),
            tree_cache=_Recorder(),
            req_to_metadata_buffer_idx_allocator=self.slots,
            disagg_prefill_inflight_queue=[],
            scheduler_stage_metrics=None,
            _release_aborted_request=lambda req: None,
            handle_bootstrap_failure=lambda req: self.released.append(req.rid),
            gracefully_exit=False,
        )
        queue = prefill.PrefillBootstrapQueue.__new__(prefill.PrefillBootstrapQueue)
        queue.queue, queue.scheduler, queue.pp_size = [], self.scheduler, 1
        queue.kv_manager, queue.transfer_backend, queue.bootstrap_port = self.manager, backend, 8998
        queue.max_input_len = 1 << 20
        queue.scheduler_stage_metrics = None
        queue.req_to_metadata_buffer_idx_allocator = self.slots
        self.bootstrap = queue
        # Where SGLang's scheduler keeps it (its ShutdownReq hook finds the manager there).
        self.scheduler.disagg_prefill_bootstrap_queue = queue
        self.reqs: dict[int, Any] = {}
        self.host = host

    def begin(self, room: int, num_pages: int, first_token: int, wait_s: float) -> int:
        req = SimpleNamespace(
            rid=f"room-{room}",
            bootstrap_host=self.host,
            bootstrap_room=room,
            disagg_prefill_dp_rank=None,
            origin_input_ids=[1] * (num_pages * PAGE_TOKENS),
            metadata_buffer_index=-1,
            pending_bootstrap=False,
            is_retracted=False,
            prefill_attempt_count=0,
            sampling_params=SimpleNamespace(max_new_tokens=16),
            time_stats=_Recorder(),
            finished_reason=None,
            to_finish=None,
            return_logprob=False,
            return_routed_experts=False,
            cache_request_handle=None,
        )
        self.reqs[room] = req
        self.bootstrap.add(req, num_kv_heads=self.pool.heads)
        deadline = time.monotonic() + wait_s
        while not self.bootstrap.pop_bootstrapped() and time.monotonic() < deadline:
            time.sleep(0.005)
        if req.pending_bootstrap:
            return int(req.disagg_kv_sender.poll())
        # What SGLang's prefill writes into the request's aux row before its last chunk.
        self.metadata.bootstrap_room[req.metadata_buffer_index, 0] = room
        self.metadata.output_ids[req.metadata_buffer_index, 0] = first_token
        self.scheduler.disagg_prefill_inflight_queue.append(req)
        return int(req.disagg_kv_sender.poll())

    def inflight(self, room: int) -> dict[str, Any]:
        """One pass of SGLang's inflight queue; what became of ``room``."""
        req = self.reqs[room]
        done = prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue(
            self.scheduler
        )
        finished = req in done
        return {
            "done": finished,
            "failed": finished and isinstance(req.finished_reason, FINISH_ABORT),
            "released": req.rid in self.released,
            "poll": int(req.disagg_kv_sender.poll()),
        }


def serve_instance(spec: dict[str, Any], rfile: TextIO, wfile: TextIO) -> None:
    """One prefill instance: its bootstrap server and ranks, driven by the
    JSON lines of ``rfile`` until it closes (answers on ``wfile``)."""
    # kvconn's runtime imports prometheus_client: only now (zygote.py says why).
    from kvconn.testing.cluster import free_port

    load_plugins()
    from sglang.srt.disaggregation import utils

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    group = dist.group.WORLD
    prefill.get_disagg = lambda: SimpleNamespace(
        optimistic_prefill_attempts=0, disaggregation_decode_allocation_policy="default"
    )
    prefill.get_parallel = lambda: SimpleNamespace(tp_rank=0, pp_rank=0)
    # SGLang's prefill starts the backend's bootstrap server (start_disagg_service): the plugin's.
    backend = utils.TransferBackend("kvconn")
    # A fixed port: an instance restarted at the same bootstrap address.
    bootstrap_port = int(spec.get("bootstrap_port") or free_port())
    server_class = utils.get_kv_class(backend, utils.KVClassType.BOOTSTRAP_SERVER)
    host = spec.get("host", "127.0.0.1")
    server_class(host=host, port=bootstrap_port)
    ranks = {r: Rank(utils, spec["tp_size"], r, group, bootstrap_port, host) for r in spec["ranks"]}
    # SGLang frees a finished request's source KV through release_kv_cache.
    prefill.release_kv_cache = lambda req, tree_cache, **kw: [
        rank.released.append(req.rid) for rank in ranks.values() if rank.reqs.get(req.bootstrap_room) is req
    ]
    reply(
        {
            "ready": {r: rank.manager.rank.address for r, rank in ranks.items()},
            "bootstrap": f"{host}:{bootstrap_port}",
        },
        wfile,
    )
    for line in rfile:
        try:
            reply(serve(json.loads(line), ranks), wfile)
        except Exception:
            reply({"error": traceback.format_exc()}, wfile)


def serve(cmd: dict[str, Any], ranks: dict[int, Rank]) -> dict[str, Any]:
    op, room = cmd["op"], cmd.get("room")
    if op == "begin":
        states = {
            r: rank.begin(room, cmd["num_pages"], cmd.get("first_token", 0), cmd["wait_s"])
            for r, rank in ranks.items()
        }
        return {"states": states}
    if op == "send":
        for rank in ranks.values():
            rank.reqs[room].disagg_kv_sender.send(cmd["pages"])
        return {"sent": len(cmd["pages"])}
    if op == "inflight":
        return {"ranks": {r: rank.inflight(room) for r, rank in ranks.items()}}
    if op == "drain":
        # SGLang's shutdown path (teardown drains before it closes), the drain alone.
        reports = {r: rank.manager.drain(cmd["grace_s"]) for r, rank in ranks.items()}
        return {"drained": {r: [rep.drained, rep.seconds, rep.rooms_left] for r, rep in reports.items()}}
    if op == "shutdown":
        # SGLang's ShutdownReq, handled by its Scheduler.handle_shutdown (the plugin's hook applied).
        from sglang.srt.managers.io_struct import ShutdownReq
        from sglang.srt.managers.scheduler import Scheduler

        for rank in ranks.values():
            Scheduler.handle_shutdown(rank.scheduler, ShutdownReq())
        return {"gracefully_exit": {r: rank.scheduler.gracefully_exit for r, rank in ranks.items()}}
    if op == "exiting":
        return {"gracefully_exit": {r: rank.scheduler.gracefully_exit for r, rank in ranks.items()}}
    if op == "abort":
        # SGLang's AbortReq for a request the prefill is sending.
        for rank in ranks.values():
            rank.reqs[room].disagg_kv_sender.abort()
        return {"aborted": room}
    return {"error": f"unknown op {op!r}"}


def reply(obj: object, wfile: TextIO | None = None) -> None:
    out = sys.stdout if wfile is None else wfile
    out.write(json.dumps(obj) + "\n")
    out.flush()


if __name__ == "__main__":
    serve_instance(json.loads(sys.argv[1]), sys.stdin, sys.stdout)
