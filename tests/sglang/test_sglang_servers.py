"""Real SGLang servers through kvconn: docs/sglang.md's recipe, run.

``python -m sglang.launch_server`` as a prefill and a decode server with
``--disaggregation-transfer-backend kvconn``, and SGLang's router in front
(``sglang_router.launch_router --pd-disaggregation``), on SGLang's CPU
engine and a random-weight Llama made here; the command lines are read
from the doc (sglang_servers.py). Each transport gets its own pair; one
plain SGLang server (no disaggregation) is the tokens' reference.

What is checked, per transport: greedy tokens through the router equal the
plain server's for prompts of several lengths; kvconn's figures are on
SGLang's own ``/metrics``; a request aborted at decode (SGLang's
``/abort_request``) while the prefill rank is frozen by SIGSTOP keeps its
pages held past SGLang's own deadline and kvconn's (quarantined) until
kvconn's release by proof (SIGCONT: the rank's ack); a SIGKILLed prefill
server gives them back by its exit. Loopback freezes the rank mid-write
(its ``freeze_chunks`` option: half the chunk landed); NIXL and Mooncake
write a request's pages in microseconds, so there the rank is frozen
before decode's request for the room reaches it. Loopback also drains a
prefill server on SIGTERM (KVCONN_SGLANG_DRAIN_ON_SIGTERM), with a room in
flight, and shows what happens without the drain; and stops one the usual
way (SIGTERM to its main process), which drains through SGLang's ShutdownReq.

Minutes per transport (each server imports SGLang): marked slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from sglang_servers import Process, Recipe, on_gpus, option, read_recipe
from tiny_model import TINY_LLAMA

from kvconn.plugins import BackendError, get_backend
from kvconn.testing.cluster import free_port
from kvconn.testing.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
pytest.importorskip("sglang", reason="sglang is not installed here: scripts/setup-sglang-venv.sh")
pytest.importorskip("sglang_router", reason="SGLang's router is not installed: scripts/setup-sglang-venv.sh")

#: ``cuda`` on a GPU host (scripts/gpu/sglang_pd.sh): the doc's recipe less
#: its CPU settings, prefill on GPU 0, decode on KVCONN_SGLANG_TEST_DECODE_GPU.
DEVICE = os.environ.get("KVCONN_SGLANG_TEST_DEVICE", "cpu")
#: Imports of SGLang under a loaded 2-core machine take minutes.
START_S = 900.0
MAX_NEW = 8
PROMPTS = {
    n: [(n * 13 + i * 7) % (TINY_LLAMA["vocab_size"] - 3) + 3 for i in range(n)]
    for n in (5, 31, 64, 100, 300)
}
#: The room loopback's prefill freezes in, half-way through its first chunk.
FROZEN_ROOM = 7_700_001
#: A second room per prefill: frozen from outside, then the server killed.
KILLED_ROOM = 7_700_002
#: The room in flight when the prefill server is told SIGTERM: loopback delays
#: the second half of its first chunk by 3 s (``late_chunks``).
DRAIN_ROOM = 7_700_003
#: A room decode asks the prefill rank for while the prefill server never
#: gets the request (SGLang's tokenizer does not wait for it at a stop).
UNSERVED_ROOM = 7_700_004
#: What loopback's prefill is started with: the fault points above, and the
#: drain on SIGTERM (a test without it starts one of its own).
LOOPBACK_PREFILL = {
    "KVCONN_SGLANG_BACKEND_OPTIONS": (
        f"freeze_chunks=0:{FROZEN_ROOM}:0,piece_bytes=4096,late_chunks=0:{DRAIN_ROOM}:0,late_delivery_s=3"
    ),
    "KVCONN_SGLANG_DRAIN_ON_SIGTERM": "1",
    "KVCONN_SGLANG_DRAIN_GRACE_S": "10",
}
#: Short kvconn deadlines (the doc leaves kvconn's defaults); Mooncake may take
#: 10 s to fail a write, so its abort deadline is longer.
DEADLINES = {
    "loopback": {"KVCONN_SGLANG_WRITE_TIMEOUT_S": "5", "KVCONN_SGLANG_ABORT_TIMEOUT_S": "6"},
    "nixl": {"KVCONN_SGLANG_WRITE_TIMEOUT_S": "2", "KVCONN_SGLANG_ABORT_TIMEOUT_S": "3"},
    "mooncake": {"KVCONN_SGLANG_WRITE_TIMEOUT_S": "9", "KVCONN_SGLANG_ABORT_TIMEOUT_S": "12"},
}
#: SGLang's own deadline for a held room (30 s by default): 1 s here, so the
#: tests see it pass while kvconn still holds the pages.
SGLANG_DEADLINE = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "1"}
#: Proofs that a writer can no longer land anything (never "unsafe_timeout").
PROOFS = ("acks", "late_acks", "writer_fence", "writer_exit", "writer_drained", "owner_fence")


def _env(recipe: Recipe, transport: str, extra: Mapping[str, str] = {}) -> dict[str, str]:
    env = {**os.environ, **recipe.env, "KVCONN_SGLANG_TRANSPORT": transport, **DEADLINES[transport]}
    env["KVCONN_SGLANG_RESEND_INTERVAL_S"] = "0.2"
    # The doc's PYTHONPATH (the CPU stand-ins) first, then the test's own.
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = recipe.env.get("PYTHONPATH", "") + os.pathsep + os.environ["PYTHONPATH"]
    env.update(extra)
    return env


class Cluster:
    """The doc's three processes for one transport, on ports of the test's."""

    def __init__(self, recipe: Recipe, transport: str, root: Path) -> None:
        self.recipe, self.transport, self.root = recipe, transport, root
        self.starts: list[tuple[str, float]] = []
        self.prefill = self._start_prefill()
        self.decode = Process(
            recipe.decode, _env(recipe, transport, SGLANG_DEADLINE), root / "decode.log", _url(recipe.decode)
        )
        self.router: Process | None = None

    def _start_prefill(self, extra: Mapping[str, str] = {}) -> Process:
        env = {**(LOOPBACK_PREFILL if self.transport == "loopback" else {}), **extra}
        self.prefill_extra = dict(extra)
        log = self.root / f"prefill-{len(self.starts)}.log"
        return Process(
            self.recipe.prefill, _env(self.recipe, self.transport, env), log, _url(self.recipe.prefill)
        )

    def wait_up(self, *servers: Process) -> None:
        deadline = time.monotonic() + START_S
        for server in servers:
            self.starts.append((server.log.name, server.wait_up(deadline)))

    def start_router(self) -> None:
        self.router = Process(
            self.recipe.router, os.environ, self.root / "router.log", _url(self.recipe.router)
        )
        self.starts.append(("router", self.router.wait_up(time.monotonic() + 120)))

    def ensure_prefill(self, extra: Mapping[str, str] = {}) -> None:
        """A prefill server started with ``extra``: the running one, or a new
        one at the same ports (the last one is stopped)."""
        if self.prefill.alive() and self.prefill_extra == dict(extra):
            return
        self.prefill.stop()
        self.prefill = self._start_prefill(extra)
        self.wait_up(self.prefill)
        # Decode still knows the old instance's ranks at this bootstrap
        # address: the first request finds them gone and decode reads the
        # new ones (kvconn_sglang's forget_prefill). Posted to both servers:
        # SGLang's router takes a restarted worker back only after its next
        # health checks, a minute apart.
        rooms = iter(range(7_800_000, 7_900_000))

        def served() -> bool:
            body = _direct(next(rooms), "warm", PROMPTS[5], self.recipe)
            Posted(self.prefill, body)
            return _finish_reason(Posted(self.decode, body).result()) == "length"

        wait_for(served, 120, "a request through the new prefill", 0.5)

    def close(self) -> None:
        for process in (self.router, self.prefill, self.decode):
            if process is not None:
                process.stop()


def _url(argv: tuple[str, ...]) -> str:
    return f"http://127.0.0.1:{option(argv, '--port')}"


def _body(ids: list[int], **extra: Any) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, **extra}


def _through_router(cluster: Cluster, ids: list[int]) -> list[int] | None:
    assert cluster.router is not None
    try:
        return list(cluster.router.post("/generate", _body(ids))["output_ids"])
    except OSError:
        return None


@pytest.fixture(scope="session")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    doc = read_recipe()
    if DEVICE == "cuda":
        doc = on_gpus(doc, 0, int(os.environ.get("KVCONN_SGLANG_TEST_DECODE_GPU", "0")))
    ports = {p: free_port() for p in doc.ports()}
    bound = doc.bound(tmp_path_factory.mktemp("tiny-llama") / "model", ports)
    subprocess.run(bound.model, check=True, timeout=600)  # the doc's line that makes the model
    return bound


@pytest.fixture(scope="session")
def plain(recipe: Recipe, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    argv = recipe.plain()
    port = free_port()
    argv = (*argv[: argv.index("--port") + 1], str(port), *argv[argv.index("--port") + 2 :])
    server = Process(
        argv, _env(recipe, "loopback"), tmp_path_factory.mktemp("plain") / "plain.log", _url(argv)
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["loopback", "nixl", "mooncake"])
def cluster(
    request: pytest.FixtureRequest, recipe: Recipe, plain: Process, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    transport = request.param
    if DEVICE == "cuda" and transport == "loopback":
        pytest.skip("loopback writes host memory only; on GPUs: nixl and mooncake")
    try:
        get_backend(transport)
    except (BackendError, ImportError) as exc:
        pytest.skip(f"kvconn transport {transport} is not installed here: {exc}")
    started = time.monotonic()
    servers = Cluster(recipe, transport, tmp_path_factory.mktemp(transport))
    try:
        servers.wait_up(servers.prefill, servers.decode)
        servers.starts.append(("plain", plain.wait_up(time.monotonic() + START_S)))
        servers.start_router()
        print(f"\n{transport}: up in {time.monotonic() - started:.0f} s ({servers.starts})")
        yield servers
    finally:
        servers.close()


class Posted:
    """A POST on a thread of its own: its answer, or the error it raised."""

    def __init__(self, server: Process, body: dict[str, Any]) -> None:
        self.answer: Any = None
        self._thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self._thread.start()

    def _run(self, server: Process, body: dict[str, Any]) -> None:
        try:
            self.answer = server.post("/generate", body, timeout_s=300)
        except Exception as exc:
            self.answer = exc

    def result(self, timeout_s: float = 300) -> Any:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "no answer"
        return self.answer


def _finish_reason(answer: Any) -> str | None:
    if not isinstance(answer, dict):
        return None
    return str(answer["meta_info"]["finish_reason"]["type"])


def _direct(room: int, rid: str, ids: list[int], recipe: Recipe) -> dict[str, Any]:
    port = int(option(recipe.prefill, "--disaggregation-bootstrap-port"))
    return _body(ids, rid=rid, bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room)


def _held(cluster: Cluster) -> float:
    return cluster.decode.metric("kvconn_pages_held", kvconn_endpoint="decode-0")


def _released(cluster: Cluster) -> dict[str, float]:
    return {p: cluster.decode.metric("kvconn_releases_total", proof=p) for p in (*PROOFS, "unsafe_timeout")}


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    return wait_for(cond, timeout_s, what, poll=0.25)


def test_tokens_through_sglangs_router_equal_one_plain_servers(cluster: Cluster, plain: Process) -> None:
    assert cluster.router is not None
    for n, ids in PROMPTS.items():
        alone = plain.post("/generate", _body(ids))["output_ids"]
        t0 = time.monotonic()
        disaggregated = cluster.router.post("/generate", _body(ids))["output_ids"]
        print(f"{cluster.transport}: {n}-token prompt through the router in {time.monotonic() - t0:.2f} s")
        assert len(alone) == MAX_NEW
        assert disaggregated == alone, f"{n}-token prompt"
    # The doc's own client request, as written there.
    answer = cluster.router.post("/generate", cluster.recipe.client_body)
    assert answer["output_ids"] == plain.post("/generate", cluster.recipe.client_body)["output_ids"]


def test_kvconn_figures_on_sglangs_own_metrics(cluster: Cluster) -> None:
    """--enable-metrics: SGLang's /metrics of each server carries kvconn's
    counters (from the scheduler's multiprocess files) and the relayed
    scrape-time families, labelled by endpoint."""
    landed = {"kvconn_endpoint": "prefill-0", "outcome": "landed"}
    before = cluster.prefill.metric("kvconn_chunks_total", **landed)
    assert _through_router(cluster, PROMPTS[64]) is not None
    _wait(lambda: cluster.prefill.metric("kvconn_chunks_total", **landed) > before, 30, "landed chunks rose")
    assert cluster.decode.samples("kvconn_pages_held", kvconn_endpoint="decode-0") == [0.0]
    assert cluster.decode.metric("kvconn_messages_total") > 0
    assert cluster.prefill.metric("kvconn_messages_total", type="TransferRequest") > 0
    # One series per proof from the start, at 0: nothing aborted yet.
    proofs = cluster.decode.samples("kvconn_releases_total")
    assert len(proofs) >= len(PROOFS) + 1 and sum(proofs) == 0, proofs
    assert cluster.decode.samples("sglang:num_requests_total") or cluster.decode.samples(
        "sglang:generation_tokens_total"
    ), "SGLang's own figures are on the same /metrics"


def _asked(cluster: Cluster) -> float:
    """TransferRequests the prefill rank took (counted as they arrive)."""
    return cluster.prefill.metric("kvconn_messages_total", type="TransferRequest")


def _freeze(cluster: Cluster, room: int, rid: str) -> list[Posted]:
    """``room`` requested with the prefill's scheduler frozen, decode's
    request for the room already at the prefill rank: mid-write by
    loopback's freeze_chunks (FROZEN_ROOM); or, for any other room and any
    transport, the request posted to decode alone, the rank frozen from
    outside once it took decode's request, then the request posted to
    prefill (a thawed rank would write it)."""
    body = _direct(room, rid, PROMPTS[100], cluster.recipe)
    scheduler = cluster.prefill.scheduler()
    if room == FROZEN_ROOM and cluster.transport == "loopback":
        import psutil

        posted = [Posted(cluster.prefill, body), Posted(cluster.decode, body)]
        _wait(lambda: scheduler.status() == psutil.STATUS_STOPPED, 60, "the prefill rank froze mid-write")
        return posted
    asked = _asked(cluster)
    posted = [Posted(cluster.decode, body)]
    _wait(lambda: _asked(cluster) > asked, 60, "decode's request for the room at the prefill rank")
    scheduler.send_signal(signal.SIGSTOP)
    return [*posted, Posted(cluster.prefill, body)]


def test_abort_mid_transfer_holds_pages_past_both_deadlines_until_kvconns_proof(cluster: Cluster) -> None:
    cluster.ensure_prefill()
    room = FROZEN_ROOM if cluster.transport == "loopback" else FROZEN_ROOM + 10
    scheduler = cluster.prefill.scheduler()
    before = _released(cluster)
    posted = _freeze(cluster, room, "frozen")
    try:
        cluster.decode.post("/abort_request", {"rid": "frozen"})
        _wait(lambda: _held(cluster) > 0, 30, "decode holds the aborted room's pages")
        held = _held(cluster)
        # SGLang's own deadline (1 s) passes, then kvconn's: quarantined, still held.
        t0 = time.monotonic()
        _wait(
            lambda: cluster.decode.metric("kvconn_pages_quarantined", kvconn_endpoint="decode-0") > 0,
            60,
            "the room quarantined at kvconn's deadline",
        )
        for _ in range(3):
            assert _held(cluster) == held, "pages handed back with no proof"
            time.sleep(0.5)
        print(
            f"{cluster.transport}: {held:.0f} pages held {time.monotonic() - t0 + 1:.1f} s past SGLang's deadline"
        )
        assert _released(cluster) == before
    finally:
        scheduler.send_signal(signal.SIGCONT)
    _wait(lambda: _held(cluster) == 0, 60, "pages back after SIGCONT")
    after = _released(cluster)
    proofs = {p: after[p] - before[p] for p in after if after[p] != before[p]}
    print(f"{cluster.transport}: released by {proofs}")
    assert proofs and set(proofs) <= {"acks", "late_acks", "writer_fence"}, proofs
    # Neither client got a completion; they were told at once (before the proof).
    answers = [p.result() for p in posted]
    print(f"{cluster.transport}: the clients were answered {answers!r:.300}")
    assert all(_finish_reason(a) != "length" for a in answers), answers
    # The servers serve on.
    assert _through_router(cluster, PROMPTS[31]) is not None


def test_a_sigkilled_prefill_server_gives_decodes_pages_back_by_its_exit(cluster: Cluster) -> None:
    cluster.ensure_prefill()
    before = _released(cluster)
    posted = _freeze(cluster, KILLED_ROOM, "killed")
    cluster.decode.post("/abort_request", {"rid": "killed"})
    _wait(lambda: _held(cluster) > 0, 30, "decode holds the aborted room's pages")
    _wait(
        lambda: cluster.decode.metric("kvconn_pages_quarantined", kvconn_endpoint="decode-0") > 0,
        60,
        "quarantined: nothing but a proof hands them back",
    )
    assert _released(cluster) == before
    t0 = time.monotonic()
    os.killpg(cluster.prefill.pid, signal.SIGKILL)
    cluster.prefill.proc.wait(60)
    took = _wait(lambda: _held(cluster) == 0, 60, "pages back by the writer's exit")
    after = _released(cluster)
    assert after["writer_exit"] == before["writer_exit"] + 1, after
    assert after["unsafe_timeout"] == 0
    print(f"{cluster.transport}: pages back {took:.1f} s after SIGKILL ({time.monotonic() - t0:.1f} s)")
    assert _finish_reason(posted[0].result()) != "length", posted[0].result()
    assert not cluster.prefill.alive()


@pytest.mark.parametrize("drain", [True, False], ids=["drain-on-sigterm", "no-drain"])
def test_sigterm_to_the_prefill_servers_processes_with_a_room_in_flight(
    cluster: Cluster, plain: Process, drain: bool
) -> None:
    """SIGTERM to every process of the prefill server (a process-group or
    cgroup-wide stop: systemd's default, ``kill -- -PGID``), with a room in
    flight: its chunk's second half sits in loopback's NIC queue for 3 s
    (``late_chunks``). With KVCONN_SGLANG_DRAIN_ON_SIGTERM=1 the scheduler
    drains: the room completes and decode answers; without it the scheduler
    dies at once and decode gets its pages back by the writer's exit. Either
    way the server exits and no page comes back without proof."""
    if cluster.transport != "loopback":
        pytest.skip("the drain does not depend on the transport: run on loopback's delayed writes")
    room = DRAIN_ROOM
    cluster.ensure_prefill({} if drain else {"KVCONN_SGLANG_DRAIN_ON_SIGTERM": "0"})
    before = _released(cluster)
    asked = _asked(cluster)
    body = _direct(room, f"drain-{drain}", PROMPTS[100], cluster.recipe)
    decode = Posted(cluster.decode, body)
    Posted(cluster.prefill, body)
    _wait(lambda: _asked(cluster) > asked, 60, "decode asked the prefill rank for the room")
    t0 = time.monotonic()
    os.killpg(cluster.prefill.pid, signal.SIGTERM)
    exited = _wait(lambda: not cluster.prefill.alive(), 120, "every process of the prefill server exited")
    answer = decode.result()
    print(f"drain={drain}: prefill server gone {exited:.1f} s after SIGTERM; decode answered {answer!r:.200}")
    _wait(lambda: _held(cluster) == 0, 60, "decode holds no page")
    after = _released(cluster)
    assert after["unsafe_timeout"] == 0
    log = cluster.prefill.log.read_text(errors="replace")
    if drain:
        assert _finish_reason(answer) == "length", answer
        assert answer["output_ids"] == plain.post("/generate", _body(PROMPTS[100]))["output_ids"]
        assert "kvconn drain: DrainReport(drained=True" in log, cluster.prefill.tail()
    else:
        assert _finish_reason(answer) != "length", answer
        assert after["writer_exit"] == before["writer_exit"] + 1, after
    print(f"drain={drain}: took {time.monotonic() - t0:.1f} s; releases {after}")


def test_sigterm_to_the_prefill_servers_main_process_drains_through_sglangs_shutdown(
    cluster: Cluster, plain: Process
) -> None:
    """SGLang's usual stop, SIGTERM to the server's main process (``kill
    PID``): SGLang waits for its requests in flight, then sends the
    scheduler a ShutdownReq, which the plugin's hook turns into kvconn's
    drain before the scheduler's loop ends. A room in flight completes; a
    room decode asked for that the prefill server never got (SGLang does
    not wait for it) is failed by the drain, and decode gets its pages back
    by the drain's proof, not by the rank's exit; the server exits."""
    if cluster.transport != "loopback":
        pytest.skip("the drain does not depend on the transport: run on loopback's delayed writes")
    cluster.ensure_prefill()
    before = _released(cluster)
    asked = _asked(cluster)
    unserved = Posted(cluster.decode, _direct(UNSERVED_ROOM, "unserved", PROMPTS[31], cluster.recipe))
    _wait(lambda: _asked(cluster) > asked, 60, "decode asked the prefill rank for the unserved room")
    body = _direct(DRAIN_ROOM, "main-sigterm", PROMPTS[100], cluster.recipe)
    decode = Posted(cluster.decode, body)
    Posted(cluster.prefill, body)
    _wait(lambda: _asked(cluster) > asked + 1, 60, "decode asked the prefill rank for the room in flight")
    t0 = time.monotonic()
    os.kill(cluster.prefill.pid, signal.SIGTERM)
    exited = _wait(lambda: not cluster.prefill.alive(), 120, "every process of the prefill server exited")
    answer = decode.result()
    print(
        f"main-process SIGTERM: prefill server gone {exited:.1f} s after it; decode answered {answer!r:.200}"
    )
    assert _finish_reason(answer) == "length", answer
    assert answer["output_ids"] == plain.post("/generate", _body(PROMPTS[100]))["output_ids"]
    assert _finish_reason(unserved.result()) != "length", unserved.result()
    _wait(lambda: _held(cluster) == 0, 60, "decode holds no page")
    after = _released(cluster)
    proofs = {p: after[p] - before[p] for p in after if after[p] != before[p]}
    print(f"main-process SIGTERM: the unserved room released by {proofs}")
    # By the drain (its "drained" notice or the rank's abort ack), never the rank's exit.
    assert proofs and set(proofs) <= {"writer_drained", "acks", "late_acks"}, proofs
    log = cluster.prefill.log.read_text(errors="replace")
    drained = [line for line in log.splitlines() if "kvconn drain at SGLang's shutdown" in line]
    assert drained and "drained=True" in drained[-1], cluster.prefill.tail()
    print(f"main-process SIGTERM: took {time.monotonic() - t0:.1f} s; {drained[-1][-160:]}")
