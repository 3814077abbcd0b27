"""Unequal tensor parallelism with real vLLM engines: a prefill engine with
TP 2 (two vLLM worker processes, each a kvconn prefill rank holding one of
the tiny model's two KV heads) into a decode engine with TP 1.

Claims: greedy tokens equal one plain engine's; each KV head decode received
is byte-equal to that head at the prefill rank that holds it; an abort while
one prefill rank is frozen holds decode's blocks until that rank, too, gave
its proof. Slow (three engines, one of them three processes, on a small
machine): ``pytest -m slow tests/vllm/test_e2e_unequal_tp.py``.
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
from vllm_helpers import BLOCK_SIZE, TINY_LLAMA, make_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MAX_TOKENS = 6
PROMPTS = {f"p{n}": [(n * 29 + i * 11) % 500 + 1 for i in range(n)] for n in (7, BLOCK_SIZE, 70)}
#: The abort's transfer: 100 tokens, 4 blocks; each rank writes its half
#: (128 KiB) in 8 KiB pieces 0.05 s apart, so the write is in flight ~0.8 s.
#: (SLOW, DEADLINES: test_e2e_faults's.)
SLOW_PROMPT = [(i * 13) % 500 + 1 for i in range(100)]
START_S = 600.0  # engine start-up under load on two shared cores


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
def tp2_into_tp1(model: Path, expected: dict[str, list[int]]) -> Iterator[tuple[Engine, Engine]]:
    prefill = Engine(model, "kv_producer", start_timeout_s=START_S, tp=2, backend_options=SLOW, **DEADLINES)
    decode = Engine(model, "kv_consumer", start_timeout_s=START_S, transfer_timeout_s=20.0, **DEADLINES)
    try:
        assert prefill.info["pid"] and decode.info["pid"]
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_tp2_prefill_into_tp1_decode_tokens_and_heads_equal(
    tp2_into_tp1: tuple[Engine, Engine], expected: dict[str, list[int]]
) -> None:
    prefill, decode = tp2_into_tp1
    prefilled = generate(prefill, PROMPTS, 1, {"do_remote_decode": True})
    for out in prefilled.values():  # both ranks' addresses, in rank order
        assert len(out["kv_transfer_params"]["kvconn_prefill"]) == 2
    decoded = generate(decode, PROMPTS, MAX_TOKENS, lambda r: prefilled[r]["kv_transfer_params"])
    heads = TINY_LLAMA["num_key_value_heads"]
    for req_id, prompt in PROMPTS.items():
        assert decoded[req_id]["tokens"] == expected[req_id], req_id
        assert prefilled[req_id]["tokens"] == expected[req_id][:1], req_id
        sent, received = prefilled[req_id]["heads"], decoded[req_id]["received_heads"]
        # Every (layer, block, head): 2 layers x blocks x 2 heads, from both ranks.
        assert len(sent) == TINY_LLAMA["num_hidden_layers"] * -(-len(prompt) // BLOCK_SIZE) * heads
        assert received == sent, req_id
    for engine in (prefill, decode):
        free = engine.info["num_blocks"] - 1
        wait_for(lambda e=engine, n=free: e.stats()["free_blocks"] == n, 60, f"{engine.role}: blocks back")


def test_abort_held_until_every_prefill_ranks_proof(tp2_into_tp1: tuple[Engine, Engine]) -> None:
    """Rank 1 frozen mid-write: rank 0's ack alone does not free decode's
    blocks, nor does decode's deadline (quarantine); rank 1's does."""
    prefill, decode = tp2_into_tp1
    rank_pids = prefill.call("rank_pids")
    assert len(rank_pids) == 2 and prefill.pid not in rank_pids
    prefilled = generate(prefill, {"slow": SLOW_PROMPT}, 1, {"do_remote_decode": True})["slow"]
    free_before = decode.stats()["free_blocks"]
    decode.add("slow", SLOW_PROMPT, MAX_TOKENS, prefilled["kv_transfer_params"])
    wait_for(lambda: decode.stats()["free_blocks"] < free_before, 60, "decode allocated the blocks")
    held = decode.stats()["free_blocks"]
    os.kill(rank_pids[1], signal.SIGSTOP)
    try:
        time.sleep(0.2)  # rank 0's write is under way
        decode.call("abort", "slow")
        wait_for(lambda: decode.stats()["held"].get("slow") == "quarantined", 30, "quarantined")
        for _ in range(10):  # past decode's deadline, still held: rank 1 gave no proof
            assert decode.stats()["free_blocks"] == held
            time.sleep(0.1)
    finally:
        os.kill(rank_pids[1], signal.SIGCONT)
    wait_for(lambda: decode.stats()["free_blocks"] == free_before, 60, "blocks back after rank 1's proof")
    proofs = decode.stats()["proofs"]
    assert proofs.get("late_acks", 0) + proofs.get("writer_fence", 0) >= 1, proofs
    assert "unsafe_timeout" not in proofs
