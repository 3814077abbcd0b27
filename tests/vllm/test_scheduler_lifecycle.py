"""KvconnConnector inside vLLM's real Scheduler (from the installed wheel),
built by vLLM's connector factory from the config users type. The tests
play the worker: they read the connector metadata the scheduler produces
and feed back what a worker would report.

Lifecycles covered (the ones vLLM's own connector unit tests check, in
push mode): decode's remote prefill (blocks allocated, request waits,
runs once received); a prompt of whole blocks (the last token is
recomputed); an abort while the KV is on its way (blocks stay allocated,
however many steps pass, until the worker reports them released); a failed
transfer (vLLM's load-failure path: recomputed); a local prefix-cache hit
(prefill writes only the rest); prefill's remote decode (blocks kept after
the request finished until the send settled, with the room and address in
its output); a short prompt; an abort at prefill (nothing sent).
Not applicable in push mode: pull-side lifecycles (decode reading prefill's
remote_block_ids), and lease/heartbeat expiry that frees blocks on a timer,
which kvconn refuses by design.
"""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

from pathlib import Path
from typing import Any

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from vllm.v1.request import FinishReason, RequestStatus
from vllm_helpers import (
    BLOCK_SIZE,
    EOS,
    free_blocks,
    make_request,
    make_scheduler,
    make_tiny_llama,
    model_output,
    request_blocks,
)

from kvconn_vllm import KvconnConnector
from kvconn_vllm.metadata import KvconnHandshake, KvconnMetadata
from kvconn_vllm.params import RemotePrefill, room_for

PREFILL = ("tcp://127.0.0.1:5999",)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def remote(num_tokens: int, room: int = 12345) -> dict[str, Any]:
    return RemotePrefill(room, PREFILL, num_tokens).to_params()


def meta_of(output: Any) -> KvconnMetadata:
    meta = output.kv_connector_metadata
    assert isinstance(meta, KvconnMetadata)
    return meta


def step(scheduler: Any, result: Any = None) -> tuple[Any, Any]:
    output = scheduler.schedule()
    outputs = scheduler.update_from_output(
        output, result if result is not None else EMPTY_MODEL_RUNNER_OUTPUT
    )
    return output, outputs


def assert_empty(scheduler: Any, total: int) -> None:
    assert not scheduler.requests
    assert not scheduler.running
    assert not scheduler.finished_recving_kv_req_ids
    assert free_blocks(scheduler) == total - 1  # one null block


# -- decode: remote prefill ---------------------------------------------------
def test_connector_is_loaded_by_vllms_factory(model: Path) -> None:
    scheduler = make_scheduler(model, "kv_consumer")
    assert isinstance(scheduler.connector, KvconnConnector)


