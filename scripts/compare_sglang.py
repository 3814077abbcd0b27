"""SGLang 0.5.23's own transfer backends (mooncake, nixl), with
SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE on and off, beside kvconn's,
through the faults of ``kvconn-vllm-faults``, on real SGLang servers on CPU
(docs/sglang.md's recipe, the backend swapped; docs/comparison.md).

Run in SGLang's venv (scripts/setup-sglang-venv.sh):

    .venv-sglang/bin/python scripts/compare_sglang.py --markdown sglang.md

Each configuration gets a prefill and a decode server (started with
``--disable-radix-cache``, so a freed KV slot goes back to the allocator,
where the page watch of ``tests/sglang/own_backends_site`` canaries it);
one plain server gives the greedy tokens every answer is checked against.
Requests are posted to both servers with a bootstrap room, as SGLang's
router does. Faults act on the scheduler process of a server (SIGSTOP,
SIGCONT) or on its whole process group (SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "sglang"))

from sglang_servers import Process, Recipe, option, read_recipe  # noqa: E402
from tiny_model import make_tiny_llama  # noqa: E402

from kvconn.testing.cluster import free_port  # noqa: E402

SITE = ROOT / "tests" / "sglang" / "own_backends_site"
FAULTS = ("abort", "prefill_frozen", "decode_frozen", "prefill_killed", "prefill_restarted", "decode_killed")
CONFIGS = ("mooncake:on", "mooncake:off", "nixl:on", "nixl:off", "kvconn:off")
MAX_NEW = 8


def short_deadlines(lease_s: int) -> dict[str, str]:
    """SGLang's own deadlines, short so that each is reached within the run."""
    s = str(lease_s)
    return {
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": s,
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": s,
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": s,
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
        # kvconn's own (its SGLang adapter's settings): a write's deadline,
        # and decode's abort deadline (past it: quarantined, still held).
        "KVCONN_SGLANG_WRITE_TIMEOUT_S": "2.5",
        "KVCONN_SGLANG_ABORT_TIMEOUT_S": "3",
        "KVCONN_SGLANG_RESEND_INTERVAL_S": "0.5",
    }


def prompt(index: int, tokens: int = 100) -> list[int]:
    return [(index * 37 + j * 11 + (j * j) % 7) % 500 + 3 for j in range(tokens)]


class Posted:
    """A POST on a thread of its own."""

    def __init__(self, server: Process, path: str, body: Mapping[str, Any], timeout_s: float) -> None:
        self.answer: Any = None
        self.done_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(server, path, body, timeout_s), daemon=True)
        self._thread.start()

    def _run(self, server: Process, path: str, body: Mapping[str, Any], timeout_s: float) -> None:
        try:
            self.answer = server.post(path, body, timeout_s=timeout_s)
        except Exception as exc:
            self.answer = exc
        self.done_at = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()


