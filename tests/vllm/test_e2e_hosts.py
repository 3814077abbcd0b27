"""Two real vLLM engines on two hosts (kvconn.testing.hosts: network, PID and
mount namespaces of their own, joined by a bridge): prefill on ``prefill0``,
decode on ``decode``, over NIXL (UCX tcp, ``net_devices=<the host's
interface>``) and Mooncake (tcp, ``host=<the host's address>``).

* greedy tokens equal one engine's, and decode's blocks hold prefill's bytes;
* an abort mid-transfer holds decode's blocks until a proof (the prefill
  host's link is slowed to 2 Mbit/s so that the write is still on the wire);
* a partition of the prefill host mid-transfer holds them past decode's
  deadline, quarantined, never freed by a timeout; after the heal they come
  back by the writer's proof, and no late byte lands in them;
* a lost prefill host (link down, then every process of it killed: no proof
  can come) mid-transfer: the blocks stay quarantined until decode's owner
  fence (``owner_fence_after_s``), and come back by it.

Slow (five engine starts; on the shared 2-core VM about 4 minutes per
backend): ``.venv-vllm/bin/python -m pytest tests/vllm/test_e2e_hosts.py -m slow -s``
prints each step's seconds. Needs root.
"""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

import contextlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
from engine_harness import Engine, generate
from host_engine import HostEngine
from test_e2e_faults import PROMPT, wait_for
from test_e2e_tokens import MAX_TOKENS, PROMPTS
from vllm_helpers import make_tiny_llama

from kvconn.testing import hosts
from kvconn.testing.libraries import why_unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(hosts.unavailable()), reason=hosts.unavailable() or "n/a"),
]

