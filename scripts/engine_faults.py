"""The fault matrix through real engines: what each fault does to requests
and to decode's pages, with vLLM or SGLang servers running kvconn.

Each server runs in a network namespace of its own (``kvconn.testing.hosts``,
network only: one kernel, one ``/proc``, one ``/dev/shm``, so loopback's
shared-memory data plane works and a killed writer's exit is provable),
joined by a bridge, so that a partition is a pulled cable. This process
drives them from decode's host:

* vLLM: two prefill servers and one decode server behind
  ``kvconn-vllm-proxy`` (in this process); the reference answers are the
  prefill servers' own (each also serves plain requests as one engine);
* SGLang: one prefill and one decode server, each request posted to both
  (or through ``sglang-router`` with ``--router``); the reference answers
  come from one plain SGLang server, started first and stopped.

Faults (``--faults``, default all): none, overload (CPU hogs at 10x the
cores, no fault), prefill frozen shorter than ``peer_timeout_s``, past it,
past every deadline; prefill killed; restarted at the same address;
partitioned and healed before and after the deadlines; lost (partition,
then kill); decode frozen, killed, restarted; an abort storm. Requests flow
from two clients throughout. Per fault it reports: answers that differ from
the reference (``corrupted``), requests not ended within the fault's bound
(``hung``), answered, failed (with their reasons), recomputed (vLLM: decode
computed prompt tokens itself), page-seconds held at decode, how long after
a proof became possible (the fault cleared) decode's held pages were back
to their level before the fault (``capacity_back_s``; vLLM's figures reach
its /metrics at most once a second while it steps, so read it to 1 s), and
rank-downs decode logged while no fault was on (``false_rank_downs``).

Needs root (namespaces) and an engine venv; long (servers start in minutes
on a loaded 2-core VM)::

    .venv-vllm/bin/python scripts/engine_faults.py vllm --json vllm.json
    .venv-sglang/bin/python scripts/engine_faults.py sglang --router --json sglang.json

``--faults none,killed`` runs a selection; ``--transport nixl|mooncake``
another transport (loopback by default).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "vllm"), str(ROOT / "tests" / "sglang")]

from kvconn.testing import hosts, shm  # noqa: E402
from kvconn.testing.cluster import free_port  # noqa: E402

#: kvconn's deadlines in the matrix (the engines' defaults otherwise):
#: decode's peer_timeout_s is kvconn's default, 10 s.
WRITE_TIMEOUT_S, ABORT_TIMEOUT_S, PEER_TIMEOUT_S = 8.0, 12.0, 10.0
#: What a request may take on this machine with no fault (its own service
#: time, engines stepping under load): each fault's bound adds it.
SERVICE_S = 60.0
#: How long after a fault cleared the runner waits for held pages to come back.
SETTLE_S = 120.0
MAX_TOKENS = 8
CLIENTS = 2
#: vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS in the matrix (300 s by default).
VLLM_STEP_TIMEOUT_S = 60


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- a server process -----------------------------------------------------------------
class Server:
    """One engine server in a host (a process group of its own, stopped by its pid)."""

    def __init__(
        self, name: str, host: hosts.Host, argv: Sequence[str], env: Mapping[str, str], url: str, logs: Path
    ):
        self.name, self.host, self.argv, self.env, self.url = name, host, tuple(argv), dict(env), url
        self.logs = logs
        self.starts = 0
        self.proc: subprocess.Popen[Any] | None = None
        self.start()

    def start(self) -> None:
        self.starts += 1
        out = (self.logs / f"{self.name}-{self.starts}.log").open("w")
        self.proc = self.host.popen(
            self.argv,
            isolated=False,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_up(self, timeout_s: float = 900.0, path: str = "/health") -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: see {self.logs}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - t0
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not up within {timeout_s} s: see {self.logs}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is None:
            return
        held = shm.held_by_group(self.proc.pid)  # what the killed group cannot unlink itself
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        shm.remove_unheld(held)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
            text = response.read().decode()
        return {
            (s.name, frozenset(s.labels.items())): float(s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def total(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and labels.items() <= dict(lab).items())


def post(url: str, body: Mapping[str, Any], timeout_s: float) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        try:
            body = exc.read().decode(errors="replace")[:200]
        except Exception:
            body = ""
        return f"HTTP {exc.code}: {body}".strip()
    return f"{type(exc).__name__}: {exc}"[:200]


# -- deployments ----------------------------------------------------------------------------
class Deployment:
    """Servers of one engine: how to ask, what the reference answer is, what decode says."""

    fabric: hosts.Fabric
    decode: Server
    prefills: list[Server]
    prompts: list[Any]
    reference: dict[int, Any]
    #: Set once a request's decode leg is under way with prefill0 writing
    #: it: a fault injected then finds a room of decode's open on that rank.
    handoff: threading.Event

    def ask(self, index: int, timeout_s: float) -> Any:
        raise NotImplementedError

    def decode_metrics(self) -> dict[str, float]:
        raise NotImplementedError

    def abort_storm(self, n: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        for server in [self.decode, *self.prefills, *getattr(self, "extra", [])]:
            server.kill()


PROOFS = ("acks", "late_acks", "writer_fence", "writer_exit", "writer_drained", "completed", "nothing_sent")
PROOFS += ("owner_fence", "unsafe_timeout")


def _decode_figures(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float]) -> dict[str, float]:
    """The decode server's kvconn figures (its one endpoint: SGLang's /metrics
    labels only the gauges with it, vLLM's every series)."""
    figures = {
        "pages_held": total(samples, "kvconn_pages_held"),
        "pages_quarantined": total(samples, "kvconn_pages_quarantined"),
        "rank_downs": total(samples, "kvconn_ranks_down_total"),
    }
    for proof in PROOFS:
        figures[f"proof:{proof}"] = total(samples, "kvconn_releases_total", proof=proof)
    return figures


