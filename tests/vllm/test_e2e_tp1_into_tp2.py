"""Unequal tensor parallelism the other way: a prefill engine with TP 1 (one
kvconn prefill rank holding both of the tiny model's KV heads) into a decode
engine with TP 2 (two vLLM worker processes, each a kvconn decode endpoint
over its own head). Each decode rank asks prefill's one rank for the room,
and that rank writes each its head slice of every block.

Claims: greedy tokens equal one plain engine's; each KV head each decode
rank received is byte-equal to that head at prefill; an abort while prefill
is frozen mid-write holds decode's blocks, on both ranks, past decode's
deadline until prefill's proof. Slow (three engines, one of them three
processes): ``pytest -m slow tests/vllm/test_e2e_tp1_into_tp2.py``.
"""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from engine_harness import Engine, generate
from test_e2e_faults import DEADLINES, SLOW, wait_for
from test_e2e_unequal_tp import MAX_TOKENS, PROMPTS, SLOW_PROMPT, START_S
from vllm_helpers import BLOCK_SIZE, TINY_LLAMA, make_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert TINY_LLAMA["num_key_value_heads"] >= 2, "TP 2 needs two KV heads"
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def expected(model: Path) -> dict[str, list[int]]:
    """One plain engine's greedy tokens (TP 1)."""
    single = Engine(model, None, start_timeout_s=START_S)
    try:
        return {r: out["tokens"] for r, out in generate(single, PROMPTS, MAX_TOKENS).items()}
    finally:
        single.close()


@pytest.fixture(scope="module")
def tp1_into_tp2(model: Path, expected: dict[str, list[int]]) -> Iterator[tuple[Engine, Engine]]:
    prefill = Engine(model, "kv_producer", start_timeout_s=START_S, backend_options=SLOW, **DEADLINES)
    decode = Engine(model, "kv_consumer", start_timeout_s=START_S, tp=2, transfer_timeout_s=20.0, **DEADLINES)
    try:
        assert prefill.info["pid"] and decode.info["pid"]
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_tp1_prefill_into_tp2_decode_tokens_and_heads_equal(
    tp1_into_tp2: tuple[Engine, Engine], expected: dict[str, list[int]]
) -> None:
    prefill, decode = tp1_into_tp2
    started = time.monotonic()
    prefilled = generate(prefill, PROMPTS, 1, {"do_remote_decode": True})
    for out in prefilled.values():  # one rank, asked by both decode ranks
        assert len(out["kv_transfer_params"]["kvconn_prefill"]) == 1
    decoded = generate(decode, PROMPTS, MAX_TOKENS, lambda r: prefilled[r]["kv_transfer_params"])
    print(f"\nTP 1 -> TP 2: {len(PROMPTS)} requests in {time.monotonic() - started:.1f} s")
    heads = TINY_LLAMA["num_key_value_heads"]
    for req_id, prompt in PROMPTS.items():
        assert decoded[req_id]["tokens"] == expected[req_id], req_id
        assert prefilled[req_id]["tokens"] == expected[req_id][:1], req_id
        sent, received = prefilled[req_id]["heads"], decoded[req_id]["received_heads"]
        # Every (layer, block, head): 2 layers x blocks x 2 heads, head r from decode rank r.
        assert len(sent) == TINY_LLAMA["num_hidden_layers"] * -(-len(prompt) // BLOCK_SIZE) * heads
        assert received == sent, req_id
    for engine in (prefill, decode):
        free = engine.info["num_blocks"] - 1
        wait_for(lambda e=engine, n=free: e.stats()["free_blocks"] == n, 60, f"{engine.role}: blocks back")


def test_abort_held_on_both_decode_ranks_until_prefills_proof(tp1_into_tp2: tuple[Engine, Engine]) -> None:
    """Prefill frozen mid-write: neither decode rank's blocks come back on
    decode's deadline (quarantine); prefill's late proof frees them."""
    prefill, decode = tp1_into_tp2
    prefilled = generate(prefill, {"slow": SLOW_PROMPT}, 1, {"do_remote_decode": True})["slow"]
    free_before = decode.stats()["free_blocks"]
    decode.add("slow", SLOW_PROMPT, MAX_TOKENS, prefilled["kv_transfer_params"])
    wait_for(lambda: decode.stats()["free_blocks"] < free_before, 60, "decode allocated the blocks")
    held = decode.stats()["free_blocks"]
    time.sleep(0.2)  # the write into both decode ranks is under way
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        decode.call("abort", "slow")
        wait_for(lambda: decode.stats()["held"].get("slow") == "quarantined", 30, "quarantined")
        for _ in range(10):  # past decode's deadline, still held: prefill gave no proof
            assert decode.stats()["free_blocks"] == held
            time.sleep(0.1)
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    wait_for(lambda: decode.stats()["free_blocks"] == free_before, 60, "blocks back after prefill's proof")
    proofs = decode.stats()["proofs"]
    # Each decode rank held its own blocks' heads, and each got its proof.
    assert proofs.get("late_acks", 0) + proofs.get("writer_fence", 0) >= 2, proofs
    assert "unsafe_timeout" not in proofs
