"""Disaggregated serving through KvconnConnector vs one vLLM engine, on the
tiny random Llama the tests use (CPU; run with .venv-vllm/bin/python).

Prints, as ratios to one engine: time to first token and end-to-end
latency of requests sent one at a time (prefill engine, then decode engine,
as a proxy does); then aborts mid-transfer (slow loopback writes): blocks
held right after each abort and the time until vLLM has them back.

    .venv-vllm/bin/python scripts/bench_vllm.py --requests 8 --aborts 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "vllm"))

import conftest  # noqa: F401  (environment for vLLM before it is imported)
from engine_harness import Engine, generate
from vllm_helpers import make_tiny_llama

SLOW = {"piece_bytes": "8192", "piece_delay_s": "0.05"}


def prompt(i: int, n: int) -> list[int]:
    return [(i * 37 + j * 11) % 500 + 1 for j in range(n)]


def nixl_push(role: str, port: int) -> dict[str, object]:
    """vLLM's own NIXL connector in push mode, KV in host memory (CPU)."""
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"transfer_mode": "push"},
        "env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)},
    }


def latency(args: argparse.Namespace, model: Path) -> None:
    if args.builtin_nixl:
        engines = [
            Engine(model, None),
            Engine(model, "kv_producer", builtin=nixl_push("kv_producer", 5600)),
            Engine(model, "kv_consumer", builtin=nixl_push("kv_consumer", 5700)),
        ]
    else:
        engines = [Engine(model, None), Engine(model, "kv_producer"), Engine(model, "kv_consumer")]
    single, prefill, decode = engines
    try:
        for e in engines:
            assert e.info
        one_ttft, one_e2e, pd_ttft, pd_e2e, at_decode = [], [], [], [], []
        for i in range(args.warmup + args.requests):
            p = prompt(i, args.prompt_tokens)
            rid = f"q{i}"
            out = generate(single, {rid: p}, args.max_tokens)[rid]
            pre = generate(prefill, {rid: p}, 1, {"do_remote_decode": True})[rid]
            dec = generate(decode, {rid: p}, args.max_tokens, pre["kv_transfer_params"])[rid]
            assert dec["tokens"] == out["tokens"], "disaggregated tokens differ from one engine's"
            if i < args.warmup:
                continue
            one_ttft.append(out["first_token"] - out["added"])
            one_e2e.append(out["time"] - out["added"])
            pd_ttft.append(dec["first_token"] - pre["added"])
            pd_e2e.append(dec["time"] - pre["added"])
            # Decode's own part: ask prefill, receive, schedule, first forward.
            at_decode.append(dec["first_token"] - dec["added"])
        med = statistics.median
        label = "NIXL push P/D" if args.builtin_nixl else "kvconn P/D"
        print(f"{args.requests} requests, {args.prompt_tokens}-token prompts, {args.max_tokens} tokens each")
        print(
            f"  one engine      TTFT {med(one_ttft) * 1e3:8.1f} ms   e2e {med(one_e2e) * 1e3:8.1f} ms (median)"
        )
        print(f"  {label:<15} TTFT {med(pd_ttft) * 1e3:8.1f} ms   e2e {med(pd_e2e) * 1e3:8.1f} ms (median)")
        print(
            f"  ratio P/D / one TTFT {med(pd_ttft) / med(one_ttft):8.2f}      e2e {med(pd_e2e) / med(one_e2e):8.2f}"
        )
        print(f"  of P/D's TTFT, decode's part (request in -> first token): {med(at_decode) * 1e3:.1f} ms")
    finally:
        for e in engines:
            e.close()


def aborts(args: argparse.Namespace, model: Path) -> None:
    deadlines = {"write_timeout_s": 2.5, "abort_timeout_s": 3.0, "resend_interval_s": 0.5}
    prefill = Engine(model, "kv_producer", backend_options=SLOW, **deadlines)
    decode = Engine(model, "kv_consumer", **deadlines)
    try:
        assert prefill.info and decode.info
        held, back_s = [], []
        for i in range(args.aborts):
            p, rid = prompt(1000 + i, 100), f"a{i}"
            params = generate(prefill, {rid: p}, 1, {"do_remote_decode": True})[rid]["kv_transfer_params"]
            free = decode.stats()["free_blocks"]
            decode.add(rid, p, args.max_tokens, params)
            while decode.stats()["free_blocks"] == free:
                time.sleep(0.01)
            time.sleep(0.3)  # the slow write is under way
            decode.call("abort", rid)
            t0 = time.monotonic()
            held.append(free - decode.stats()["free_blocks"])
            while decode.stats()["free_blocks"] < free:
                time.sleep(0.005)
            back_s.append(time.monotonic() - t0)
        proofs = decode.stats()["proofs"]
        print(f"{args.aborts} aborts mid-transfer (100-token prompts, ~1.6 s slow loopback writes)")
        print(f"  blocks held right after abort: {held}")
        print(
            f"  abort -> blocks back: median {statistics.median(back_s) * 1e3:.0f} ms, "
            f"max {max(back_s) * 1e3:.0f} ms; proofs {proofs}"
        )
    finally:
        prefill.close()
        decode.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--aborts", type=int, default=5)
    parser.add_argument(
        "--builtin-nixl",
        action="store_true",
        help="vLLM's own NixlConnector (push, CPU buffer) instead of kvconn",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny-llama")
        latency(args, model)
        if args.aborts and not args.builtin_nixl:
            aborts(args, model)


if __name__ == "__main__":
    main()
