"""Prefill faults over NIXL and Mooncake (DRAM) with two real vLLM engines.

These transports write a request's few blocks in microseconds, so the fault
comes between prefill finishing a request and decode asking for it: decode's
request meets a frozen or dead prefill, decode gives the room up after
``transfer_timeout_s``, and its blocks come back only with proof (a late ack
once thawed, or the writer's exit), never on that timeout.
"""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

import os
import signal
from collections.abc import Iterator

from engine_harness import Engine, generate
from test_e2e_faults import DEADLINES, PROMPT, wait_for
from vllm_helpers import make_tiny_llama

from kvconn.plugins import BackendError, get_backend

MAX_TOKENS = 4


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    backend = request.param
    try:
        get_backend(backend)
    except BackendError as exc:
        pytest.skip(f"backend {backend} is not installed here: {exc}")
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    # Mooncake may take 10 s to fail a write: decode's abort deadline must be longer.
    deadlines = dict(DEADLINES)
    if backend == "mooncake":
        deadlines.update(write_timeout_s=9.0, abort_timeout_s=12.0)
    prefill = Engine(model, "kv_producer", backend=backend, **deadlines)
    decode = Engine(model, "kv_consumer", backend=backend, transfer_timeout_s=3.0, **deadlines)
    try:
        assert prefill.info["pid"] and decode.info["pid"]
        # One request through, so decode knows this prefill instance.
        warm = generate(prefill, {"warm": PROMPT}, 1, {"do_remote_decode": True})["warm"]
        out = generate(decode, {"warm": PROMPT}, MAX_TOKENS, warm["kv_transfer_params"])["warm"]
        assert "received" in out, "the warm-up request was not transferred"
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def prefilled(prefill: Engine, req_id: str) -> dict[str, object]:
    return generate(prefill, {req_id: PROMPT}, 1, {"do_remote_decode": True})[req_id]


def test_frozen_prefill_quarantines_then_releases_after_sigcont(cluster: tuple[Engine, Engine]) -> None:
    prefill, decode = cluster
    out = prefilled(prefill, "frozen")
    free = decode.stats()["free_blocks"]
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        decode.add("frozen", PROMPT, MAX_TOKENS, out["kv_transfer_params"])  # type: ignore[arg-type]
        # transfer_timeout_s (3 s) gives the room up; abort_timeout_s more: quarantined.
        wait_for(lambda: decode.stats()["held"].get("frozen") == "quarantined", 40, "quarantine")
        for _ in range(5):
            assert decode.stats()["free_blocks"] == free - 4
            assert decode.stats()["held"].get("frozen") == "quarantined"
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    # Thawed, prefill acks the abort (nothing was written): blocks back, then
    # the request is recomputed at decode.
    done = decode.finished(60.0, "frozen")["frozen"]
    assert done["tokens"][0] == out["tokens"][0]  # type: ignore[index]
    wait_for(lambda: decode.stats()["free_blocks"] == free, 30, "blocks back")
    assert decode.stats()["proofs"].get("late_acks", 0) >= 1


def test_killed_prefill_blocks_back_by_exit_proof(cluster: tuple[Engine, Engine]) -> None:
    prefill, decode = cluster
    out = prefilled(prefill, "killed")
    free = decode.stats()["free_blocks"]
    os.kill(prefill.pid, signal.SIGKILL)
    prefill.process.join(timeout=30)
    decode.add("killed", PROMPT, MAX_TOKENS, out["kv_transfer_params"])  # type: ignore[arg-type]
    done = decode.finished(60.0, "killed")["killed"]
    assert done["tokens"][0] == out["tokens"][0]  # type: ignore[index]
    # Killed before decode asked it: decode's control link to it is lost
    # first, so the request is held back, the rank found gone, and nothing
    # sent needs no proof (nothing_sent); had decode sent it already, the
    # proven exit releases it (writer_exit).
    proofs = decode.stats()["proofs"]
    assert proofs.get("writer_exit", 0) + proofs.get("nothing_sent", 0) >= 1, proofs
    wait_for(lambda: decode.stats()["free_blocks"] == free, 30, "blocks back")
