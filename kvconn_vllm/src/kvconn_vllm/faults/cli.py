"""``kvconn-vllm-faults``: vLLM KV connectors through the same faults and the
same work, on real engines, in one run.

    kvconn-vllm-faults --connector NixlConnector --connector NixlPushConnector \\
        --connector kvconn:loopback --connector kvconn:nixl --markdown out.md

Run it where vLLM is installed (its venv). Prints the fault table and the
happy-path table; ``--require-clean PREFIX`` exits 1 when a row of a
connector whose label starts with PREFIX shows a corrupted block or a hung
request.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvconn_vllm.faults import connectors
from kvconn_vllm.faults.connectors import Connector, Ports
from kvconn_vllm.faults.engine import Engine, EngineError, EngineSpec
from kvconn_vllm.faults.happy import HappyResult, run_happy, serve_one
from kvconn_vllm.faults.pairs import Pair, finished, prefill_only
from kvconn_vllm.faults.report import fault_table, happy_table, record
from kvconn_vllm.faults.scenarios import FAULTS, FaultResult, FaultRun, Settings, prompt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvconn-vllm-faults", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--connector",
        action="append",
        help=f"{', '.join(connectors.BUILTIN)}, kvconn:BACKEND or CLASS@MODULE (repeat; default: all four)",
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="CONNECTOR:KEY=JSON",
        help="add KEY to that connector's kv_connector_extra_config",
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}; '' for none")
    parser.add_argument("--lease-s", type=int, default=connectors.DEFAULT_LEASE_S, help="every connector's lease / deadlines")
    parser.add_argument("--prompt-tokens", type=int, default=100, help="fault requests' prompt length")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--aborts", type=int, default=3, help="requests aborted in the abort fault")
    parser.add_argument("--happy", default="128,2048", help="happy-path prompt lengths; '' for none")
    parser.add_argument("--happy-requests", type=int, default=8, help="one at a time, per length and target")
    parser.add_argument("--happy-batches", type=int, default=2, help="batches of 8 at once, per length and target")
    parser.add_argument("--anchor", default="NixlConnector (pull)", help="the target happy-path ratios are taken to")
    parser.add_argument("--warmup", type=int, default=2, help="requests through each pair before anything is measured")
    parser.add_argument("--model", type=Path, help="a model directory (default: a tiny random Llama made here)")
    parser.add_argument("--no-plain", action="store_true", help="no one-engine reference: the first prefill computes it")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument("--json", type=Path, help="write everything measured here")
    parser.add_argument("--require-clean", action="append", default=[], metavar="PREFIX")
    return parser.parse_args(argv)


def _connectors(args: argparse.Namespace) -> list[Connector]:
    names = args.connector or list(connectors.BUILTIN)
    extras: dict[str, list[str]] = {}
    for item in args.extra:
        name, sep, setting = item.rpartition(":")
        if not sep or name not in names:
            raise connectors.ConnectorError(f"--extra {item!r}: expected CONNECTOR:KEY=VALUE, CONNECTOR one of {names}")
        extras.setdefault(name, []).append(setting)
    return [connectors.parse(n, connectors.parse_extra(extras.get(n, [])), args.lease_s) for n in names]


class References:
    """Greedy tokens of one engine, computed once per prompt."""

    def __init__(self, engine: Callable[[], Engine], max_tokens: int) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        self.cache: dict[tuple[int, ...], list[int]] = {}
        self._n = 0

    def __call__(self, tokens: list[int]) -> list[int]:
        key = tuple(tokens)
        if key not in self.cache:
            self._n += 1
            req_id = f"ref-{self._n}"
            self.cache[key] = serve_one(self.engine(), {req_id: tokens}, self.max_tokens, 300.0)[req_id]["tokens"]
        return self.cache[key]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = _connectors(args)
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        print(f"unknown faults {unknown}; known: {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvconn-vllm-faults-") as tmp:
        model = args.model or make_model(Path(tmp) / "tiny-llama")
        return _run(args, chosen, faults, model)


def make_model(path: Path) -> Path:
    from kvconn_vllm.faults.model import make_tiny_llama

    return make_tiny_llama(path)


def _run(args: argparse.Namespace, chosen: list[Connector], faults: list[str], model: Path) -> int:
    started = time.monotonic()
    base = EngineSpec(str(model))
    single = None if args.no_plain else Engine(attrs.evolve(base, name="one engine"))
    pairs = [Pair(c, Ports(_free_port(), _free_port()), base) for c in chosen]
    fault_results: list[FaultResult] = []
    happy_results: list[HappyResult] = []
    meta: dict[str, Any] = {"connectors": {c.label: c.settings() for c in chosen}, "faults": faults, "args": vars(args)}
    try:
        for engine in ([single] if single else []) + [e for p in pairs for e in (p.prefill, p.decode)]:
            assert engine.info
        meta["engines_up_s"] = round(time.monotonic() - started, 1)
        print(f"{len(pairs) * 2 + (single is not None)} engines up in {meta['engines_up_s']} s", flush=True)
        reference = References(lambda: single if single else pairs[0].prefill, args.max_tokens)
        for pair in pairs:  # handshakes, and a first check of each pair
            for i in range(args.warmup):
                tokens = prompt(900 + i, args.prompt_tokens)
                ref = reference(tokens)
                sent = prefill_only(pair, f"warm-{i}", tokens)
                pair.decode.add(f"warm-{i}", tokens, args.max_tokens, sent["kv_transfer_params"])
                event = finished(pair.decode, f"warm-{i}", 120)
                if event is None or event["tokens"] != ref:
                    print(f"{pair.label}: warm-up request {i}: {'no answer' if event is None else 'tokens differ'}")
        if single and args.happy:
            for length in (int(n) for n in args.happy.split(",")):
                for concurrency, rounds in ((1, args.happy_requests), (8, args.happy_batches)):
                    try:
                        h = run_happy(single, pairs, length, concurrency, rounds)
                    except EngineError as exc:
                        meta.setdefault("happy_failed", []).append(f"{length} x {concurrency}: {exc}")
                        print(f"happy path {length} x {concurrency} failed: {exc}", flush=True)
                        continue
                    happy_results.append(h)
                    print(happy_table([h], args.anchor), flush=True)
        settings = Settings(float(args.lease_s), args.prompt_tokens, args.max_tokens, args.aborts)
        for pair in pairs:
            run = FaultRun(pair, reference, settings)
            for fault in faults:
                try:
                    result = run.run(fault)
                except EngineError as exc:
                    result = FaultResult(pair.label, fault, notes=[f"the run failed: {exc}"])
                fault_results.append(result)
                print(fault_table([result]).splitlines()[-1], flush=True)
            if pair is not pairs[0] or single:  # the first prefill may compute references
                pair.close()
    finally:
        for pair in pairs:
            pair.close()
        if single:
            single.close()
    meta["seconds"] = round(time.monotonic() - started, 1)
    text = _text(fault_results, happy_results, args.anchor, meta)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(record(fault_results, happy_results, meta), indent=1, default=str))
    bad = [
        r
        for r in fault_results
        if any(r.connector.startswith(p) for p in args.require_clean)
        and (r.corrupted or r.hung or not r.requests)
    ]
    for r in bad:
        print(f"NOT CLEAN: {r.connector}, {r.fault}: corrupted {r.corrupted}, hung {r.hung}", file=sys.stderr)
    return 1 if bad else 0


def _text(faults: list[FaultResult], happy: list[HappyResult], anchor: str, meta: dict[str, Any]) -> str:
    parts = []
    if faults:
        parts += ["## Faults", "", fault_table(faults), ""]
    if happy:
        parts += ["## Happy path", "", happy_table(happy, anchor), ""]
    parts += ["## Settings", ""]
    parts += [f"- {label}: {settings}" for label, settings in meta["connectors"].items()]
    parts += ["", f"Run took {meta['seconds']} s (engines up in {meta.get('engines_up_s', '-')} s).", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
