"""The happy path on the same engines: time to first token and end to end,
one engine against each connector's pair, interleaved (each round sends
the same prompt(s) to every target, in an order rotated round by round)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import attrs

from kvconn_vllm.faults.engine import Engine, EngineError
from kvconn_vllm.faults.pairs import POLL_S, Pair
from kvconn_vllm.faults.scenarios import prompt

ONE_ENGINE = "one engine"


@attrs.define
class Timing:
    ttft: float
    e2e: float
    #: Of the TTFT, decode's own part: the request at decode to its first token.
    at_decode: float | None = None


@attrs.define
class HappyResult:
    prompt_tokens: int
    concurrency: int
    max_tokens: int
    timings: dict[str, list[Timing]] = attrs.field(factory=dict)
    #: Requests whose P/D tokens differed from one engine's, per target.
    mismatches: dict[str, int] = attrs.field(factory=dict)
    #: Requests with no answer within the round's time limit, per target.
    hung: dict[str, int] = attrs.field(factory=dict)
    #: CPU seconds the target's engine processes spent (every thread),
    #: and engine steps they took, per request measured: work, which a
    #: loaded machine turns into time but does not change.
    cpu_s: dict[str, float] = attrs.field(factory=dict)
    steps: dict[str, float] = attrs.field(factory=dict)

    def median(self, target: str, what: str) -> float | None:
        values = [getattr(t, what) for t in self.timings.get(target, []) if getattr(t, what) is not None]
        return statistics.median(values) if values else None


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, all its threads (ended ones too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _work(engines: list[Engine]) -> tuple[float, int]:
    """CPU seconds and engine steps of ``engines`` so far."""
    return sum(cpu_seconds(e.pid) for e in engines), sum(int(e.call("stats")["steps"]) for e in engines)


def _until_done(engines: list[Engine], done: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise EngineError(f"happy path: requests not finished within {timeout_s:g} s")
        for engine in engines:
            engine.poll()
        time.sleep(POLL_S)


def serve_one(engine: Engine, prompts: dict[str, list[int]], max_tokens: int, timeout_s: float) -> dict[str, Any]:
    for req_id, tokens in prompts.items():
        engine.add(req_id, tokens, max_tokens)
    _until_done([engine], lambda: all(r in engine.events for r in prompts), timeout_s)
    return {r: engine.events.pop(r) for r in prompts}


def serve_pair(pair: Pair, prompts: dict[str, list[int]], max_tokens: int, timeout_s: float) -> dict[str, Any]:
    """As a proxy does: each request to prefill, and to decode with prefill's
    params as soon as prefill answered it. The requests answered within
    ``timeout_s``; the others are aborted at both engines (a client giving
    up) and left out."""
    prefill, decode = pair.prefill, pair.decode
    for req_id, tokens in prompts.items():
        prefill.add(req_id, tokens, 1, {"do_remote_decode": True})
    waiting = set(prompts)
    deadline = time.monotonic() + timeout_s
    while waiting or not all(r in decode.events for r in prompts):
        if time.monotonic() > deadline:
            for req_id in prompts:
                if req_id not in decode.events:
                    engine = prefill if req_id in waiting else decode
                    engine.abort(req_id)
            break
        if waiting:
            for req_id in list(waiting):
                if req_id not in prefill.events:
                    prefill.poll()
                event = prefill.events.get(req_id)
                if event is not None:
                    decode.add(req_id, prompts[req_id], max_tokens, event["kv_transfer_params"])
                    waiting.discard(req_id)
        decode.poll()
        time.sleep(POLL_S)
    return {r: (prefill.events.pop(r), decode.events.pop(r)) for r in prompts if r in decode.events}


def run_happy(
    single: Engine,
    pairs: list[Pair],
    prompt_tokens: int,
    concurrency: int,
    rounds: int,
    max_tokens: int = 16,
    warmup: int = 1,
    timeout_s: float = 120.0,
) -> HappyResult:
    result = HappyResult(prompt_tokens, concurrency, max_tokens)
    targets: list[str] = [ONE_ENGINE, *(p.label for p in pairs)]
    by_label = {p.label: p for p in pairs}
    for target in targets:
        result.timings[target] = []
        result.mismatches[target] = 0
        result.hung[target] = 0
        result.cpu_s[target] = 0.0
        result.steps[target] = 0.0
    def engines(target: str) -> list[Engine]:
        return [single] if target == ONE_ENGINE else [by_label[target].prefill, by_label[target].decode]

    # Work over the whole run, idle stretches included (an engine that keeps
    # stepping for a send after its request was answered does it then).
    before = {target: _work(engines(target)) for target in targets}
    for round_ in range(warmup + rounds):
        base = 100_000 + prompt_tokens * 100 + round_ * concurrency
        prompts = {f"h{prompt_tokens}x{concurrency}-{round_}-{i}": prompt(base + i, prompt_tokens) for i in range(concurrency)}
        shift = round_ % len(targets)
        reference: dict[str, list[int]] = {}
        for target in targets[shift:] + targets[:shift]:
            ids = {f"{r}@{target}": p for r, p in prompts.items()}
            _serve_target(result, target, ids, single, by_label, max_tokens, timeout_s, reference, round_ >= warmup)
        for key, tokens in reference.items():
            if "#" in key:
                req_id, target = key.split("#")
                if tokens != reference.get(req_id.split("@")[0]):
                    result.mismatches[target] += 1
    served = (warmup + rounds) * concurrency
    for target in targets:
        cpu, steps = _work(engines(target))
        result.cpu_s[target] = (cpu - before[target][0]) / served
        result.steps[target] = (steps - before[target][1]) / served
    return result


def _serve_target(
    result: HappyResult,
    target: str,
    ids: dict[str, list[int]],
    single: Engine,
    by_label: dict[str, Pair],
    max_tokens: int,
    timeout_s: float,
    reference: dict[str, list[int]],
    measure: bool,
) -> None:
    """One round's requests to one target; their timings kept if ``measure``.
    ``reference`` gets each request's tokens: one engine's by prompt id,
    a pair's by ``"<prompt id>@<target>#<target>"``."""
    if target == ONE_ENGINE:
        for req_id, event in serve_one(single, ids, max_tokens, timeout_s).items():
            reference[req_id.split("@")[0]] = event["tokens"]
            if measure:
                result.timings[target].append(
                    Timing(event["first_token"] - event["added"], event["time"] - event["added"])
                )
        return
    served = serve_pair(by_label[target], ids, max_tokens, timeout_s)
    result.hung[target] += len(ids) - len(served)
    for req_id, (pre, dec) in served.items():
        reference[f"{req_id}#{target}"] = dec["tokens"]
        if measure:
            result.timings[target].append(
                Timing(dec["first_token"] - pre["added"], dec["time"] - pre["added"], dec["first_token"] - dec["added"])
            )