@pytest.mark.parametrize("num_tokens", [BLOCK_SIZE // 2, int(BLOCK_SIZE * 2.5)])
def test_remote_prefill_waits_then_runs(model: Path, num_tokens: int) -> None:
    scheduler = make_scheduler(model, "kv_consumer")
    total = free_blocks(scheduler) + 1
    request = make_request(num_tokens, params=remote(num_tokens))
    scheduler.add_request(request)

    output, _ = step(scheduler)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not output.num_scheduled_tokens  # nothing computed here
    (recv,) = meta_of(output).recvs
    blocks = request_blocks(scheduler, request.request_id)
    assert len(blocks) == -(-num_tokens // BLOCK_SIZE)
    assert recv.block_ids == tuple(blocks)
    assert (recv.room, recv.prefill) == (12345, PREFILL)

    for _ in range(3):  # not received yet: still waiting, blocks still its own
        step(scheduler)
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS

    step(scheduler, model_output([], finished_recving={request.request_id}))
    output, _ = step(scheduler, model_output([request]))
    assert request.status is RequestStatus.RUNNING
    # The whole prompt came from prefill; the last token is recomputed to sample.
    assert output.num_scheduled_tokens[request.request_id] == 1
    _, outputs = step(scheduler, model_output([request], token=EOS))
    (finished,) = outputs[0].outputs
    assert finished.finish_reason is FinishReason.STOP
    step(scheduler)
    assert_empty(scheduler, total)


def test_abort_during_transfer_keeps_blocks_until_released(model: Path) -> None:
    scheduler = make_scheduler(model, "kv_consumer")
    total = free_blocks(scheduler) + 1
    request = make_request(70, params=remote(70))
    scheduler.add_request(request)
    step(scheduler)
    held = free_blocks(scheduler)
    assert held == total - 1 - 3

    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    output, _ = step(scheduler)
    assert meta_of(output).aborts == [request.request_id]  # the worker aborts the room
    for _ in range(20):  # however long: no timeout hands the blocks back
        step(scheduler)
        assert free_blocks(scheduler) == held
    assert request.request_id in scheduler.requests

    # The worker reports it once kvconn's on_release fired with a proof.
    step(scheduler, model_output([], finished_recving={request.request_id}))
    assert_empty(scheduler, total)


def test_failed_transfer_is_recomputed(model: Path) -> None:
    scheduler = make_scheduler(model, "kv_consumer")
    request = make_request(70, params=remote(70))
    scheduler.add_request(request)
    step(scheduler)
    step(
        scheduler,
        model_output([], finished_recving={request.request_id}, failed_recving={request.request_id}),
    )
    output = scheduler.schedule()
    # vLLM's load-failure path: nothing taken from the failed transfer.
    assert output.num_scheduled_tokens[request.request_id] == 70
    scheduler.update_from_output(output, model_output([request]))


def test_failed_transfer_fails_the_request_under_fail_policy(model: Path) -> None:
    scheduler = make_scheduler(model, "kv_consumer", load_failure_policy="fail")
    request = make_request(70, params=remote(70))
    scheduler.add_request(request)
    step(scheduler)
    step(
        scheduler,
        model_output([], finished_recving={request.request_id}, failed_recving={request.request_id}),
    )
    assert request.is_finished()
    assert request.status is RequestStatus.FINISHED_ERROR


def test_malformed_params_are_computed_locally(model: Path) -> None:
    scheduler = make_scheduler(model, "kv_consumer")
    params = remote(40)
    params["kvconn_prefill"] = "not a list"
    request = make_request(40, params=params)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert not meta_of(output).recvs
    assert output.num_scheduled_tokens[request.request_id] == 40


def test_local_prefix_hit_asks_prefill_for_the_rest_only(model: Path) -> None:
    scheduler = make_scheduler(model, "kv_consumer")
    prompt = list(range(1, 3 * BLOCK_SIZE + 10))
    local = make_request(len(prompt), prompt=prompt)
    scheduler.add_request(local)
    step(scheduler, model_output([local], token=EOS))

    request = make_request(len(prompt), params=remote(len(prompt)), prompt=prompt)
    scheduler.add_request(request)
    output, _ = step(scheduler)
    (recv,) = meta_of(output).recvs
    blocks = request_blocks(scheduler, request.request_id)
    assert len(blocks) == 4
    # The three cached full blocks are shared; prefill writes the last one only.
    assert recv.block_ids == tuple(blocks[3:])


# -- prefill: remote decode -----------------------------------------------------
def prefill_scheduler(model: Path) -> Any:
    scheduler = make_scheduler(model, "kv_producer")
    scheduler.connector.set_xfer_handshake_metadata({0: KvconnHandshake(PREFILL[0])})
    return scheduler


@pytest.mark.parametrize("num_tokens", [BLOCK_SIZE // 2, 2 * BLOCK_SIZE, int(BLOCK_SIZE * 2.5)])
def test_remote_decode_keeps_blocks_until_sent(model: Path, num_tokens: int) -> None:
    scheduler = prefill_scheduler(model)
    total = free_blocks(scheduler) + 1
    request = make_request(num_tokens, max_tokens=1, params={"do_remote_decode": True})
    scheduler.add_request(request)
    output = scheduler.schedule()
    blocks = request_blocks(scheduler, request.request_id)
    outputs = scheduler.update_from_output(output, model_output([request]))
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    (finished,) = outputs[0].outputs
    params = RemotePrefill.from_params(finished.kv_transfer_params)
    engine_id = scheduler.vllm_config.kv_transfer_config.engine_id
    assert params == RemotePrefill(room_for(engine_id, request.request_id), PREFILL, num_tokens)

    output, _ = step(scheduler)
    (send,) = meta_of(output).sends
    assert send.room == params.room
    assert send.block_ids == tuple(blocks[: -(-num_tokens // BLOCK_SIZE)])
    for _ in range(5):  # the send has not settled: the blocks stay
        step(scheduler)
        assert request.request_id in scheduler.requests
    assert scheduler.has_requests()  # the engine keeps stepping for the send

    step(scheduler, model_output([], finished_sending={request.request_id}))
    assert_empty(scheduler, total)


def test_abort_at_prefill_sends_nothing(model: Path) -> None:
    scheduler = prefill_scheduler(model)
    total = free_blocks(scheduler) + 1
    request = make_request(70, max_tokens=1, params={"do_remote_decode": True})
    scheduler.add_request(request)
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    output, _ = step(scheduler)
    assert not meta_of(output).sends
    assert_empty(scheduler, total)


def test_rooms_differ_across_prefill_instances() -> None:
    assert room_for("engine-a", "req-1") != room_for("engine-b", "req-1")
    assert room_for("engine-a", "req-1") == room_for("engine-a", "req-1")
    assert 0 <= room_for("engine-a", "req-1") < 1 << 63
