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
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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


def _start(command: list[str]) -> tuple[subprocess.Popen[str], int]:
    """A process that prints its port first."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _cpu_s(pid: int) -> float:
    """CPU time of a process so far, all its threads, ended ones too."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Client:
    """Posts JSON over one kept connection per port, or a new one each time."""

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.conns: dict[int, http.client.HTTPConnection] = {}

    def post(self, port: int, payload: dict[str, object]) -> bytes:
        conn = self.conns.pop(port, None) or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {"Connection": "keep-alive" if self.keep_alive else "close"}
        conn.request("POST", "/v1/completions", json.dumps(payload), headers)
        response = conn.getresponse()
        data = response.read()
        assert response.status == 200, data
        if self.keep_alive and not response.will_close:
            self.conns[port] = conn
        else:
            conn.close()
        return data

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()


def proxy_overhead(args: argparse.Namespace) -> None:
    """kvconn-vllm-proxy against direct requests: the same two legs, sent by
    the client itself (prefill, then decode with its params) or by the
    proxy, alternately, to stand-in engines in their own processes."""
    standin = str(Path(__file__).resolve().parent.parent / "tests" / "vllm" / "standin_engine.py")
    prefill, prefill_port = _start([sys.executable, standin])
    decode, decode_port = _start([sys.executable, standin])
    engines = ["--prefill", f"http://127.0.0.1:{prefill_port}", "--decode", f"http://127.0.0.1:{decode_port}"]
    proxy = subprocess.Popen(
        [sys.executable, "-m", "kvconn_vllm.proxy", "--port", "0", *engines],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        proxy_port = int(proxy.stdout.readline().rsplit(":", 1)[1])
        print(
            f"kvconn-vllm-proxy vs direct, {args.proxy_requests} requests each, alternately, "
            "to stand-in engines (medians; the machine is shared: compare within a line)"
        )
        body = {"model": "tiny", "prompt": "w3 w4 w5", "max_tokens": 4}
        prefill_body = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        for keep_alive in (True, False):
            for stream in (False, True):
                client = _Client(keep_alive)
                asked = {**body, "stream": stream}

                def direct(client: _Client = client, asked: dict[str, object] = asked) -> None:
                    params = json.loads(client.post(prefill_port, prefill_body))["kv_transfer_params"]
                    client.post(decode_port, {**asked, "kv_transfer_params": params})

                def proxied(client: _Client = client, asked: dict[str, object] = asked) -> None:
                    client.post(proxy_port, asked)

                label = f"{'keep-alive' if keep_alive else 'a connection per request'}, "
                _proxy_line(args, label + ("streamed" if stream else "JSON"), direct, proxied, proxy.pid)
                client.close()
    finally:
        for proc in (proxy, prefill, decode):
            proc.terminate()
            proc.wait(10)


def _proxy_line(
    args: argparse.Namespace, label: str, direct: Callable[[], None], proxied: Callable[[], None], pid: int
) -> None:
    for _ in range(20):  # warm-up: connections, code paths
        direct()
        proxied()
    times: dict[str, list[float]] = {"direct": [], "proxied": []}
    # The proxy idles while the client sends direct: its CPU over the loop
    # is what the proxied requests cost it (to a clock tick or two).
    cpu = _cpu_s(pid)
    for _ in range(args.proxy_requests):
        for name, call in (("direct", direct), ("proxied", proxied)):
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    cpu = _cpu_s(pid) - cpu
    med = statistics.median
    d, p = med(times["direct"]) * 1e3, med(times["proxied"]) * 1e3
    print(
        f"  {label:<36} direct {d:6.2f} ms  proxied {p:6.2f} ms  overhead {p - d:6.2f} ms "
        f"(ratio {p / d:4.2f}); proxy CPU {cpu / args.proxy_requests * 1e3:.2f} ms/request"
    )


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
    parser.add_argument(
        "--proxy",
        action="store_true",
        help="only the proxy's own overhead, against stand-in engines (no vLLM needed)",
    )
    parser.add_argument("--proxy-requests", type=int, default=300)
    args = parser.parse_args()
    if args.proxy:
        proxy_overhead(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny-llama")
        latency(args, model)
        if args.aborts and not args.builtin_nixl:
            aborts(args, model)


if __name__ == "__main__":
    main()