#: Prefill's chunk deadline, decode's abort deadline (above the transport's
#: own longest write: Mooncake's engine timeout, set to its 5 s floor here).
DEADLINES = {
    "nixl": {"write_timeout_s": 2.5, "abort_timeout_s": 3.0, "resend_interval_s": 0.5},
    "mooncake": {"write_timeout_s": 4.5, "abort_timeout_s": 6.0, "resend_interval_s": 0.5},
}
ENV = {
    "nixl": {"NIXL_LOG_LEVEL": "WARN", "UCX_MODULES": "^ib"},
    "mooncake": {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_STATUS_TIMEOUT_SEC": "5", "MC_LOG_LEVEL": "ERROR"},
}
#: Decode fences as the page owner once a room has been quarantined this
#: long: past what a healed partition takes to bring its late ack here.
OWNER_FENCE_AFTER_S = 12.0
#: 2 Mbit/s: the 256 KiB of PROMPT's 4 blocks take about a second on the link.
SLOW_RATE = "2mbit"
_seq = itertools.count()


def options(backend: str, host: hosts.Host) -> dict[str, str]:
    return {"net_devices": host.iface} if backend == "nixl" else {"host": host.ip}


@attrs.frozen
class Pair:
    backend: str
    prefill: Engine
    decode: Engine
    fabric: hosts.Fabric

    @property
    def prefill_host(self) -> hosts.Host:
        return self.fabric["prefill0"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def expected(model: Path) -> dict[str, list[int]]:
    """One plain engine's greedy tokens (on this machine's own network)."""
    single = Engine(model, None)
    try:
        return {r: out["tokens"] for r, out in generate(single, PROMPTS, MAX_TOKENS).items()}
    finally:
        single.close()


@pytest.fixture(scope="module")
def fabric() -> Iterator[hosts.Fabric]:
    with hosts.hosts(("decode", "prefill0")) as made:
        yield made


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def pair(request: pytest.FixtureRequest, fabric: hosts.Fabric, model: Path) -> Iterator[Pair]:
    backend = request.param
    if why_unavailable(backend):
        pytest.skip(f"{backend}: {why_unavailable(backend)}")
    for host in fabric.hosts.values():
        host.heal()
    engines: list[Engine] = []
    started = time.monotonic()
    try:
        for role, name, extra in (
            ("kv_producer", "prefill0", {}),
            (
                "kv_consumer",
                "decode",
                {"transfer_timeout_s": 60.0, "owner_fence_after_s": OWNER_FENCE_AFTER_S},
            ),
        ):
            host = fabric[name]
            engines.append(
                HostEngine(
                    host,
                    model,
                    role,
                    env=ENV[backend],
                    backend=backend,
                    backend_options=options(backend, host),
                    host=host.ip,
                    **DEADLINES[backend],
                    **extra,
                )
            )
        prefill, decode = engines
        assert prefill.info["pid"] and decode.info["pid"]
        _say(f"{backend}: two engines up on two hosts in {time.monotonic() - started:.0f} s")
        yield Pair(backend, prefill, decode, fabric)
    finally:
        for engine in engines:
            engine.close()


def _say(line: str) -> None:
    print(f"\n[vllm across hosts] {line}", flush=True)


@contextlib.contextmanager
def slowed(host: hosts.Host) -> Iterator[None]:
    host.slow(SLOW_RATE)
    try:
        yield
    finally:
        host.unslow()


def test_tokens_across_hosts_equal_one_engines(pair: Pair, expected: dict[str, list[int]]) -> None:
    started = time.monotonic()
    prefilled = generate(pair.prefill, PROMPTS, 1, {"do_remote_decode": True})
    decoded = generate(pair.decode, PROMPTS, MAX_TOKENS, lambda r: prefilled[r]["kv_transfer_params"])
    for req_id in PROMPTS:
        assert decoded[req_id]["tokens"] == expected[req_id], req_id
        assert decoded[req_id]["received"] == prefilled[req_id]["blocks"], req_id
    # The request named prefill's rank on its host's address: it crossed the link.
    address = prefilled[next(iter(PROMPTS))]["kv_transfer_params"]
    assert pair.prefill_host.ip in str(address), address
    for engine in (pair.prefill, pair.decode):
        free = engine.info["num_blocks"] - 1
        wait_for(lambda e=engine, n=free: e.stats()["free_blocks"] == n, 30, "every block back")
    _say(f"{pair.backend}: {len(PROMPTS)} requests, tokens equal, in {time.monotonic() - started:.1f} s")


def _start_slow_transfer(pair: Pair) -> tuple[str, list[int], int, dict[str, Any]]:
    """A request prefilled, then asked by decode over the slowed link;
    returns once decode holds its blocks and the write is under way."""
    req_id = f"h{next(_seq)}"
    prefilled = generate(pair.prefill, {req_id: PROMPT}, 1, {"do_remote_decode": True})[req_id]
    free_before = pair.decode.stats()["free_blocks"]
    pair.decode.add(req_id, PROMPT, 4, prefilled["kv_transfer_params"])
    wait_for(lambda: pair.decode.stats()["free_blocks"] < free_before, 30, "decode allocated the blocks")
    blocks = pair.decode.call("blocks", req_id)
    assert len(blocks) == 4
    time.sleep(0.3)  # about a third of the write is on the wire
    return req_id, blocks, free_before, prefilled


def _no_late_bytes(pair: Pair, blocks: list[int], watch_s: float) -> None:
    """The next request's KV laid in the blocks stays as laid."""
    pair.decode.call("fill", blocks, 0xAB)
    canary = pair.decode.call("digests", blocks)
    time.sleep(watch_s)
    assert pair.decode.call("digests", blocks) == canary


def test_abort_mid_transfer_holds_blocks_until_proof(pair: Pair) -> None:
    decode = pair.decode
    proofs_before = dict(decode.stats()["proofs"])
    with slowed(pair.prefill_host):
        req_id, blocks, free_before, _ = _start_slow_transfer(pair)
        held = decode.stats()["free_blocks"]
        aborted = time.monotonic()
        decode.call("abort", req_id)
        # Still being written when aborted: held, and vLLM did not get the blocks.
        state = wait_for(lambda: decode.stats()["held"].get(req_id), 10, "the worker aborted the room")
        assert state == "held"
        assert decode.stats()["free_blocks"] == held
        wait_for(lambda: decode.stats()["free_blocks"] == free_before, 60, "blocks back after proof")
    back_s = time.monotonic() - aborted
    proofs = _new(decode.stats()["proofs"], proofs_before)
    assert set(proofs) <= {"acks", "late_acks", "writer_fence"} and proofs, proofs
    _no_late_bytes(pair, blocks, 2.0)
    _say(f"{pair.backend}: abort mid-transfer: blocks back {back_s:.2f} s after the abort, by {proofs}")


def test_partition_mid_transfer_quarantines_until_the_heal(pair: Pair) -> None:
    decode, victim = pair.decode, pair.prefill_host
    deadline = DEADLINES[pair.backend]["abort_timeout_s"]
    proofs_before = dict(decode.stats()["proofs"])
    with slowed(victim):
        req_id, blocks, free_before, _ = _start_slow_transfer(pair)
        held = decode.stats()["free_blocks"]
        victim.cut()
        try:
            aborted = time.monotonic()
            decode.call("abort", req_id)
            # No ABORT reaches the writer, no ack comes back: past decode's
            # deadline the room is quarantined, and stays so, blocks held.
            wait_for(lambda: decode.stats()["held"].get(req_id) == "quarantined", deadline + 15, "quarantine")
            quarantined_s = time.monotonic() - aborted
            while time.monotonic() < aborted + deadline + 3.0:
                stats = decode.stats()
                assert stats["held"].get(req_id) == "quarantined" and stats["free_blocks"] == held
                time.sleep(0.2)
        finally:
            victim.heal()
        healed = time.monotonic()
        wait_for(lambda: decode.stats()["free_blocks"] == free_before, 60, "blocks back after the heal")
    back_after_heal = time.monotonic() - healed
    proofs = _new(decode.stats()["proofs"], proofs_before)
    # The writer's proof after the heal (the owner fence, should the ack take
    # longer than OWNER_FENCE_AFTER_S of quarantine): never a deadline.
    assert set(proofs) <= {"acks", "late_acks", "writer_fence", "owner_fence"} and proofs, proofs
    _no_late_bytes(pair, blocks, 3.0)
    # The engines serve on: the next request crosses the healed link.
    after = generate(pair.prefill, {"after": PROMPT}, 1, {"do_remote_decode": True})["after"]
    done = generate(pair.decode, {"after": PROMPT}, 4, after["kv_transfer_params"])["after"]
    assert done["received"] == after["blocks"]
    _say(
        f"{pair.backend}: partition mid-transfer: quarantined {quarantined_s:.1f} s after the abort "
        f"(deadline {deadline} s), held {healed - aborted:.1f} s until the heal, back "
        f"{back_after_heal:.2f} s after it, by {proofs}"
    )


def test_a_lost_prefill_host_gives_blocks_back_by_the_owner_fence(pair: Pair) -> None:
    """Last: the prefill host is gone for good (link down, then its
    processes killed: no FIN, no proof can ever come from it)."""
    decode, victim = pair.decode, pair.prefill_host
    deadline = DEADLINES[pair.backend]["abort_timeout_s"]
    proofs_before = dict(decode.stats()["proofs"])
    with slowed(victim):
        req_id, blocks, free_before, _ = _start_slow_transfer(pair)
        held = decode.stats()["free_blocks"]
        victim.lose()
    aborted = time.monotonic()
    decode.call("abort", req_id)
    wait_for(lambda: decode.stats()["held"].get(req_id) == "quarantined", deadline + 15, "quarantine")
    # Quarantined, blocks allocated, until the fence: no timeout frees them.
    while decode.stats()["held"].get(req_id) == "quarantined":
        assert decode.stats()["free_blocks"] == held
        assert time.monotonic() < aborted + deadline + OWNER_FENCE_AFTER_S + 60, "no owner fence"
        time.sleep(0.2)
    wait_for(lambda: decode.stats()["free_blocks"] == free_before, 30, "blocks back after the fence")
    back_s = time.monotonic() - aborted
    proofs = _new(decode.stats()["proofs"], proofs_before)
    assert proofs == {"owner_fence": 1}, proofs
    assert back_s >= deadline + OWNER_FENCE_AFTER_S  # quarantined that long first
    _no_late_bytes(pair, blocks, 2.0)
    _say(
        f"{pair.backend}: lost prefill host: blocks back {back_s:.1f} s after the abort by the owner fence "
        f"(deadline {deadline} s + owner_fence_after_s {OWNER_FENCE_AFTER_S} s)"
    )


def _new(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}
