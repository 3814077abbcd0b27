"""A real vLLM engine (V1, CPU) in its own process, driven over a pipe.

The child builds an ``LLMEngine`` on the tiny model, optionally with
KvconnConnector, and steps it continuously (as a server's engine loop does,
so sends and releases progress between requests). The parent adds and
aborts requests and reads what a test must see from inside: free blocks,
block bytes, the connector's held requests.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from vllm_helpers import BLOCK_SIZE, kv_transfer_config

KV_CACHE_BYTES = 16 << 20
MAX_MODEL_LEN = 256


class EngineError(RuntimeError):
    pass


class Engine:
    """The parent's handle on one engine process."""

    def __init__(
        self,
        model: Path,
        role: str | None,
        start_timeout_s: float = 240.0,
        builtin: dict[str, Any] | None = None,
        tp: int = 1,
        timeline: bool = False,
        **extra: Any,
    ) -> None:
        """``extra``: KvconnConnector's kv_connector_extra_config. ``builtin``:
        instead, the whole kv_transfer_config of one of vLLM's own connectors
        (with ``env``: environment variables for that engine). ``tp``: tensor
        parallel size (above 1: one vLLM worker process per rank).
        ``timeline``: time each room at the connector's hooks (``handoff``)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve,
            args=(child, str(model), role, extra, builtin, tp, timeline),
            # A TP engine starts its worker processes: a daemon cannot.
            daemon=tp == 1,
        )
        self.process.start()
        child.close()
        self.role = role
        self.start_timeout_s = start_timeout_s
        self._info: dict[str, Any] | None = None
        self.events: dict[str, dict[str, Any]] = {}

    @property
    def info(self) -> dict[str, Any]:
        """Waits for the engine to be up (engines start in parallel)."""
        if self._info is None:
            self._info = self._reply(self.start_timeout_s)
        return self._info

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def call(self, *command: Any, timeout_s: float = 60.0) -> Any:
        assert self.info
        self._conn.send(command)
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(min(left, 1.0)):
                if left <= 0:
                    raise EngineError(f"engine {self.role} gave no answer within {timeout_s} s")
                if not self.process.is_alive():
                    raise EngineError(f"engine {self.role} exited with {self.process.exitcode}")
                continue
            kind, payload = self._conn.recv()
            if kind == "error":
                raise EngineError(payload)
            return payload

    def add(
        self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None
    ) -> None:
        self.call("add", req_id, prompt, max_tokens, params)

    def finished(
        self, timeout_s: float = 120.0, *req_ids: str, poll_s: float = 0.02
    ) -> dict[str, dict[str, Any]]:
        """Wait until each of ``req_ids`` finished (looking every ``poll_s``); their outputs."""
        deadline = time.monotonic() + timeout_s
        while True:
            # The engine answers between steps: one step may take long on a loaded machine.
            self.events.update(self.call("outputs", timeout_s=max(60.0, deadline - time.monotonic())))
            if all(r in self.events for r in req_ids):
                return {r: self.events[r] for r in req_ids}
            if time.monotonic() > deadline:
                missing = [r for r in req_ids if r not in self.events]
                raise EngineError(f"engine {self.role}: {missing} not finished within {timeout_s} s")
            time.sleep(poll_s)

    def stats(self) -> dict[str, Any]:
        return dict(self.call("stats"))

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                os.kill(self.pid, signal.SIGCONT)
            self.process.kill()
        self.process.join(timeout=30)


def generate(
    engine: Engine, prompts: dict[str, list[int]], max_tokens: int, params: Any = None, poll_s: float = 0.02
) -> dict[str, Any]:
    for req_id, prompt in prompts.items():
        engine.add(req_id, prompt, max_tokens, params(req_id) if callable(params) else params)
    return engine.finished(180.0, *prompts, poll_s=poll_s)


# -- the child ------------------------------------------------------------------
def _serve(
    conn: Connection,
    model: str,
    role: str | None,
    extra: dict[str, Any],
    builtin: dict[str, Any] | None,
    tp: int = 1,
    timeline: bool = False,
) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if tp > 1:
        # One OpenMP thread per rank: with more, ranks spinning in OpenMP
        # barriers starve each other on a small machine (a TP-2 engine here
        # gave no token in 50 s; with one thread, 8 tokens in under 30 s).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if builtin is not None:
        os.environ.update(builtin.pop("env", {}))
    try:
        child = _Child(model, role, extra, builtin, tp)
        if timeline:
            child.watch_handoff()
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", child.info()))
    child.run(conn)


class _Child:
    def __init__(
        self, model: str, role: str | None, extra: dict[str, Any], builtin: dict[str, Any] | None, tp: int
    ) -> None:
        from vllm import EngineArgs, LLMEngine
        from vllm.config import KVTransferConfig

        args = EngineArgs(
            model=model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            skip_tokenizer_init=True,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=False,
            disable_hybrid_kv_cache_manager=True,
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
            kv_transfer_config=(
                KVTransferConfig(**builtin)
                if builtin is not None
                else KVTransferConfig(**kv_transfer_config(role, **extra), kv_load_failure_policy="recompute")
                if role
                else None
            ),
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.core = self.engine.engine_core.engine_core
        self.outputs: dict[str, dict[str, Any]] = {}
        self.internal: dict[str, str] = {}
        #: CLOCK_MONOTONIC is one clock for every process here: the parent
        #: compares these times across engines.
        self.added: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.received: dict[str, list[str]] = {}
        self.received_heads: dict[str, dict[str, str]] = {}
        self.worker = None
        self.tp = tp
        self.handoff: dict[int, dict[str, float]] = {}
        self.steps = 0
        if role and builtin is None and tp == 1:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            self.worker = get_kv_transfer_group().worker_side
            self._watch_receives()
        elif role and builtin is None:
            self.engine.collective_rpc(_watch_rank_receives)

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "num_blocks": self.core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
            "address": self.worker.address if self.worker is not None else "",
        }

    def _watch_receives(self) -> None:
        """Snapshot decode's blocks the moment a room is reported received,
        before the request's own forward writes into its last block."""
        worker = self.worker
        assert worker is not None
        start, results = worker.start, worker.results
        recvs: dict[str, tuple[int, ...]] = {}

        def watched_start(meta: Any) -> None:
            for recv in meta.recvs:
                recvs[recv.req_id] = recv.block_ids
            start(meta)

        def watched_results(finished: Any) -> Any:
            out = results(finished)
            for req_id in out.finished_recving - out.failed_recving:
                if req_id in recvs:
                    blocks = recvs.pop(req_id)
                    self.received[req_id] = self.digests(blocks)
                    self.received_heads[req_id] = head_digests(worker, blocks)
            return out

        worker.start, worker.results = watched_start, watched_results

    def digests(self, blocks: Any) -> list[str]:
        """sha256 of each block's bytes, over every layer and K/V part."""
        worker = self.worker
        assert worker is not None and worker.layout is not None
        out = []
        for block in blocks:
            h = hashlib.sha256()
            for part in worker.layout.buffers:
                address = worker.buffers[part.buffer].address + part.offset + block * part.stride
                h.update(ctypes.string_at(address, part.page_bytes))
            out.append(h.hexdigest())
        return out

    def fill(self, blocks: Any, byte: int) -> None:
        """Write ``byte`` over blocks: a canary standing for the next request's KV."""
        worker = self.worker
        assert worker is not None and worker.layout is not None
        for block in blocks:
            for part in worker.layout.buffers:
                address = worker.buffers[part.buffer].address + part.offset + block * part.stride
                ctypes.memset(address, byte, part.page_bytes)

    def run(self, conn: Connection) -> None:
        while True:
            busy = self.core.scheduler.has_requests()
            if conn.poll(0 if busy else 0.005):
                command = conn.recv()
                try:
                    reply = getattr(self, "do_" + command[0])(*command[1:])
                except Exception:
                    conn.send(("error", traceback.format_exc()))
                else:
                    conn.send(("ok", reply))
            if busy:
                self.steps += 1
                for out in self.engine.step():
                    if out.outputs and out.outputs[0].token_ids:
                        self.first_token.setdefault(out.request_id, time.monotonic())
                    if out.finished:
                        self._finished(out)

    def _finished(self, out: Any) -> None:
        completion = out.outputs[0]
        internal = self.internal.pop(out.request_id)
        event = {
            "tokens": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "kv_transfer_params": out.kv_transfer_params,
            "added": self.added.pop(out.request_id, None),
            "first_token": self.first_token.pop(out.request_id, None),
            "time": time.monotonic(),
        }
        if out.kv_transfer_params and out.kv_transfer_params.get("do_remote_prefill"):
            # Prefill: its blocks are still held for the send; snapshot them.
            blocks = self.core.scheduler.kv_cache_manager.get_block_ids(internal)[0]
            n = -(-out.kv_transfer_params["remote_num_tokens"] // BLOCK_SIZE)
            if self.worker is not None:
                event["blocks"] = self.digests(blocks[:n])
                event["heads"] = head_digests(self.worker, blocks[:n])
            if self.tp > 1:  # each rank holds its heads, in its own process
                event["heads"] = self.do_rank_heads(list(blocks[:n]))
        if internal in self.received:
            event["received"] = self.received.pop(internal)
            event["received_heads"] = self.received_heads.pop(internal)
        elif self.tp > 1 and self.core.scheduler.connector is not None:
            heads: dict[str, str] = {}
            for part in self.engine.collective_rpc(_rank_received_heads, args=(internal,)):
                heads.update(part)
            if heads:  # each decode rank's heads, as they landed
                event["received_heads"] = heads
        self.outputs[out.request_id] = event

    # -- commands ---------------------------------------------------------
    def do_add(self, req_id: str, prompt: list[int], max_tokens: int, params: Any) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        self.added[req_id] = time.monotonic()
        self.engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), sampling)
        # vLLM suffixes request ids inside the engine: remember this one's.
        self.internal[req_id] = self.engine.output_processor.external_req_ids[req_id][-1]

    def do_abort(self, req_id: str) -> None:
        self.engine.abort_request([req_id])

    def do_internal_id(self, req_id: str) -> str:
        return self.internal[req_id]

    def watch_handoff(self) -> None:
        """Time each room at the connector's hooks (CLOCK_MONOTONIC: one
        clock for both engines): decode asks; prefill's listener has the
        request; the chunk is queued; a transport worker took it; prefill
        sends the room's status; decode's listener has it; decode's worker
        reports the request received (``finished_recving``)."""
        from kvconn.hookspecs import hookimpl
        from kvconn.protocol.messages import RoomStatus

        worker = self.worker
        assert worker is not None, "a timeline needs kvconn's connector (TP 1)"
        marks = self.handoff

        def mark(room: int, name: str) -> None:
            marks.setdefault(room, {}).setdefault(name, time.monotonic())

        if worker.decode is not None:
            start, results, listener = worker.start, worker.results, worker.decode._listener
            on_status, rooms = listener._handler, {}

            def timed_start(meta: Any) -> None:
                for recv in meta.recvs:
                    rooms[recv.req_id] = recv.room
                    mark(recv.room, "decode_asks")
                start(meta)

            def timed_status(msg: Any) -> None:
                if isinstance(msg, RoomStatus):
                    mark(msg.room, "decode_has_status")
                on_status(msg)

            def timed_results(finished: Any) -> Any:
                out = results(finished)
                for req_id in out.finished_recving:
                    if req_id in rooms:
                        mark(rooms.pop(req_id), "decode_reports")
                return out

            worker.start, worker.results, listener._handler = timed_start, timed_results, timed_status
        if worker.rank is not None:
            rank, on_request, send, start_send = (
                worker.rank,
                worker.rank.on_request,
                worker._send,
                worker._start_send,
            )
            outbox_send = rank._outbox.send
            assert on_request is not None

            def timed_request(room: int, npages: int) -> None:
                mark(room, "prefill_has_request")
                cpu = time.thread_time()
                on_request(room, npages)
                # CPU the listener thread spent on it (the rest of its wall time: waits)
                marks[room].setdefault("prefill_request_cpu", time.thread_time() - cpu)

            def timed_send(outgoing: Any, npages: int) -> None:
                send(outgoing, npages)
                mark(outgoing.send.room, "prefill_queued")

            def timed_start_send(sent: Any) -> None:
                mark(sent.room, "prefill_send_starts")
                start_send(sent)

            def timed_outbox(address: str, message: Any) -> bool:
                if isinstance(message, RoomStatus):
                    mark(message.room, "prefill_sends_status")
                return bool(outbox_send(address, message))

            class Dequeued:
                @hookimpl
                def on_dequeue(self, chunk: Any) -> None:
                    mark(chunk.room, "prefill_dequeued")

            rank.on_request, worker._send, worker._start_send = timed_request, timed_send, timed_start_send
            rank._outbox.send = timed_outbox
            rank.pm.register(Dequeued(), name="handoff-timeline")

    def do_handoff(self) -> dict[int, dict[str, float]]:
        """The rooms' timestamps so far (``watch_handoff``), taken."""
        out = dict(self.handoff)
        self.handoff.clear()  # in place: the hooks hold this dict
        return out

    def do_steps(self) -> int:
        """Engine steps taken so far."""
        return self.steps

    def do_outputs(self) -> dict[str, dict[str, Any]]:
        out, self.outputs = self.outputs, {}
        return out

    def do_stats(self) -> dict[str, Any]:
        scheduler = self.core.scheduler
        held: dict[str, Any] = {}
        proofs: dict[str, int] = {}
        instances: list[list[str]] = []
        # The caller's ids: vLLM's internal ones carry a suffix.
        external = {v: k for k, v in self.internal.items()}
        if self.worker is not None:
            held = {external.get(r, r): state for r, state in self.worker.held_requests().items()}
            proofs = dict(self.worker.release_proofs)
            if self.worker.decode is not None:
                instances = [list(i) for i in self.worker.decode.instances()]
        elif self.tp > 1 and self.core.scheduler.connector is not None:
            # Every rank's: a request is held while any rank holds its blocks.
            for rank_held, rank_proofs in self.engine.collective_rpc(_rank_held):
                for r, state in rank_held.items():
                    held[external.get(r, r)] = state
                for proof, count in rank_proofs.items():
                    proofs[proof] = proofs.get(proof, 0) + count
        return {
            "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            "requests": sorted(scheduler.requests),
            "held": held,
            "proofs": proofs,
            "instances": instances,
        }

    def do_blocks(self, req_id: str) -> list[int]:
        """The blocks of request ``req_id`` (the caller's id), while it has any."""
        return list(self.core.scheduler.kv_cache_manager.get_block_ids(self.internal[req_id])[0])

    def do_drain(self, grace_s: float) -> list[dict[str, Any]]:
        """The worker's drain, as its shutdown runs it (reports as dicts)."""
        import attrs

        assert self.worker is not None
        return [attrs.asdict(report) for report in self.worker.drain(grace_s)]

    def do_shutdown(self) -> dict[str, Any]:
        """vLLM's shutdown of the worker's connector (``connector.shutdown()``,
        as ``ensure_kv_transfer_shutdown`` calls it): kvconn drains, then closes.
        What it reported, its release proofs, and the pages held at close."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        assert self.worker is not None
        reports: list[Any] = []
        drain = self.worker.drain

        def noted(grace_s: float) -> list[Any]:
            reports.extend(drain(grace_s))
            return reports

        self.worker.drain = noted
        started = time.monotonic()
        get_kv_transfer_group().shutdown()
        import attrs

        decode = self.worker.decode
        proofs: dict[str, float] = {}
        if decode is not None:  # the endpoint's own count (the engine steps no more)
            for family in decode.metrics.releases.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total") and sample.value:
                        proofs[sample.labels["proof"]] = sample.value
        return {
            "reports": [attrs.asdict(r) for r in reports],
            "seconds": time.monotonic() - started,
            "proofs": proofs,
            "held_pages": 0 if decode is None else decode.held_pages(),
        }

    def do_digests(self, blocks: list[int]) -> list[str]:
        return self.digests(blocks)

    def do_fill(self, blocks: list[int], byte: int) -> None:
        self.fill(blocks, byte)

    def do_rank_pids(self) -> list[int]:
        """The pid of each TP rank's worker process, in rank order."""
        return list(self.engine.collective_rpc(_rank_pid))

    def do_rank_heads(self, blocks: list[int]) -> dict[str, str]:
        """head_digests of ``blocks`` over every TP rank (each has its heads)."""
        merged: dict[str, str] = {}
        for digests in self.engine.collective_rpc(_rank_head_digests, args=(blocks,)):
            merged.update(digests)
        return merged


