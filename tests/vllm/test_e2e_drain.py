"""Draining real vLLM engines while a transfer is in flight. Prefill: the
room in flight completes, the engine's kvconn rank then refuses new rooms,
and decode recomputes the next request at once (no timeout) and gets every
block back. Decode: vLLM's shutdown of its connector aborts the room and
waits for prefill's proof before it closes. Three engines on the tiny
model: ``slow``. (SIGTERM to the OpenAI servers: test_e2e_http_drain.py.)"""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

import time
from collections.abc import Iterator
from pathlib import Path

from engine_harness import Engine, generate
from test_e2e_faults import DEADLINES, MAX_TOKENS, PROMPT, SLOW, wait_for
from vllm_helpers import make_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def cluster(model: Path) -> Iterator[tuple[Engine, Engine]]:
    prefill = Engine(model, "kv_producer", backend_options=SLOW, **DEADLINES)
    decode = Engine(model, "kv_consumer", transfer_timeout_s=60.0, **DEADLINES)
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_a_decode_engine_shut_down_holding_a_room_gets_its_blocks_back_by_proof_before_close(
    cluster: tuple[Engine, Engine], model: Path
) -> None:
    """vLLM's shutdown of decode's connector while a room is in flight:
    kvconn aborts it and waits for prefill's proof (its in-flight write
    settled, then it acked) before it closes; nothing is held at close.
    (First in this module: the next test drains the prefill engine.)"""
    prefill, _ = cluster
    decode = Engine(model, "kv_consumer", transfer_timeout_s=60.0, **DEADLINES)
    free_before = decode.stats()["free_blocks"]
    params = generate(prefill, {"c": PROMPT}, 1, {"do_remote_decode": True})["c"]["kv_transfer_params"]
    decode.add("c", PROMPT, MAX_TOKENS, params)
    wait_for(lambda: decode.stats()["free_blocks"] < free_before, 60, "decode allocated c's blocks")
    time.sleep(0.3)  # the write (~1.6 s) is in flight
    try:
        shut = decode.call("shutdown", timeout_s=60)
    finally:
        decode.close()
    [report] = shut["reports"]
    print(f"\nvLLM decode engine's connector drained={report['drained']} in {shut['seconds']:.3f} s")
    assert report["drained"] and report["rooms_left"] == 0 and report["pages_left"] == 0
    assert shut["held_pages"] == 0
    assert sum(shut["proofs"].values()) == 1 and "unsafe_timeout" not in shut["proofs"]


def test_draining_a_prefill_engine_finishes_its_transfer_and_decode_recomputes_the_next(
    cluster: tuple[Engine, Engine],
) -> None:
    prefill, decode = cluster
    free_before = decode.stats()["free_blocks"]
    first = generate(prefill, {"a": PROMPT}, 1, {"do_remote_decode": True})["a"]
    decode.add("a", PROMPT, MAX_TOKENS, first["kv_transfer_params"])
    wait_for(lambda: decode.stats()["free_blocks"] < free_before, 30, "decode allocated a's blocks")
    time.sleep(0.3)  # a few pieces in: the write (~1.6 s) is in flight
    [report] = prefill.call("drain", 20.0, timeout_s=60)
    print(f"\nvLLM prefill engine drained={report['drained']} in {report['seconds']:.3f} s (grace 20 s)")
    assert report["drained"] and report["rooms_left"] == 0
    out = decode.finished(60.0, "a")["a"]
    assert out["tokens"][0] == first["tokens"][0] and len(out["tokens"]) == MAX_TOKENS
    assert "received" in out  # its blocks came over kvconn, not recomputed
    # The drained engine still answers HTTP-less requests here, but its rank
    # refuses the room: decode recomputes at once, well before any deadline.
    second = generate(prefill, {"b": PROMPT}, 1, {"do_remote_decode": True})["b"]
    started = time.monotonic()
    decode.add("b", PROMPT, MAX_TOKENS, second["kv_transfer_params"])
    out = decode.finished(60.0, "b")["b"]
    assert out["tokens"][0] == first["tokens"][0] and "received" not in out
    assert time.monotonic() - started < 30  # transfer_timeout_s is 60
    wait_for(lambda: decode.stats()["free_blocks"] == free_before, 30, "every block back")
    assert decode.stats()["held"] == {}