class Pair:
    """A prefill and a decode server of one configuration."""

    def __init__(self, recipe: Recipe, config: str, root: Path, lease_s: int, model: Path) -> None:
        self.config = config
        backend, deferred = config.split(":")
        self.backend, self.deferred = backend, deferred == "on"
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        ports = {p: free_port() for p in recipe.ports()}
        self.recipe = recipe.bound(model, ports)
        self.env = {
            **os.environ,
            **self.recipe.env,
            **short_deadlines(lease_s),
            "PYTHONPATH": os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
            "KVCONN_PAGE_WATCH": str(root / "watch"),
            "KVCONN_SGLANG_TRANSPORT": "loopback",
            "MOONCAKE_PROTOCOL": "tcp",
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1" if self.deferred else "0",
        }
        self.starts = 0
        self.prefill = self._start("prefill")
        self.decode = self._start("decode")

    def label(self) -> str:
        backend = "kvconn (loopback)" if self.backend == "kvconn" else f"SGLang {self.backend}"
        return f"{backend}, deferred release {'on' if self.deferred else 'off'}"

    def _argv(self, role: str) -> tuple[str, ...]:
        argv = list(self.recipe.prefill if role == "prefill" else self.recipe.decode)
        argv[argv.index("--disaggregation-transfer-backend") + 1] = self.backend
        return (*argv, "--disable-radix-cache")

    def _start(self, role: str) -> Process:
        self.starts += 1
        argv = self._argv(role)
        return Process(
            argv,
            self.env,
            self.root / f"{role}-{self.starts}.log",
            f"http://127.0.0.1:{option(argv, '--port')}",
        )

    def up(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        for server in (self.prefill, self.decode):
            server.wait_up(t0 + timeout_s)
        return time.monotonic() - t0

    def restart_prefill(self, timeout_s: float) -> float:
        self.prefill.stop()
        self.prefill = self._start("prefill")
        return self.prefill.wait_up(time.monotonic() + timeout_s)

    def body(self, room: int, rid: str, ids: list[int]) -> dict[str, Any]:
        port = int(option(self.recipe.prefill, "--disaggregation-bootstrap-port"))
        return {
            "input_ids": ids,
            "rid": rid,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port,
            "bootstrap_room": room,
        }

    def scheduler_pid(self, server: Process) -> int:
        return int(server.scheduler().pid)

    def watch(self, server: Process) -> list[dict[str, Any]]:
        """The page watch's events of ``server``'s scheduler."""
        try:
            pid = self.scheduler_pid(server)
        except Exception:
            return []
        path = Path(f"{self.root / 'watch'}-{pid}.jsonl")
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        for server in (self.prefill, self.decode):
            server.stop()


class Run:
    """The faults on one pair (compare kvconn_vllm.faults.scenarios)."""

    def __init__(self, pair: Pair, reference: Process, lease_s: int, aborts: int) -> None:
        self.pair, self.reference = pair, reference
        self.lease_s, self.aborts = lease_s, aborts
        self.bound_s = 3 * lease_s + 15
        self.freeze_s = 2 * lease_s + 3
        self.n = 0
        self.refs: dict[tuple[int, ...], list[int]] = {}

    def _ref(self, ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in self.refs:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
            self.refs[key] = list(self.reference.post("/generate", body)["output_ids"])
        return self.refs[key]

    def _next(self, fault: str) -> tuple[str, int, list[int]]:
        self.n += 1
        return f"{fault}-{self.n}", 9_100_000 + self.n, prompt(1000 + self.n)

    def _begin(self, fault: str) -> dict[str, Any]:
        row: dict[str, Any] = {"connector": self.pair.label(), "fault": fault, "requests": [], "notes": []}
        row["t0"] = time.monotonic()
        row["base"] = {role: self._used(role) for role in ("prefill", "decode")}
        row["late0"] = {role: self._late(role) for role in ("prefill", "decode")}
        return row

    def _server(self, role: str) -> Process:
        return self.pair.prefill if role == "prefill" else self.pair.decode

    def _used(self, role: str) -> int | None:
        used = [e["used"] for e in self.pair.watch(self._server(role)) if e["kind"] == "used"]
        return used[-1] if used else None

    def _late(self, role: str) -> int:
        return sum(e["slots"] for e in self.pair.watch(self._server(role)) if e["kind"] == "late_write")

    def _send(self, rid: str, room: int, ids: list[int], to: str = "both") -> dict[str, Any]:
        body = self.pair.body(room, rid, ids)
        req: dict[str, Any] = {"rid": rid, "ids": ids, "reference": self._ref(ids), "client_abort": False}
        if to in ("both", "decode"):
            req["decode"] = Posted(self.pair.decode, "/generate", body, self.bound_s + 120)
        if to == "both":
            time.sleep(0.2)  # decode's receiver first, as the router's two posts race
            req["prefill"] = Posted(self.pair.prefill, "/generate", body, self.bound_s + 120)
        return req

    def _post_prefill(self, req: dict[str, Any], room: int) -> None:
        req["prefill"] = Posted(
            self.pair.prefill, "/generate", self.pair.body(room, req["rid"], req["ids"]), self.bound_s + 120
        )

    def _abort(self, req: dict[str, Any]) -> None:
        req["client_abort"] = True
        req["aborted_at"] = time.monotonic()
        used = self._used("decode")
        req["used_at_abort"] = used
        try:
            self.pair.decode.post("/abort_request", {"rid": req["rid"]}, timeout_s=30)
        except Exception as exc:
            req["abort_error"] = repr(exc)

    def _decode_allocated(self, row: dict[str, Any], slots: int, timeout_s: float = 60.0) -> bool:
        """Until decode holds ``slots`` more slots than at the fault's start
        (its receivers bootstrapped and their slots preallocated), the step
        a hand-off starts from: then prefill is acted on."""
        base = row["base"]["decode"] or 0
        want = base + slots
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            used = self._used("decode")
            if used is not None and used >= want:
                return True
            time.sleep(0.05)
        row["notes"].append("decode never allocated slots for the request")
        return False

    def _stop(self, server: Process, sig: int) -> None:
        os.kill(self.pair.scheduler_pid(server), sig)

    def _observe(self, row: dict[str, Any], since: float) -> None:
        deadline = since + self.bound_s
        while time.monotonic() < deadline:
            if all(r["decode"].done() for r in row["requests"] if "decode" in r) and self._settled(row):
                break
            time.sleep(0.25)
        time.sleep(1.0)

    def _settled(self, row: dict[str, Any]) -> bool:
        base = row["base"]["decode"]
        used = self._used("decode")
        return base is None or used is None or used <= base

    def _finish(self, row: dict[str, Any]) -> dict[str, Any]:
        for req in row["requests"]:
            posted = req.pop("decode", None)
            req.pop("prefill", None)
            answer = posted.answer if posted is not None else None
            if "outcome" in req:
                pass  # decided by the fault (decode killed)
            elif posted is None:
                req["outcome"] = "not sent"
            elif not posted.done():
                req["outcome"] = "hung"
            elif isinstance(answer, dict):
                reason = answer["meta_info"]["finish_reason"]["type"]
                if reason != "length":
                    req["outcome"] = "aborted" if req["client_abort"] else "failed"
                else:
                    req["outcome"] = "answered" if answer["output_ids"] == req["reference"] else "wrong"
            else:
                req["outcome"] = "aborted" if req["client_abort"] else "failed"
                req["error"] = repr(answer)[:200]
            req.pop("ids"), req.pop("reference")
        watch = self.pair.watch(self.pair.decode)
        t0 = row["t0"]
        base = row["base"]["decode"] or 0
        series = [
            (round(e["t"] - t0, 2), e["used"] - base) for e in watch if e["kind"] == "used" and e["t"] >= t0
        ]
        row["series"] = series
        row["pinned_end"] = series[-1][1] if series else 0
        row["pinned_max"] = max((u for _, u in series), default=0)
        for req in row["requests"]:
            if req["client_abort"]:
                back = [
                    e["t"]
                    for e in watch
                    if e["kind"] == "used" and e["t"] > req["aborted_at"] and e["used"] - base <= 0
                ]
                req["release_s"] = round(back[0] - req["aborted_at"], 2) if back else None
                req.pop("aborted_at")
        row["late_writes"] = {role: self._late(role) - row["late0"][role] for role in ("prefill", "decode")}
        row["corrupted"] = sum(row["late_writes"].values()) + sum(
            r["outcome"] == "wrong" for r in row["requests"]
        )
        row["hung"] = sum(r["outcome"] == "hung" for r in row["requests"])
        row["failed"] = sum(r["outcome"] == "failed" for r in row["requests"])
        row["seconds"] = round(time.monotonic() - t0, 1)
        row.pop("t0"), row.pop("late0")
        return row

    # -- the faults ---------------------------------------------------------
    def abort(self) -> dict[str, Any]:
        """Decode has the request's slots; prefill's scheduler is stopped
        before it takes the request; decode aborts; prefill thawed 1 s later
        (before every deadline), when it computes and sends."""
        row = self._begin("abort")
        for _ in range(self.aborts):
            rid, room, ids = self._next("abort")
            req = self._send(rid, room, ids, to="decode")
            row["requests"].append(req)
            self._decode_allocated(row, len(ids))
            self._stop(self.pair.prefill, signal.SIGSTOP)
            try:
                self._post_prefill(req, room)
                time.sleep(0.5)
                self._abort(req)
                time.sleep(1.0)
            finally:
                self._stop(self.pair.prefill, signal.SIGCONT)
            self._observe(row, time.monotonic())
            row["base"]["decode"] = self._used("decode")
        return self._finish(row)

    def prefill_frozen(self) -> dict[str, Any]:
        """Two requests: decode has their slots, prefill's scheduler stopped
        before it takes them, one aborted at decode 1 s later; thawed past
        every lease and deadline."""
        row = self._begin("prefill_frozen")
        sent = []
        for _ in range(2):
            rid, room, ids = self._next("pfrozen")
            row["requests"].append(self._send(rid, room, ids, to="decode"))
            sent.append(room)
        self._decode_allocated(row, 2 * len(ids))
        self._stop(self.pair.prefill, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            for req, room in zip(row["requests"], sent, strict=True):
                self._post_prefill(req, room)
            time.sleep(1.0)
            self._abort(row["requests"][1])
            time.sleep(max(0.0, frozen + self.freeze_s - time.monotonic()))
        finally:
            self._stop(self.pair.prefill, signal.SIGCONT)
        self._observe(row, time.monotonic())
        return self._finish(row)

    def decode_frozen(self) -> dict[str, Any]:
        row = self._begin("decode_frozen")
        rid, room, ids = self._next("dfrozen")
        req = self._send(rid, room, ids, to="decode")
        row["requests"].append(req)
        self._decode_allocated(row, len(ids))  # decode has its slots and told prefill where
        time.sleep(0.5)
        self._stop(self.pair.decode, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            self._post_prefill(req, room)
            time.sleep(max(0.0, frozen + self.freeze_s - time.monotonic()))
        finally:
            self._stop(self.pair.decode, signal.SIGCONT)
        self._observe(row, time.monotonic())
        return self._finish(row)

    def prefill_killed(self) -> dict[str, Any]:
        row = self._begin("prefill_killed")
        rid, room, ids = self._next("pkilled")
        req = self._send(rid, room, ids, to="decode")
        row["requests"].append(req)
        self._decode_allocated(row, len(ids))
        self._stop(self.pair.prefill, signal.SIGSTOP)
        self._post_prefill(req, room)
        time.sleep(1.0)
        self.pair.prefill.stop()  # SIGKILL to its process group
        self._observe(row, time.monotonic())
        return self._finish(row)

    def prefill_restarted(self) -> dict[str, Any]:
        row = self._begin("prefill_restarted")
        if self.pair.prefill.alive():
            self.pair.prefill.stop()
        try:
            up = self.pair.restart_prefill(1800)
        except Exception as exc:
            row["notes"].append(f"prefill did not restart: {exc}")
            return self._finish(row)
        row["notes"].append(f"new prefill up in {up:.0f} s")
        for _ in range(2):
            rid, room, ids = self._next("restarted")
            row["requests"].append(self._send(rid, room, ids))
            self._observe(row, time.monotonic())
        return self._finish(row)

    def decode_killed(self) -> dict[str, Any]:
        row = self._begin("decode_killed")
        rid, room, ids = self._next("dkilled")
        req = self._send(rid, room, ids, to="decode")
        row["requests"].append(req)
        self._decode_allocated(row, len(ids))
        self._stop(self.pair.prefill, signal.SIGSTOP)
        try:
            self._post_prefill(req, room)
            time.sleep(1.0)
            self.pair.decode.stop()
        finally:
            self._stop(self.pair.prefill, signal.SIGCONT)
        killed = time.monotonic()
        base = row["base"]["prefill"] or 0
        back = None
        while time.monotonic() < killed + self.bound_s:
            used = self._used("prefill")
            if used is not None and used <= base and req["prefill"].done():
                back = time.monotonic() - killed
                break
            time.sleep(0.25)
        row["notes"].append(
            f"prefill's slots back {back:.1f} s after the kill"
            if back is not None
            else "prefill's slots still held"
        )
        prefill = req["prefill"]
        row["notes"].append(
            f"prefill answered: {str(prefill.answer)[:80] if prefill.done() else 'nothing (hung)'}"
        )
        req.pop("decode", None)
        req["outcome"] = "killed with decode"
        return self._finish(row)


#: Every pair started, so that an interrupted run stops their servers.
STARTED: list[Pair] = []


def run_pair(
    config: str, recipe: Recipe, reference: Process, model: Path, args: argparse.Namespace, root: Path
) -> list[dict[str, Any]]:
    pair = Pair(recipe, config, root / config.replace(":", "-"), args.lease_s, model)
    STARTED.append(pair)
    rows: list[dict[str, Any]] = []
    try:
        up = pair.up(1800)
        print(f"{pair.label()}: servers up in {up:.0f} s", flush=True)
        reference.wait_up(time.monotonic() + 1800)
        run = Run(pair, reference, args.lease_s, args.aborts)
        warm = run._send("warm", 9_000_001, prompt(900))
        run._observe({"requests": [warm], "base": {"decode": None}}, time.monotonic())
        for fault in args.faults.split(","):
            try:
                row = getattr(run, fault)()
            except Exception as exc:
                row = {
                    "connector": pair.label(),
                    "fault": fault,
                    "requests": [],
                    "notes": [f"the run failed: {exc!r}"],
                }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "series"}, default=str), flush=True)
            if fault == "decode_killed" or not pair.decode.alive():
                break
    except Exception as exc:
        rows.append(
            {
                "connector": pair.label(),
                "fault": "start",
                "requests": [],
                "notes": [f"did not run: {exc!r}"[:500]],
            }
        )
    finally:
        pair.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | fault | corrupted | hung | failed | slots pinned at the end (max) | abort to slots back | requests | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        outcomes: dict[str, int] = {}
        for q in r.get("requests", []):
            outcomes[q.get("outcome", "?")] = outcomes.get(q.get("outcome", "?"), 0) + 1
        releases = [q.get("release_s") for q in r.get("requests", []) if q.get("client_abort")]
        got = [x for x in releases if x is not None]
        release = (
            "-"
            if not releases
            else (f"{statistics.median(got):.1f} s" if got else "")
            + (f"; {len(releases) - len(got)} never" if len(got) < len(releases) else "")
        )
        late = r.get("late_writes", {})
        corrupted = r.get("corrupted", "-")
        if late and sum(late.values()):
            corrupted = f"{corrupted} ({late.get('decode', 0)} slots written after decode freed them)"
        pinned = f"{r.get('pinned_end', '-')} (max {r.get('pinned_max', '-')})"
        lines.append(
            f"| {r['connector']} | {r['fault']} | {corrupted} | {r.get('hung', '-')} | {r.get('failed', '-')} | {pinned} "
            f"| {release.strip('; ') or '-'} | {', '.join(f'{n} {o}' for o, n in sorted(outcomes.items()))} | {'; '.join(r.get('notes', []))} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="BACKEND:on|off (deferred decode KV release)"
    )
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--lease-s", type=int, default=6)
    parser.add_argument("--aborts", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=1, help="configurations run at once")
    parser.add_argument("--workdir", type=Path, help="keep the servers' logs and page-watch files here")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # A SIGTERM (a timeout) still stops the servers this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="compare-sglang-") as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        model = make_tiny_llama(root / "model")
        recipe = read_recipe()
        plain_argv = list(recipe.bound(model, {p: free_port() for p in recipe.ports()}).plain())
        plain_argv.append("--disable-radix-cache")
        env = {
            **os.environ,
            **recipe.env,
            "PYTHONPATH": os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
        }
        reference = Process(
            plain_argv, env, root / "plain.log", f"http://127.0.0.1:{option(plain_argv, '--port')}"
        )
        rows: list[dict[str, Any]] = []
        try:
            configs = args.configs.split(",")
            threads: list[threading.Thread] = []
            results: dict[str, list[dict[str, Any]]] = {}

            def one(config: str) -> None:
                results[config] = run_pair(config, recipe, reference, model, args, root)

            reference_up = threading.Thread(
                target=reference.wait_up, args=(time.monotonic() + 1800,), daemon=True
            )
            reference_up.start()
            for i in range(0, len(configs), args.parallel):
                batch = configs[i : i + args.parallel]
                threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in batch]
                for t in threads:
                    t.start()
                for t in threads:
                    while t.is_alive():  # a join the SIGTERM handler can interrupt
                        t.join(1.0)
            for config in configs:
                rows += results.get(config, [])
        finally:
            reference.stop()
            for pair in STARTED:
                pair.close()
    text = table(rows) + f"\n\nRun took {time.monotonic() - started:.0f} s.\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