class Vllm(Deployment):
    HOSTS = ("decode", "prefill0", "prefill1")

    def __init__(self, args: argparse.Namespace, logs: Path, fabric: hosts.Fabric) -> None:
        from vllm_helpers import BLOCK_SIZE, add_word_tokenizer, kv_transfer_config, make_tiny_llama

        from kvconn_vllm.proxy import Proxy, serve

        self.fabric = fabric
        self.handoff = threading.Event()
        model = add_word_tokenizer(make_tiny_llama(logs / "model"))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        # vLLM's engine gives its worker this long per step (300 s by default):
        # shorter here, so that a freeze past it takes a minute, not five.
        env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(VLLM_STEP_TIMEOUT_S)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env.update(_transport_env(args.transport))

        def server(name: str, role: str) -> Server:
            host = self.fabric[name if name != "decode" else "decode"]
            port = free_port()
            extra: dict[str, Any] = {
                "host": host.ip,
                "write_timeout_s": WRITE_TIMEOUT_S,
                "abort_timeout_s": ABORT_TIMEOUT_S,
                "resend_interval_s": 1.0,
                "backend_options": _options(args.transport, host, role == "kv_producer"),
            }
            if role == "kv_producer":
                extra["port"] = free_port()  # its rank comes back at its address when restarted
            config = {**kv_transfer_config(role, **extra), "kv_load_failure_policy": "recompute"}
            config["kv_connector_extra_config"]["backend"] = args.transport
            argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
            argv += [
                "--host",
                host.ip,
                "--port",
                str(port),
                "--served-model-name",
                "tiny",
                "--dtype",
                "float32",
            ]
            argv += ["--max-model-len", "256", "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes"]
            argv += [str(32 << 20), "--enforce-eager", "--no-enable-prefix-caching"]
            argv += ["--disable-hybrid-kv-cache-manager", "--disable-uvicorn-access-log"]
            argv += ["--kv-transfer-config", json.dumps(config)]
            return Server(name, host, argv, env, f"http://{host.ip}:{port}", logs)

        self.prefills = [server("prefill0", "kv_producer"), server("prefill1", "kv_producer")]
        self.decode = server("decode", "kv_consumer")
        t0 = time.monotonic()
        for s in [*self.prefills, self.decode]:
            s.wait_up()
        log(f"vllm servers up in {time.monotonic() - t0:.0f} s")
        self.proxy = Proxy(
            [p.url for p in self.prefills], [self.decode.url], timeout_s=300.0, unreachable_cooldown_s=5.0
        )
        self.proxy_server = serve(self.proxy, "127.0.0.1", 0)
        threading.Thread(target=self.proxy_server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.proxy_server.server_port}"
        # The proxy's prefill leg, watched: a fault waits for a hand-off from prefill0.
        first, prefill0 = self.proxy._first, self.prefills[0].url

        def watched(engines: Any, path: str, body: Any) -> Any:
            base, response = first(engines, path, body)
            if engines is self.proxy.prefill and base == prefill0:
                threading.Timer(0.3, self.handoff.set).start()  # decode's leg starts meanwhile
            return base, response

        self.proxy._first = watched  # type: ignore[method-assign]
        rng = random.Random(40)
        self.prompts = [
            " ".join(f"w{rng.randrange(3, 500)}" for _ in range(n)) for n in (24, 40, 57, 70, 90, 120)
        ]
        # One engine's answers: a prefill server's own, without disaggregation.
        self.reference = {
            i: self._complete(self.prefills[0].url, p, 300.0) for i, p in enumerate(self.prompts)
        }

    def _complete(self, base: str, prompt: str, timeout_s: float) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        return str(post(base + "/v1/completions", body, timeout_s)["choices"][0]["text"])

    def ask(self, index: int, timeout_s: float) -> Any:
        return self._complete(self.base, self.prompts[index], timeout_s)

    def decode_metrics(self) -> dict[str, float]:
        samples = self.decode.metrics()
        figures = _decode_figures(samples)
        figures["local_tokens"] = total(samples, "vllm:prompt_tokens_by_source_total", source="local_compute")
        return figures

    def abort_storm(self, n: int) -> None:
        """``n`` requests whose clients hang up on decode as soon as it has
        the request (vLLM aborts it, mid-transfer or just after)."""
        import socket

        for i in range(n):
            prompt = self.prompts[i % len(self.prompts)]
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream": True,
            }
            params = self.proxy.kv_params("/v1/completions", dict(body))
            data = json.dumps({**body, "kv_transfer_params": params}).encode()
            host, port = self.decode.url.removeprefix("http://").split(":")
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n"
            )
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(head.encode() + data)
                time.sleep(0.05)


