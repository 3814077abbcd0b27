"""Two real vLLM engine processes (prefill, decode) on a tiny model, joined
by KvconnConnector over the loopback transport, against one plain engine.

These are the claims a user relies on: disaggregated serving gives the
same greedy tokens as one engine; decode's blocks hold prefill's bytes
exactly; and aborted transfers hand blocks back only with proof.
"""

from __future__ import annotations

import pytest
from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

from collections.abc import Iterator

from engine_harness import Engine, generate
from vllm_helpers import BLOCK_SIZE, make_tiny_llama

MAX_TOKENS = 8
#: Lengths around block boundaries: under one block, one short, exactly one,
#: one over, several.
PROMPTS = {
    f"p{n}": [(n * 31 + i * 17) % 500 + 1 for i in range(n)]
    for n in (5, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 70, 2 * BLOCK_SIZE, 100)
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine, Engine]]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    started = [Engine(model, None), Engine(model, "kv_producer"), Engine(model, "kv_consumer")]
    try:
        for engine in started:
            assert engine.info["pid"]
        yield started[0], started[1], started[2]
    finally:
        for engine in started:
            engine.close()


def test_disaggregated_tokens_and_blocks_equal_one_engines(engines: tuple[Engine, Engine, Engine]) -> None:
    single, prefill, decode = engines
    expected = generate(single, PROMPTS, MAX_TOKENS)
    prefilled = generate(prefill, PROMPTS, 1, {"do_remote_decode": True})
    decoded = generate(decode, PROMPTS, MAX_TOKENS, lambda r: prefilled[r]["kv_transfer_params"])
    for req_id, prompt in PROMPTS.items():
        assert len(expected[req_id]["tokens"]) == MAX_TOKENS
        assert decoded[req_id]["tokens"] == expected[req_id]["tokens"], req_id
        # The first token is sampled at both; greedy makes them one.
        assert prefilled[req_id]["tokens"] == expected[req_id]["tokens"][:1]
        blocks = prefilled[req_id]["blocks"]
        assert len(blocks) == -(-len(prompt) // BLOCK_SIZE)
        assert decoded[req_id]["received"] == blocks, req_id
    # Every block is back at both sides once the sends settled.
    for engine in (prefill, decode):
        free = engine.info["num_blocks"] - 1
        assert _eventually(lambda e=engine, n=free: e.stats()["free_blocks"] == n)


def _eventually(check: object, timeout_s: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False
