"""Aborts and prefill faults with two real vLLM engines: decode's blocks go
back to vLLM's allocator only with a proof that no write can still land.

The prefill writes slowly (loopback's ``piece_delay_s``) so each transfer
is in flight for a second or more; deadlines are short (a chunk's write
timeout 2.5 s at prefill, decode's abort deadline 3 s) so the tests wait
for them, bounded, instead of for production values.
"""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

import functools
import os
import signal
import time
from collections.abc import Iterator

from engine_harness import Engine, generate
from vllm_helpers import make_tiny_llama

from kvconn.testing import waiting

#: 100 tokens: 4 blocks of 64 KiB (2 layers x 2 heads x (32 K + 32 V rows) x
#: 64 x 4 bytes) = 256 KiB, written in 8 KiB pieces 0.05 s apart: ~1.6 s.
PROMPT = [(i * 13) % 500 + 1 for i in range(100)]
SLOW = {"piece_bytes": "8192", "piece_delay_s": "0.05"}
DEADLINES = {"write_timeout_s": 2.5, "abort_timeout_s": 3.0, "resend_interval_s": 0.5}
MAX_TOKENS = 4


#: kvconn.testing's wait, polling the engines' stats no more than every 20 ms.
wait_for = functools.partial(waiting.wait_for, poll=0.02)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    prefill = Engine(model, "kv_producer", backend_options=SLOW, **DEADLINES)
    decode = Engine(model, "kv_consumer", transfer_timeout_s=4.0, **DEADLINES)
    try:
        assert prefill.info["pid"] and decode.info["pid"]
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


_seq = iter(range(10**6))
#: The token prefill sampled for PROMPT, each time (greedy: always one).
FIRST_TOKENS: list[int] = []


def start_transfer(prefill: Engine, decode: Engine) -> tuple[str, list[int], int]:
    """A request prefilled, then sent to decode; returns once decode's blocks
    for it are allocated and the (slow) write is under way."""
    req_id = f"r{next(_seq)}"
    prefilled = generate(prefill, {req_id: PROMPT}, 1, {"do_remote_decode": True})[req_id]
    FIRST_TOKENS.append(prefilled["tokens"][0])
    params = prefilled["kv_transfer_params"]
    free_before = decode.stats()["free_blocks"]
    decode.add(req_id, PROMPT, MAX_TOKENS, params)
    wait_for(lambda: decode.stats()["free_blocks"] < free_before, 30, "decode allocated the request's blocks")
    blocks = decode.call("blocks", req_id)
    assert len(blocks) == 4
    time.sleep(0.3)  # a few pieces in: the write is in flight
    return req_id, blocks, free_before


def test_abort_mid_transfer_holds_blocks_until_proof(cluster: tuple[Engine, Engine]) -> None:
    prefill, decode = cluster
    req_id, blocks, free_before = start_transfer(prefill, decode)
    held = decode.stats()["free_blocks"]
    aborted_at = time.monotonic()
    decode.call("abort", req_id)
    # The room is held (the write still runs) and vLLM did not get its blocks.
    wait_for(lambda: req_id in decode.stats()["held"], 10, "the worker aborted the room")
    assert decode.stats()["held"][req_id] == "held"
    assert decode.stats()["free_blocks"] == held

    wait_for(lambda: decode.stats()["free_blocks"] == free_before, 30, "blocks back after proof")
    released_after = time.monotonic() - aborted_at
    assert req_id not in decode.stats()["held"]
    proofs = decode.stats()["proofs"]
    # The writer's ack, or its ack after its own fence: proofs, never a clock.
    assert proofs.get("acks", 0) + proofs.get("writer_fence", 0) >= 1, proofs
    assert "unsafe_timeout" not in proofs
    # The next request's KV in those blocks: no late byte of the aborted
    # transfer lands on it (the whole transfer would take ~1.6 s).
    decode.call("fill", blocks, 0xAB)
    canary = decode.call("digests", blocks)
    time.sleep(max(0.0, 2.0 - released_after))
    assert decode.call("digests", blocks) == canary


def test_frozen_prefill_is_quarantined_never_freed_by_timeout(cluster: tuple[Engine, Engine]) -> None:
    prefill, decode = cluster
    req_id, _, free_before = start_transfer(prefill, decode)
    held = decode.stats()["free_blocks"]
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        decode.call("abort", req_id)
        # Past decode's abort deadline (3 s) with no proof: quarantined.
        wait_for(lambda: decode.stats()["held"].get(req_id) == "quarantined", 15, "quarantine")
        for _ in range(10):  # and it stays so, blocks allocated
            assert decode.stats()["free_blocks"] == held
            assert decode.stats()["held"].get(req_id) == "quarantined"
            time.sleep(0.1)
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    # Thawed, the writer finishes or fails its chunk and acks: blocks back.
    wait_for(lambda: decode.stats()["free_blocks"] == free_before, 30, "blocks back after SIGCONT")
    proofs = decode.stats()["proofs"]
    assert proofs.get("late_acks", 0) + proofs.get("writer_fence", 0) >= 1, proofs


def test_killed_prefill_blocks_back_by_exit_proof_and_request_recomputed(
    cluster: tuple[Engine, Engine],
) -> None:
    prefill, decode = cluster
    req_id, _, free_before = start_transfer(prefill, decode)
    os.kill(prefill.pid, signal.SIGKILL)
    prefill.process.join(timeout=30)
    # Decode gives the room up after transfer_timeout_s, gets its blocks back
    # by the writer's exit, and recomputes the request itself.
    out = decode.finished(60.0, req_id)[req_id]
    assert len(out["tokens"]) == MAX_TOKENS
    assert out["tokens"][0] == FIRST_TOKENS[-1]  # recomputed from the prompt alone
    assert decode.stats()["proofs"].get("writer_exit", 0) >= 1
    wait_for(lambda: decode.stats()["free_blocks"] == free_before, 30, "every block back")