class Sglang(Deployment):
    HOSTS = ("decode", "prefill0")

    def __init__(self, args: argparse.Namespace, logs: Path, fabric: hosts.Fabric) -> None:
        from sglang_servers import read_recipe
        from vllm_helpers import make_tiny_llama

        self.fabric = fabric
        self.handoff = threading.Event()
        model = make_tiny_llama(logs / "model")
        recipe = read_recipe()
        ports = {p: free_port() for p in recipe.ports()}
        recipe = recipe.bound(model, ports)
        self.extra: list[Server] = []

        def env(host: hosts.Host) -> dict[str, str]:
            e = {**os.environ, **recipe.env, "KVCONN_SGLANG_TRANSPORT": args.transport}
            e.update(_transport_env(args.transport))
            e["KVCONN_SGLANG_HOST"] = host.ip
            e["KVCONN_SGLANG_WRITE_TIMEOUT_S"] = str(WRITE_TIMEOUT_S)
            e["KVCONN_SGLANG_ABORT_TIMEOUT_S"] = str(ABORT_TIMEOUT_S)
            prefill = host.name.startswith("prefill")
            opts = ",".join(f"{k}={v}" for k, v in _options(args.transport, host, prefill).items())
            if opts:
                e["KVCONN_SGLANG_BACKEND_OPTIONS"] = opts
            if os.environ.get("PYTHONPATH"):
                e["PYTHONPATH"] = recipe.env.get("PYTHONPATH", "") + os.pathsep + os.environ["PYTHONPATH"]
            return e

        def argv(items: Sequence[str], host: hosts.Host) -> tuple[list[str], str]:
            out = list(items)
            out[out.index("--host") + 1] = host.ip
            port = out[out.index("--port") + 1]
            return out, f"http://{host.ip}:{port}"

        # The reference: one plain SGLang server, then stopped (memory).
        plain_argv, plain_url = argv(recipe.plain(), self.fabric["decode"])
        plain = Server(
            "plain", self.fabric["decode"], plain_argv, env(self.fabric["decode"]), plain_url, logs
        )
        rng = random.Random(40)
        self.prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (24, 40, 57, 70, 90, 120)]
        try:
            log(f"plain sglang up in {plain.wait_up():.0f} s")
            self.reference = {i: self._generate(plain.url, ids, 300.0) for i, ids in enumerate(self.prompts)}
        finally:
            plain.kill()
        pre_argv, pre_url = argv(recipe.prefill, self.fabric["prefill0"])
        self.bootstrap = (
            f"{self.fabric['prefill0'].ip}:{pre_argv[pre_argv.index('--disaggregation-bootstrap-port') + 1]}"
        )
        self.prefills = [
            Server("prefill0", self.fabric["prefill0"], pre_argv, env(self.fabric["prefill0"]), pre_url, logs)
        ]
        dec_argv, dec_url = argv(recipe.decode, self.fabric["decode"])
        self.decode = Server(
            "decode", self.fabric["decode"], dec_argv, env(self.fabric["decode"]), dec_url, logs
        )
        t0 = time.monotonic()
        for s in [*self.prefills, self.decode]:
            s.wait_up()
        self.router: Server | None = None
        if args.router:
            r_argv = list(recipe.router)
            r_argv[r_argv.index("--prefill") + 1] = pre_url
            r_argv[r_argv.index("--prefill") + 2] = self.bootstrap.rpartition(":")[2]
            r_argv[r_argv.index("--decode") + 1] = dec_url
            r_argv[r_argv.index("--host") + 1] = "127.0.0.1"
            r_argv += ["--health-check-interval-secs", "5", "--health-failure-threshold", "2"]
            r_argv += ["--health-success-threshold", "1", "--cb-timeout-duration-secs", "5"]
            router_url = f"http://127.0.0.1:{r_argv[r_argv.index('--port') + 1]}"
            self.router = Server("router", self.fabric["decode"], r_argv, dict(os.environ), router_url, logs)
            self.extra.append(self.router)
            self.router.wait_up(120)
        log(f"sglang servers up in {time.monotonic() - t0:.0f} s")
        self.rooms = iter(range(random.randrange(1 << 40), 1 << 62, 7))

    def _generate(self, url: str, ids: list[int], timeout_s: float, **extra: Any) -> list[int]:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
            **extra,
        }
        return list(post(url + "/generate", body, timeout_s)["output_ids"])

    def ask(self, index: int, timeout_s: float) -> Any:
        ids = self.prompts[index]
        # Both legs start together: decode's room is open on the prefill rank
        # while the prefill computes and writes.
        threading.Timer(0.5, self.handoff.set).start()
        if self.router is not None:
            return self._generate(self.router.url, ids, timeout_s)
        host, port = self.bootstrap.split(":")
        extra = {"bootstrap_host": host, "bootstrap_port": int(port), "bootstrap_room": next(self.rooms)}
        prefill_leg = threading.Thread(
            target=_quiet,
            args=(self._generate, self.prefills[0].url, ids, timeout_s),
            kwargs=extra,
            daemon=True,
        )
        prefill_leg.start()
        return self._generate(self.decode.url, ids, timeout_s, **extra)

    def decode_metrics(self) -> dict[str, float]:
        return _decode_figures(self.decode.metrics())

    def abort_storm(self, n: int) -> None:
        host, port = self.bootstrap.split(":")
        legs = []
        for i in range(n):
            rid = f"storm-{time.monotonic_ns()}-{i}"
            extra = {
                "bootstrap_host": host,
                "bootstrap_port": int(port),
                "bootstrap_room": next(self.rooms),
                "rid": rid,
            }
            ids = self.prompts[i % len(self.prompts)]
            for url in (self.prefills[0].url, self.decode.url):
                t = threading.Thread(
                    target=_quiet, args=(self._generate, url, ids, 120.0), kwargs=extra, daemon=True
                )
                t.start()
                legs.append(t)
            time.sleep(0.05)
            with contextlib.suppress(Exception):
                post(self.decode.url + "/abort_request", {"rid": rid}, 10)
        for t in legs:
            t.join(130)


