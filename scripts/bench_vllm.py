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
import ctypes
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

from engine_harness import Engine, generate
from vllm_helpers import make_tiny_llama

import conftest  # noqa: F401  (environment for vLLM before it is imported)

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


#: The hand-off of one room, as timed at the connector's hooks (the
#: harness's ``timeline``): (from, to, what happens between).
HANDOFF = (
    ("decode_asks", "prefill_has_request", "decode asks -> prefill's listener has the request"),
    ("prefill_has_request", "prefill_queued", "prefill: request -> chunk queued (Sender.send)"),
    ("prefill_queued", "prefill_dequeued", "queued -> a transport worker took it"),
    ("prefill_dequeued", "prefill_sends_status", "the write: post, barrier, ledger -> status sent"),
    ("prefill_sends_status", "decode_has_status", "status -> decode's listener has it"),
    ("decode_has_status", "decode_reports", "decode's listener -> its worker reports the room"),
    ("decode_asks", "decode_reports", "kvconn's share: decode asks -> reported received"),
)


def handoff(args: argparse.Namespace, model: Path) -> None:
    """kvconn's part of a P/D request's time to first token, timed at the
    connector's hooks, and the engines' steps, with vLLM stepping through
    idle steps (idle_wait_s 0, as before) and waiting them out (the
    default), side by side: one plain engine and a prefill/decode pair per
    setting, each request through every pair in turn."""
    configs = {"idle_wait_s=0": {"idle_wait_s": 0}, "idle_wait_s=5ms": {"idle_wait_s": 0.005}}
    if args.gil_switch_ms:
        configs[f"5ms + GIL {args.gil_switch_ms} ms"] = {"gil_switch_interval_s": args.gil_switch_ms / 1e3}
    plain = Engine(model, None)
    pairs = {
        name: (
            Engine(model, "kv_producer", timeline=True, **extra),
            Engine(model, "kv_consumer", timeline=True, **extra),
        )
        for name, extra in configs.items()
    }
    engines = [plain, *(e for pair in pairs.values() for e in pair)]
    try:
        for e in engines:
            assert e.info
        marks: dict[str, list[dict[str, float]]] = {name: [] for name in pairs}
        steps: dict[str, int] = {}
        for i in range(args.warmup + args.requests):
            if i == args.warmup:
                steps = {name: pair[0].call("steps") for name, pair in pairs.items()}
                steps["plain"] = plain.call("steps")
            p, rid = prompt(i, args.prompt_tokens), f"h{i}"
            want = generate(plain, {rid: p}, args.max_tokens, poll_s=0.002)[rid]["tokens"]
            for name, (pre, dec) in pairs.items():
                params = generate(pre, {rid: p}, 1, {"do_remote_decode": True}, poll_s=0.002)[rid][
                    "kv_transfer_params"
                ]
                got = generate(dec, {rid: p}, args.max_tokens, params, poll_s=0.002)[rid]["tokens"]
                assert got == want, "disaggregated tokens differ from one engine's"
                timeline = pre.call("handoff")
                for room, times in dec.call("handoff").items():
                    timeline.setdefault(room, {}).update(times)
                if i >= args.warmup:
                    marks[name].extend(timeline.values())
        plain_steps = plain.call("steps") - steps["plain"]
        for pre, _ in pairs.values():  # every send reported: the engines idle
            wait_until_idle(pre)
        counted = {name: pair[0].call("steps") - steps[name] for name, pair in pairs.items()}
        before = plain.call("steps")
        for i in range(args.warmup, args.warmup + args.requests):
            generate(plain, {f"o{i}": prompt(i, args.prompt_tokens)}, 1, poll_s=0.002)
        prefill_only = plain.call("steps") - before
        _print_handoff(args, marks, counted, plain_steps, prefill_only)
    finally:
        for e in engines:
            e.close()


def wait_until_idle(engine: Engine, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.stats()["requests"]:
        assert time.monotonic() < deadline, "the prefill engine kept requests"
        time.sleep(0.01)


def _print_handoff(
    args: argparse.Namespace,
    marks: dict[str, list[dict[str, float]]],
    steps: dict[str, int],
    plain_steps: int,
    prefill_only: int,
) -> None:
    n = args.requests
    block_bytes = 2 * 2 * 2 * 32 * 64 * 4  # the tiny model: layers x K/V x heads x tokens x head_dim x 4 B
    nbytes = -(-args.prompt_tokens // 32) * block_bytes
    src, dst = ctypes.create_string_buffer(nbytes), ctypes.create_string_buffer(nbytes)
    t0 = time.perf_counter()
    for _ in range(100):
        ctypes.memmove(dst, src, nbytes)
    copy_us = (time.perf_counter() - t0) / 100 * 1e6
    print(f"{n} requests one at a time, {args.prompt_tokens}-token prompts ({nbytes >> 10} KiB of KV each)")
    print(
        f"  engine steps: plain engine, {args.max_tokens} tokens each {plain_steps}; prefill only {prefill_only}"
    )
    for name, count in steps.items():
        print(
            f"  P/D prefill engine, {name:<18} {count:6d} steps "
            f"({count / plain_steps:5.2f}x plain, {count / prefill_only:5.2f}x prefill only)"
        )
    names = list(marks)
    print("  hand-off, median ms " + "".join(f"{name:>20}" for name in names))
    for start, end, what in HANDOFF:
        cells = []
        for name in names:
            spans = [m[end] - m[start] for m in marks[name] if start in m and end in m]
            cells.append(f"{statistics.median(spans) * 1e3:20.2f}" if spans else f"{'-':>20}")
        print(f"  {what:<52}" + "".join(cells))
        if end == "prefill_queued":  # one call on one thread: its CPU time, against its wall time
            cpu = [
                statistics.median(m["prefill_request_cpu"] for m in marks[name] if "prefill_request_cpu" in m)
                for name in names
            ]
            print(
                f"  {'  of which CPU of the listener thread':<52}" + "".join(f"{c * 1e3:20.2f}" for c in cpu)
            )
    print(f"  (a memmove of the same {nbytes >> 10} KiB here: {copy_us:.0f} us)")


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
    parser.add_argument(
        "--handoff",
        action="store_true",
        help="kvconn's part of time to first token at the connector's hooks, and engine steps",
    )
    parser.add_argument(
        "--gil-switch-ms", type=float, default=0.0, help="with --handoff: a third pair with it"
    )
    args = parser.parse_args()
    if args.proxy:
        proxy_overhead(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny-llama")
        if args.handoff:
            handoff(args, model)
            return
        latency(args, model)
        if args.aborts and not args.builtin_nixl:
            aborts(args, model)


if __name__ == "__main__":
    main()
