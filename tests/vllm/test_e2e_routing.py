"""One decode engine served by two prefill engines (per-request routing):
each request's ``kv_transfer_params`` name the prefill instance that
computed it, and decode's one kvconn endpoint, over its one registration of
vLLM's KV cache, fetches each from its own instance. Three real vLLM engine
processes on the tiny model, loopback transport."""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

import time
from pathlib import Path

from engine_harness import Engine, generate
from vllm_helpers import BLOCK_SIZE, make_tiny_llama

MAX_TOKENS = 8
PROMPTS = {f"p{n}": [(n * 29 + i * 13) % 500 + 1 for i in range(n)] for n in (7, BLOCK_SIZE + 1, 90)}


def test_two_prefill_instances_into_one_decode_give_one_engines_tokens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model: Path = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    engines = [
        Engine(model, None),
        Engine(model, "kv_producer"),
        Engine(model, "kv_producer"),
        Engine(model, "kv_consumer"),
    ]
    single, first, second, decode = engines
    try:
        expected = {r: out["tokens"] for r, out in generate(single, PROMPTS, MAX_TOKENS).items()}
        single.close()
        # Both instances compute every prompt, under their own request ids.
        by_instance = {"a": first, "b": second}
        prefilled = {}
        for tag, prefill in by_instance.items():
            prompts = {f"{tag}-{r}": p for r, p in PROMPTS.items()}
            prefilled.update(generate(prefill, prompts, 1, {"do_remote_decode": True}))
        assert first.info["address"] != second.info["address"]
        for tag, prefill in by_instance.items():
            for r in PROMPTS:
                assert prefilled[f"{tag}-{r}"]["kv_transfer_params"]["kvconn_prefill"] == [
                    prefill.info["address"]
                ]
        decode_prompts = {f"{tag}-{r}": p for tag in by_instance for r, p in PROMPTS.items()}
        decoded = generate(decode, decode_prompts, MAX_TOKENS, lambda r: prefilled[r]["kv_transfer_params"])
        for req_id in decode_prompts:
            assert decoded[req_id]["tokens"] == expected[req_id[2:]], req_id
            assert decoded[req_id]["received"] == prefilled[req_id]["blocks"], req_id
        stats = decode.stats()
        assert sorted(stats["instances"]) == sorted([[first.info["address"]], [second.info["address"]]])
        # Every decode block is back once the requests finished.
        free = decode.info["num_blocks"] - 1
        deadline = time.monotonic() + 30
        while decode.stats()["free_blocks"] != free:
            assert time.monotonic() < deadline, decode.stats()
            time.sleep(0.05)
    finally:
        for engine in engines:
            engine.close()
