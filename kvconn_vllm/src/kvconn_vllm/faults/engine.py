"""A real vLLM engine (V1, in-process engine core) in a process of its own,
driven over a pipe, with any KV connector.

The child steps its ``LLMEngine`` as vLLM's engine-core loop does (each step
that runs no forward while the scheduler still has work is followed by a
1 ms sleep, vLLM's own yield to the connector's threads), answers the
parent's commands between steps, and watches its KV blocks
(:mod:`kvconn_vllm.faults.watch`). A fault is armed on a request and fired
by the child itself at an exact point of that request's hand-off: when the
step that schedules its KV load begins (``before_load``) or ends
(``after_load``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import attrs

from kvconn_vllm.faults.watch import BlockWatch, block_views


class EngineError(RuntimeError):
    """The engine process failed, exited or did not answer in time."""


@attrs.frozen
class EngineSpec:
    """What one engine process runs."""

    model: str
    #: "kv_producer", "kv_consumer", or None for a plain engine.
    role: str | None = None
    transfer: Mapping[str, Any] | None = None
    env: Mapping[str, str] = attrs.field(factory=dict)
    max_model_len: int = 2304
    kv_cache_bytes: int = 64 << 20
    block_size: int = 32
    #: Mirror vLLM's engine-core loop (sleep 1 ms after a step that ran no
    #: forward while work is left); False steps back to back.
    core_loop_yield: bool = True
    name: str = "engine"


class Engine:
    """The parent's handle on one engine process."""

    def __init__(self, spec: EngineSpec, start_timeout_s: float = 1800.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.spec = spec
        self.process = ctx.Process(target=_serve, args=(child, spec), daemon=True, name=spec.name)
        self.process.start()
        child.close()
        self.start_timeout_s = start_timeout_s
        self._info: dict[str, Any] | None = None
        self._seq = 0
        self.events: dict[str, dict[str, Any]] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def info(self) -> dict[str, Any]:
        """Waits until the engine is up (several engines start in parallel)."""
        if self._info is None:
            self._info = dict(self._reply(0, self.start_timeout_s))
        return self._info

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def stopped(self) -> bool:
        """The process is stopped (SIGSTOP, by itself or by the parent)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except OSError:
            return False

    def call(self, *command: Any, timeout_s: float = 120.0, unless_stopped: bool = False) -> Any:
        """Run ``command`` in the child; its answer. ``unless_stopped``: None
        as soon as the process is seen stopped (the answer it gives once
        thawed is then dropped)."""
        assert self.info
        self._seq += 1
        self._conn.send((self._seq, *command))
        return self._reply(self._seq, timeout_s, unless_stopped)

    def _reply(self, seq: int, timeout_s: float, unless_stopped: bool = False) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"{self.name}: no answer within {timeout_s:g} s")
            if not self._conn.poll(min(left, 0.05 if unless_stopped else 1.0)):
                if not self.process.is_alive():
                    raise EngineError(f"{self.name}: exited with {self.process.exitcode}")
                if unless_stopped and self.stopped():
                    return None
                continue
            kind, answered, payload = self._conn.recv()
            if answered != seq:
                continue  # the answer to a call given up on
            if kind == "error":
                raise EngineError(f"{self.name}: {payload}")
            return payload

    # -- commands ----------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: Any = None) -> None:
        self.call("add", req_id, prompt, max_tokens, params)

    def abort(self, req_id: str) -> None:
        self.call("abort", req_id)

    def arm(self, req_id: str, point: str, action: str) -> None:
        """At ``point`` ("before_load", "after_load") of ``req_id``'s KV
        load, the child does ``action`` ("freeze": SIGSTOP itself;
        "abort": aborts the request, as a client leaving would)."""
        self.call("arm", req_id, point, action)

    def poll(self) -> dict[str, dict[str, Any]]:
        """Requests finished since the last poll (kept in ``events``)."""
        new = dict(self.call("outputs"))
        self.events.update(new)
        return new

    def stats(self) -> dict[str, Any]:
        return dict(self.call("stats"))

    def watch(self, on: bool) -> None:
        """Turn the block watch on (from now) or off."""
        self.call("watch", on)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(timeout=30)

    def close(self) -> None:
        if self.process.is_alive():
            self.thaw()
            self.process.kill()
        self.process.join(timeout=30)


# -- the child ------------------------------------------------------------------
def _serve(conn: Connection, spec: EngineSpec) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.update(spec.env)
    try:
        child = _Child(spec)
    except Exception:
        conn.send(("error", 0, traceback.format_exc()))
        return
    conn.send(("ok", 0, child.info()))
    child.run(conn)


@attrs.define
class _Armed:
    point: str
    action: str


class _Child:
    def __init__(self, spec: EngineSpec) -> None:
        from vllm import EngineArgs, LLMEngine
        from vllm.config import KVTransferConfig

        self.spec = spec
        args = EngineArgs(
            model=spec.model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=spec.max_model_len,
            max_num_batched_tokens=max(spec.max_model_len, 2048),
            kv_cache_memory_bytes=spec.kv_cache_bytes,
            skip_tokenizer_init=True,
            block_size=spec.block_size,
            enable_prefix_caching=False,
            disable_hybrid_kv_cache_manager=True,
            kv_transfer_config=KVTransferConfig(**spec.transfer) if spec.transfer else None,
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.core = self.engine.engine_core.engine_core
        self.scheduler = self.core.scheduler
        pool = self.scheduler.kv_cache_manager.block_pool
        self.num_blocks = int(pool.num_gpu_blocks)
        context = self.engine.vllm_config.compilation_config.static_forward_context
        tensors = [layer.kv_cache for _, layer in sorted(context.items()) if hasattr(layer, "kv_cache")]
        self.watch = BlockWatch(block_views(tensors, self.num_blocks))
        self.outputs: dict[str, dict[str, Any]] = {}
        self.internal: dict[str, str] = {}
        self.external: dict[str, str] = {}
        self.added: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.aborted: dict[str, float] = {}
        self.received: dict[str, list[str]] = {}
        self.failed_loads: set[str] = set()
        self.load_started: dict[str, float] = {}
        self.armed: dict[str, _Armed] = {}
        self.steps = 0
        self.step_seconds: list[float] = []
        self.model_executed = True
        self._hook_pool(pool)
        self._hook_scheduler()
        self._hook_core()

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "num_blocks": self.num_blocks}

    # -- hooks -------------------------------------------------------------
    def _hook_pool(self, pool: Any) -> None:
        get_new, free = pool.get_new_blocks, pool.free_blocks
        watch = self.watch

        def get_new_blocks(num_blocks: int) -> Any:
            blocks = get_new(num_blocks)
            if watch.enabled:
                watch.on_allocated([b.block_id for b in blocks])
            return blocks

        def free_blocks(ordered_blocks: Any) -> None:
            blocks = list(ordered_blocks)
            free(blocks)
            watch.on_freed(b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null)

        pool.get_new_blocks, pool.free_blocks = get_new_blocks, free_blocks

    def _hook_scheduler(self) -> None:
        from vllm.v1.request import RequestStatus

        scheduler = self.scheduler
        schedule, xfer_finished = scheduler.schedule, scheduler._update_from_kv_xfer_finished

        def watched_schedule(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            self._load_points("before_load")
            return out

        def watched_xfer_finished(output: Any) -> None:
            # Decode's blocks as the KV landed, before the request's own
            # forward writes into them.
            # (A load reported failed is recomputed: nothing of it is used.)
            failed = set(output.failed_recving or ()) | scheduler.failed_recving_kv_req_ids
            for req_id in output.finished_recving or ():
                request = scheduler.requests.get(req_id)
                if req_id in failed:
                    self.failed_loads.add(req_id)
                elif request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    blocks = self._blocks(req_id)
                    n = -(-len(request.prompt_token_ids or ()) // self.spec.block_size)
                    self.received[req_id] = self.watch.digests(blocks[:n])
            xfer_finished(output)

        scheduler.schedule = watched_schedule
        scheduler._update_from_kv_xfer_finished = watched_xfer_finished

    def _hook_core(self) -> None:
        post_step = self.core.post_step

        def watched_post_step(model_executed: bool) -> None:
            self.model_executed = model_executed
            post_step(model_executed=model_executed)

        self.core.post_step = watched_post_step

    def _blocks(self, req_id: str) -> list[int]:
        (ids, *_) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        return list(ids)

    def _load_points(self, point: str) -> None:
        """Fire what is armed at ``point`` for requests whose load started."""
        from vllm.v1.request import RequestStatus

        for ext, armed in list(self.armed.items()):
            req_id = self.internal.get(ext)
            request = self.scheduler.requests.get(req_id) if req_id else None
            if request is None or armed.point != point:
                continue
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if point == "after_load" and not (loading or ext in self.load_started):
                continue
            if point == "before_load" and not loading:
                continue
            del self.armed[ext]
            if armed.action == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif armed.action == "abort":
                self.do_abort(ext)

    # -- the loop ------------------------------------------------------------
    def run(self, conn: Connection) -> None:
        from vllm.v1.request import RequestStatus

        while True:
            busy = self.scheduler.has_requests()
            if conn.poll(0 if busy else 0.005):
                seq, name, *args = conn.recv()
                try:
                    reply = getattr(self, "do_" + name)(*args)
                except Exception:
                    conn.send(("error", seq, traceback.format_exc()))
                else:
                    conn.send(("ok", seq, reply))
                continue
            if not busy:
                continue
            started = time.monotonic()
            self.steps += 1
            self.model_executed = True
            outputs = self.engine.step()
            now = time.monotonic()
            self.step_seconds.append(now - started)
            for out in outputs:
                if out.outputs and out.outputs[0].token_ids:
                    self.first_token.setdefault(out.request_id, now)
                if out.finished:
                    self._finished(out)
            owners: dict[str, list[int]] = {}
            for req_id, request in self.scheduler.requests.items():
                owners[req_id] = self._blocks(req_id)
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    self.load_started.setdefault(self.external.get(req_id, req_id), now)
            self.watch.note_owners(owners)
            if self.watch.enabled:
                self.watch.check()
            self._load_points("after_load")
            if self.spec.core_loop_yield and not self.model_executed and self.scheduler.has_requests():
                time.sleep(0.001)  # vLLM's EngineCore._process_engine_step does this

    def _finished(self, out: Any) -> None:
        completion = out.outputs[0]
        internal = self.internal.get(out.request_id, out.request_id)
        event: dict[str, Any] = {
            "tokens": list(completion.token_ids),
            "finish_reason": str(completion.finish_reason),
            "kv_transfer_params": out.kv_transfer_params,
            "added": self.added.get(out.request_id),
            "first_token": self.first_token.pop(out.request_id, None),
            "time": time.monotonic(),
        }
        request = self.scheduler.requests.get(internal)
        if request is not None and out.kv_transfer_params:
            # Prefill keeps the blocks for the transfer: what it will send.
            n = -(-len(request.prompt_token_ids or ()) // self.spec.block_size)
            event["blocks"] = self._blocks(internal)[:n]
            event["sent"] = self.watch.digests(event["blocks"])
        if internal in self.received:
            event["received"] = self.received.pop(internal)
        event["load_failed"] = internal in self.failed_loads
        self.outputs[out.request_id] = event

    # -- commands ------------------------------------------------------------
    def do_add(self, req_id: str, prompt: list[int], max_tokens: int, params: Any) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": dict(params)} if params else None,
        )
        self.added[req_id] = time.monotonic()
        self.engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), sampling)
        internal = self.engine.output_processor.external_req_ids[req_id][-1]
        self.internal[req_id], self.external[internal] = internal, req_id

    def do_abort(self, req_id: str) -> None:
        self.aborted[req_id] = time.monotonic()
        self.engine.abort_request([req_id])

    def do_arm(self, req_id: str, point: str, action: str) -> None:
        if point not in ("before_load", "after_load") or action not in ("freeze", "abort"):
            raise ValueError(f"cannot arm {action!r} at {point!r}")
        self.armed[req_id] = _Armed(point, action)

    def do_watch(self, on: bool) -> None:
        self.watch.enabled = on
        self.watch.watched.clear()
        self.watch.late_writes.clear()
        self.watch.released.clear()

    def do_outputs(self) -> dict[str, dict[str, Any]]:
        out, self.outputs = self.outputs, {}
        return out

    def do_stats(self) -> dict[str, Any]:
        from vllm.v1.request import RequestStatus

        pool = self.scheduler.kv_cache_manager.block_pool
        free = int(pool.get_num_free_blocks())
        ext = self.external
        holding = {
            ext.get(r, r): str(request.status)
            for r, request in self.scheduler.requests.items()
            if RequestStatus.is_finished(request.status)
            or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        return {
            "time": time.monotonic(),
            "free_blocks": free,
            # The null block is never free.
            "used_blocks": self.num_blocks - 1 - free,
            "requests": sorted(ext.get(r, r) for r in self.scheduler.requests),
            "holding": holding,
            # Blocks each request still holds (running, waiting for its KV,
            # or finished with its blocks kept by the connector).
            "held_blocks": {ext.get(r, r): n for r in self.scheduler.requests if (n := len(self._blocks(r)))},
            "late_writes": [attrs.asdict(w) | {"owner": ext.get(w.owner, w.owner)} for w in self.watch.late_writes],
            "released": {ext.get(r, r): t for r, t in self.watch.released.items()},
            "aborted": dict(self.aborted),
            "load_started": dict(self.load_started),
            "steps": self.steps,
            "proofs": self._proofs(),
        }

    def do_steps(self) -> dict[str, Any]:
        """Engine steps so far and their durations (taken)."""
        seconds, self.step_seconds = self.step_seconds, []
        return {"steps": self.steps, "seconds": seconds}

    def _proofs(self) -> dict[str, int]:
        """kvconn's release proofs, where the connector is kvconn's."""
        with contextlib.suppress(Exception):
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            side = getattr(get_kv_transfer_group(), "worker_side", None)
            if side is not None:
                return dict(side.release_proofs)
        return {}