def head_digests(worker: Any, blocks: Any) -> dict[str, str]:
    """sha256 of each (layer part, block position, global KV head) of
    ``blocks``: comparable across TP sizes, since rank r of n holds heads
    r * heads ... of each block (HND: each head's rows contiguous)."""
    assert worker.layout is not None
    out = {}
    for index, part in enumerate(worker.layout.buffers):
        assert part.order == "HND" and part.heads > 0, part
        per_head = part.page_bytes // part.heads
        for position, block in enumerate(blocks):
            address = worker.buffers[part.buffer].address + part.offset + block * part.stride
            for head in range(part.heads):
                data = ctypes.string_at(address + head * per_head, per_head)
                key = f"{index}/{position}/{worker.tp_rank * part.heads + head}"
                out[key] = hashlib.sha256(data).hexdigest()
    return out


def _kvconn_worker_side() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side


#: In each vLLM worker process of a TP engine: the heads each decode rank
#: received, by vLLM's request id, snapshot when the room was reported received.
_RANK_RECEIVED: dict[str, dict[str, str]] = {}


def _watch_rank_receives(_worker: Any) -> None:
    """Run in each vLLM worker process by collective_rpc: snapshot the heads
    of a received room's blocks before the request's own forward writes."""
    side = _kvconn_worker_side()
    start, results = side.start, side.results
    recvs: dict[str, tuple[int, ...]] = {}

    def watched_start(meta: Any) -> None:
        for recv in meta.recvs:
            recvs[recv.req_id] = recv.block_ids
        start(meta)

    def watched_results(finished: Any) -> Any:
        out = results(finished)
        for req_id in out.finished_recving - out.failed_recving:
            if req_id in recvs:
                _RANK_RECEIVED[req_id] = head_digests(side, recvs.pop(req_id))
        return out

    side.start, side.results = watched_start, watched_results


def _rank_received_heads(_worker: Any, req_id: str) -> dict[str, str]:
    """Run in each vLLM worker process by collective_rpc."""
    return _RANK_RECEIVED.pop(req_id, {})


def _rank_held(_worker: Any) -> tuple[dict[str, str], dict[str, int]]:
    """Run in each vLLM worker process by collective_rpc: its held requests
    and release proofs."""
    side = _kvconn_worker_side()
    return side.held_requests(), dict(side.release_proofs)


def _rank_pid(_worker: Any) -> int:
    """Run in each vLLM worker process by collective_rpc."""
    return os.getpid()


def _rank_head_digests(_worker: Any, blocks: list[int]) -> dict[str, str]:
    """Run in each vLLM worker process by collective_rpc."""
    return head_digests(_kvconn_worker_side(), blocks)


@contextlib.contextmanager
def engine(model: Path, role: str | None, **extra: Any) -> Iterator[Engine]:
    handle = Engine(model, role, **extra)
    try:
        yield handle
    finally:
        handle.close()
