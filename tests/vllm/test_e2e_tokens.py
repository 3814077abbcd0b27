"""Two real vLLM engine processes (prefill, decode) on a tiny model, joined
by KvconnConnector, against one plain engine: over loopback always, and
over NIXL and Mooncake (DRAM) where their plugins are installed.

These are the claims a user relies on: disaggregated serving gives the
same greedy tokens as one engine, and decode's blocks hold prefill's bytes
exactly; afterwards every block is back at both sides.
"""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

import time
from collections.abc import Callable, Iterator
from pathlib import Path

from engine_harness import Engine, generate
from vllm_helpers import BLOCK_SIZE, make_tiny_llama

from kvconn.plugins import BackendError, get_backend

MAX_TOKENS = 8
#: Lengths around block boundaries: under one block, one short, exactly one,
#: one over, several.
PROMPTS = {
    f"p{n}": [(n * 31 + i * 17) % 500 + 1 for i in range(n)]
    for n in (5, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 70, 2 * BLOCK_SIZE, 100)
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def expected(model: Path) -> dict[str, list[int]]:
    """One plain engine's greedy tokens."""
    single = Engine(model, None)
    try:
        return {r: out["tokens"] for r, out in generate(single, PROMPTS, MAX_TOKENS).items()}
    finally:
        single.close()


@pytest.fixture(scope="module", params=["loopback", "nixl", "mooncake"])
def pair(request: pytest.FixtureRequest, model: Path) -> Iterator[tuple[Engine, Engine]]:
    backend = request.param
    try:
        get_backend(backend)
    except BackendError as exc:
        pytest.skip(f"backend {backend} is not installed here: {exc}")
    prefill, decode = (
        Engine(model, "kv_producer", backend=backend),
        Engine(model, "kv_consumer", backend=backend),
    )
    try:
        assert prefill.info["pid"] and decode.info["pid"]
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_disaggregated_tokens_and_blocks_equal_one_engines(
    pair: tuple[Engine, Engine], expected: dict[str, list[int]]
) -> None:
    prefill, decode = pair
    prefilled = generate(prefill, PROMPTS, 1, {"do_remote_decode": True})
    decoded = generate(decode, PROMPTS, MAX_TOKENS, lambda r: prefilled[r]["kv_transfer_params"])
    for req_id, prompt in PROMPTS.items():
        assert len(expected[req_id]) == MAX_TOKENS
        assert decoded[req_id]["tokens"] == expected[req_id], req_id
        # The first token is sampled at both; greedy makes them one.
        assert prefilled[req_id]["tokens"] == expected[req_id][:1]
        blocks = prefilled[req_id]["blocks"]
        assert len(blocks) == -(-len(prompt) // BLOCK_SIZE)
        assert decoded[req_id]["received"] == blocks, req_id
    # Every block is back at both sides once the sends settled.
    for engine in (prefill, decode):
        free = engine.info["num_blocks"] - 1
        assert _eventually(lambda e=engine, n=free: e.stats()["free_blocks"] == n)


def _eventually(check: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False