def _quiet(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    with contextlib.suppress(Exception):
        call(*args, **kwargs)


def _options(transport: str, host: hosts.Host, prefill: bool) -> dict[str, str]:
    if transport == "nixl":
        return {"net_devices": host.iface}
    if transport == "mooncake":
        return {"host": host.ip}
    # loopback writes in 16 KiB pieces 0.05 s apart (a 64 KiB block in 0.2 s):
    # a room is in flight long enough for a fault to find it there.
    return {"piece_bytes": "16384", "piece_delay_s": "0.05"} if prefill else {}


def _transport_env(transport: str) -> dict[str, str]:
    if transport == "nixl":
        return {"NIXL_LOG_LEVEL": "WARN", "UCX_MODULES": "^ib"}
    if transport == "mooncake":
        return {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_STATUS_TIMEOUT_SEC": "5", "MC_LOG_LEVEL": "ERROR"}
    return {}


# -- traffic and decode's figures over time --------------------------------------------------
@dataclass
class Outcome:
    index: int
    started: float
    ended: float
    answer: Any = None
    error: str = ""


class Traffic:
    """``CLIENTS`` clients sending the prompts in turn until stopped."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.outcomes: list[Outcome] = []
        self.running: dict[int, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(CLIENTS)
        ]
        for t in self._threads:
            t.start()

    def _client(self, c: int) -> None:
        n = c
        while not self._stop.is_set():
            index = n % len(self.deployment.prompts)
            n += CLIENTS
            started = time.monotonic()
            with self._lock:
                self.running[id(threading.current_thread())] = started
            outcome = Outcome(index, started, 0.0)
            try:
                outcome.answer = self.deployment.ask(index, timeout_s=600.0)
            except Exception as exc:
                outcome.error = _reason(exc)
                time.sleep(0.5)  # a failing engine: do not spin
            outcome.ended = time.monotonic()
            with self._lock:
                self.outcomes.append(outcome)
                del self.running[id(threading.current_thread())]

    def stop(self, wait_s: float) -> list[float]:
        """Stop sending; wait up to ``wait_s`` for requests in flight; the
        start times of those still running then."""
        self._stop.set()
        for t in self._threads:
            t.join(wait_s)
        with self._lock:
            return sorted(self.running.values())


class Monitor:
    """Decode's figures every 0.25 s."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # decode frozen or down: no sample
                self.samples.append((time.monotonic(), self.deployment.decode_metrics()))
            self._stop.wait(0.25)

    def last(self) -> dict[str, float]:
        return self.samples[-1][1] if self.samples else {}

    def between(self, t0: float, t1: float) -> list[tuple[float, dict[str, float]]]:
        return [(t, s) for t, s in self.samples if t0 <= t <= t1]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


# -- faults -----------------------------------------------------------------------------------
@dataclass
class Fault:
    name: str
    #: Inject the fault; return when a proof became possible (it cleared).
    run: Callable[[Deployment], float]
    #: Seconds a request may take under this fault beyond its service time.
    bound_s: float
    #: No fault on: every rank-down is a false one.
    no_fault: bool = False
    #: Seconds of traffic before the fault, and after it cleared.
    before_s: float = 5.0
    after_s: float = 20.0
    #: Injected right after a hand-off from prefill0 (a room in flight there).
    sync: bool = True


def _freeze(target: Callable[[Deployment], Server], seconds: float) -> Callable[[Deployment], float]:
    def run(d: Deployment) -> float:
        server = target(d)
        server.signal(signal.SIGSTOP)
        time.sleep(seconds)
        server.signal(signal.SIGCONT)
        return time.monotonic()

    return run


def _freeze_past_step_timeout(d: Deployment) -> float:
    """prefill0 frozen past vLLM's own step deadline: on resume its engine
    finds the worker's answer late and exits (logged: how long after)."""
    server = d.prefills[0]
    server.signal(signal.SIGSTOP)
    time.sleep(VLLM_STEP_TIMEOUT_S + 15.0)
    server.signal(signal.SIGCONT)
    resumed = time.monotonic()
    assert server.proc is not None
    try:
        server.proc.wait(60)
        log(
            f"prefill0 exited {time.monotonic() - resumed:.1f} s after it resumed (code {server.proc.returncode})"
        )
    except subprocess.TimeoutExpired:
        log("prefill0 still runs 60 s after it resumed")
    return resumed


def _kill(target: Callable[[Deployment], Server], restart: bool) -> Callable[[Deployment], float]:
    def run(d: Deployment) -> float:
        server = target(d)
        server.kill()
        cleared = time.monotonic()
        if restart:
            server.start()
            log(f"{server.name} restarted, up in {server.wait_up():.0f} s")
            if getattr(d, "router", None) is not None:
                time.sleep(12)  # the router's health checks (every 5 s, here) take it back
        return cleared

    return run


def _partition(seconds: float) -> Callable[[Deployment], float]:
    def run(d: Deployment) -> float:
        host = d.fabric["prefill0"]
        host.cut()
        time.sleep(seconds)
        host.heal()
        return time.monotonic()

    return run


def _lose(d: Deployment) -> float:
    host = d.fabric["prefill0"]
    host.cut()
    time.sleep(3)
    d.prefills[0].kill()  # no FIN or RST reaches anyone: its link is down
    cleared = time.monotonic()  # on one host its exit is provable by its pid
    host.heal()
    d.prefills[0].start()
    log(f"prefill0 started again, up in {d.prefills[0].wait_up():.0f} s")
    return cleared


def _overload(seconds: float) -> Callable[[Deployment], float]:
    def run(d: Deployment) -> float:
        cores = os.cpu_count() or 2
        hogs = [
            subprocess.Popen([sys.executable, "-c", "x=0\nwhile True: x=(x+1)%1000003"])
            for _ in range(10 * cores)
        ]
        try:
            time.sleep(seconds)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        return time.monotonic()

    return run


def _storm(d: Deployment) -> float:
    d.abort_storm(16)
    return time.monotonic()


def _none(d: Deployment) -> float:
    time.sleep(20)
    return time.monotonic()


def _prefill0(d: Deployment) -> Server:
    return d.prefills[0]


def _decode(d: Deployment) -> Server:
    return d.decode


FAULTS = [
    Fault("none", _none, 0.0, no_fault=True, sync=False),
    Fault("overload", _overload(60.0), 60.0, no_fault=True, sync=False),
    Fault("prefill_frozen_short", _freeze(_prefill0, 5.0), 5.0),
    Fault("prefill_frozen_past_peer_timeout", _freeze(_prefill0, 20.0), 20.0),
    Fault("prefill_frozen_past_every_deadline", _freeze(_prefill0, 45.0), 45.0),
    # vLLM only: past its engine's own step deadline (VLLM_STEP_TIMEOUT_S)
    Fault("prefill_frozen_past_vllm_step_timeout", _freeze_past_step_timeout, 75.0),
    Fault("prefill_killed", _kill(_prefill0, restart=False), 10.0),
    Fault("prefill_restarted", _kill(_prefill0, restart=True), 900.0),
    Fault("partition_healed_early", _partition(5.0), 5.0),
    Fault("partition_healed_late", _partition(30.0), 60.0),
    Fault("prefill_lost", _lose, 900.0),
    Fault("decode_frozen", _freeze(_decode, 10.0), 10.0),
    Fault("decode_killed", _kill(_decode, restart=False), 10.0),
    Fault("decode_restarted", _kill(_decode, restart=True), 900.0),
    Fault("abort_storm", _storm, 30.0, sync=False),
]
#: What the CI-sized run takes (about 2 minutes past the servers' start).
QUICK = ("none", "prefill_frozen_short", "prefill_killed", "prefill_restarted")


@dataclass
class Row:
    fault: str
    requests: int = 0
    answered: int = 0
    corrupted: int = 0
    failed: int = 0
    hung: int = 0
    recomputed: float = 0.0
    pinned_page_seconds: float = 0.0
    max_pages_held: float = 0.0
    capacity_back_s: float | None = None
    false_rank_downs: int = 0
    rank_downs: int = 0
    #: Failures among requests started once the fault's run returned (the
    #: fault cleared, a restarted server up again).
    failed_after: int = 0
    #: Rooms released at decode during the fault, by proof.
    proofs: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    #: A request not ended within this is hung: the fault's bound plus SERVICE_S.
    bound_s: float = 0.0


def _settle(d: Deployment, monitor: Monitor, timeout_s: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.last().get("pages_held", 1) == 0:
            return
        time.sleep(0.5)
    log(f"decode still holds {monitor.last().get('pages_held')} pages after {timeout_s} s")


def _restore(d: Deployment) -> None:
    """Every server up (a fault may leave one killed)."""
    for server in [*d.prefills, d.decode]:
        assert server.proc is not None
        if server.proc.poll() is not None:
            server.start()
            log(f"{server.name} started again, up in {server.wait_up():.0f} s")


def run_fault(d: Deployment, monitor: Monitor, fault: Fault, tokens_per_prompt: float) -> Row:
    _restore(d)
    _settle(d, monitor)
    before = dict(monitor.last())
    t_start = time.monotonic()
    traffic = Traffic(d)
    time.sleep(fault.before_s)
    if fault.sync:
        d.handoff.clear()
        if not d.handoff.wait(60):
            log("no hand-off from prefill0 within 60 s: the fault goes in anyway")
    t_fault = time.monotonic()
    cleared = fault.run(d)
    recovered = time.monotonic()
    time.sleep(fault.after_s)
    left = traffic.stop(wait_s=fault.bound_s + SERVICE_S)
    # Held pages back to their level before the fault: the last sample above
    # it, counted from the clearing (None: held pages never came back).
    level = before.get("pages_held", 0)
    _settle(d, monitor)
    above = [t for t, s in monitor.between(t_fault, time.monotonic()) if s["pages_held"] > level]
    back: float | None = max(0.0, above[-1] + 0.25 - cleared) if above else 0.0
    if monitor.last().get("pages_held", 0) > level:
        back = None
    after = dict(monitor.last())
    bound = fault.bound_s + SERVICE_S
    row = Row(fault.name, seconds=round(time.monotonic() - t_start, 1), bound_s=bound)
    for o in traffic.outcomes:
        row.requests += 1
        if o.ended - o.started > bound:
            row.hung += 1
        if o.error:
            row.failed += 1
            row.failed_after += o.started >= recovered
            key = o.error.split(":")[0] if "HTTP" not in o.error else o.error[:60]
            row.reasons[key] = row.reasons.get(key, 0) + 1
        else:
            row.answered += 1
            if o.answer != d.reference[o.index]:
                row.corrupted += 1
    row.hung += len(left)
    row.requests += len(left)
    samples = monitor.between(t_start, time.monotonic())
    for (t0, s0), (t1, _) in itertools.pairwise(samples):
        row.pinned_page_seconds += s0.get("pages_held", 0) * (t1 - t0)
    row.pinned_page_seconds = round(row.pinned_page_seconds, 1)
    row.max_pages_held = max((s.get("pages_held", 0) for _, s in samples), default=0)
    row.capacity_back_s = None if back is None else round(back, 2)
    downs = _delta(after, before, "rank_downs")
    row.rank_downs = int(downs)
    row.false_rank_downs = int(downs) if fault.no_fault else 0
    for proof in PROOFS:
        n = int(_delta(after, before, f"proof:{proof}"))
        if n:
            row.proofs[proof] = n
    if "local_tokens" in after and tokens_per_prompt:
        row.recomputed = round(_delta(after, before, "local_tokens") / tokens_per_prompt, 1)
    return row


def _delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> float:
    """A counter's rise (a restarted decode's counters start again at 0)."""
    now, then = after.get(name, 0.0), before.get(name, 0.0)
    return now - then if now >= then else now


def print_table(rows: Sequence[Row], engine: str, transport: str) -> None:
    head = (
        "| fault | requests | answered | corrupted | failed | hung (bound) | recomputed | page-s pinned | "
        "max pages held | capacity back (s) | released by | false rank-downs |"
    )
    print(f"\n{engine}, {transport}:\n")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for r in rows:
        back = "-" if r.capacity_back_s is None else f"{r.capacity_back_s:g}"
        proofs = ", ".join(f"{p} {n}" for p, n in sorted(r.proofs.items())) or "-"
        print(
            f"| {r.fault} | {r.requests} | {r.answered} | {r.corrupted} | {r.failed} | {r.hung} ({r.bound_s:g} s) | "
            f"{r.recomputed:g} | {r.pinned_page_seconds:g} | {r.max_pages_held:g} | {back} | {proofs} | "
            f"{r.false_rank_downs} |"
        )
    for r in rows:
        if r.reasons or r.proofs or r.rank_downs:
            print(
                f"  {r.fault}: failed {dict(sorted(r.reasons.items()))} ({r.failed_after} after it cleared), "
                f"rank-downs {r.rank_downs}, releases by proof {r.proofs}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("engine", choices=["vllm", "sglang"])
    parser.add_argument("--transport", default="loopback", choices=["loopback", "nixl", "mooncake"])
    parser.add_argument("--router", action="store_true", help="SGLang: requests through sglang-router")
    parser.add_argument("--faults", default="all", help="comma-separated fault names, 'quick' or 'all'")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--logs", type=Path, help="server logs here (default: a temporary folder)")
    parser.add_argument(
        "--table", type=Path, help="print the table of rows an earlier --json wrote, and exit"
    )
    args = parser.parse_args(argv)
    if args.table:
        try:
            rows = [Row(**r) for r in json.loads(args.table.read_text())]
        except (OSError, ValueError, TypeError) as exc:
            parser.error(f"--table {args.table}: not the rows of an earlier --json ({exc})")
        print_table(rows, args.engine + (" + sglang-router" if args.router else ""), args.transport)
        return 0
    names = [f.name for f in FAULTS]
    wanted = (
        names if args.faults == "all" else list(QUICK) if args.faults == "quick" else args.faults.split(",")
    )
    if args.engine == "sglang" and args.faults == "all":
        wanted.remove("prefill_frozen_past_vllm_step_timeout")
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {names}")
    why = hosts.unavailable()
    if why:
        print(f"engine_faults: {why}", file=sys.stderr)
        return 2
    logs = args.logs or Path(f"/tmp/kvconn-engine-faults-{os.getpid()}")
    logs.mkdir(parents=True, exist_ok=True)
    log(f"logs in {logs}")
    kind = Vllm if args.engine == "vllm" else Sglang
    fabric = hosts.make(kind.HOSTS)
    deployment: Deployment | None = None
    rows: list[Row] = []
    shm_before = shm.engine_files()
    try:
        # This thread and those it starts (clients, proxy, monitor) talk from decode's host.
        with fabric["decode"].entered():
            deployment = kind(args, logs, fabric)
            tokens = _prompt_tokens(deployment)
            monitor = Monitor(deployment)
            try:
                for fault in FAULTS:
                    if fault.name not in wanted:
                        continue
                    log(f"fault {fault.name}")
                    row = run_fault(deployment, monitor, fault, tokens)
                    log(json.dumps(asdict(row)))
                    rows.append(row)
                    if args.json:
                        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
            finally:
                monitor.close()
    finally:
        if deployment is not None:
            deployment.close()
        fabric.close()
        # Semaphores of engine processes killed outside Server.kill (a vLLM
        # engine core in a group of its own): made during this run, held by none.
        shm.remove_unheld(shm.engine_files() - shm_before)
    print_table(rows, args.engine + (" + sglang-router" if args.router else ""), args.transport)
    return 0


def _prompt_tokens(d: Deployment) -> float:
    """Mean prompt length in tokens (vLLM's recompute count divides by it)."""
    return sum(len(p.split()) if isinstance(p, str) else len(p) for p in d.prompts) / len(d.prompts)


if __name__ == "__main__":
    raise SystemExit(main())
