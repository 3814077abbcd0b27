"""The P/D proxy's request flow against stand-in engines (HTTP servers that
record what they are sent); the real ``vllm serve`` engines behind it:
``test_e2e_http.py``."""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import standin_engine
from standin_engine import StandinEngine

from kvconn.testing.cluster import free_port
from kvconn_vllm.proxy import Proxy, prefill_request, serve

PARAMS = {
    "do_remote_prefill": True,
    "kvconn_room": 7,
    "kvconn_prefill": ["tcp://x:1"],
    "remote_num_tokens": 3,
}
#: An engine's answer to a body: (status, JSON, or raw bytes sent as an event stream).
Answer = Callable[[dict[str, Any]], tuple[int, Any]]


class Engine:
    """An HTTP server answering every POST with ``answer(body)``; keeps the bodies."""

    def __init__(self, answer: Answer) -> None:
        self.bodies: list[dict[str, Any]] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                status, out = answer(body)
                raw = isinstance(out, bytes)
                data = out if raw else json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if raw else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@contextmanager
def running(*servers: ThreadingHTTPServer) -> Iterator[None]:
    for server in servers:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@contextmanager
def proxied(prefill: Engine, decode_url: str, extra: tuple[Engine, ...] = ()) -> Iterator[str]:
    """The proxy's base URL, in front of ``prefill`` and the decode at ``decode_url``."""
    proxy = serve(Proxy([prefill.url], [decode_url], timeout_s=10), port=0)
    with running(proxy, prefill.server, *(e.server for e in extra)):
        yield f"http://127.0.0.1:{proxy.server_port}"


def kvconn_prefill() -> Engine:
    return Engine(lambda body: (200, {"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}))


def _post(url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_prefill_gets_one_token_no_stream_and_the_remote_decode_ask() -> None:
    body = {
        "prompt": "a b",
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {},
    }
    assert prefill_request(body) == {
        "prompt": "a b",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's request is untouched


def test_decode_gets_the_request_with_prefills_params_and_its_answer_is_relayed() -> None:
    prefill = kvconn_prefill()
    decode = Engine(lambda body: (200, {"choices": [{"text": "decoded"}]}))
    request = {"prompt": "a b", "max_tokens": 5, "temperature": 0}
    with proxied(prefill, decode.url, (decode,)) as url:
        status, raw = _post(url + "/v1/completions", request)
    assert (status, json.loads(raw)) == (200, {"choices": [{"text": "decoded"}]})
    assert prefill.bodies == [prefill_request(request)]
    assert decode.bodies == [{**request, "kv_transfer_params": PARAMS}]


def test_a_streamed_answer_is_relayed_byte_for_byte() -> None:
    stream = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
    prefill, decode = kvconn_prefill(), Engine(lambda body: (200, stream))
    with proxied(prefill, decode.url, (decode,)) as url:
        status, raw = _post(url + "/v1/chat/completions", {"messages": [], "stream": True})
    assert (status, raw) == (200, stream)
    assert decode.bodies[0]["stream"] is True and "stream" not in prefill.bodies[0]


def test_a_prefill_without_kvconn_is_a_clear_502_and_decode_is_not_asked() -> None:
    plain = Engine(lambda body: (200, {"choices": [{"text": "x"}]}))
    decode = Engine(lambda body: (200, {}))
    with proxied(plain, decode.url, (decode,)) as url:
        status, raw = _post(url + "/v1/completions", {"prompt": "a"})
    assert status == 502 and "KvconnConnector" in json.loads(raw)["error"]["message"]
    assert not decode.bodies


def test_a_prefill_answer_that_is_not_json_is_a_clear_502() -> None:
    garbled = Engine(lambda body: (200, b"<html>busy</html>"))
    decode = Engine(lambda body: (200, {}))
    with proxied(garbled, decode.url, (decode,)) as url:
        status, raw = _post(url + "/v1/completions", {"prompt": "a"})
    assert status == 502 and "not JSON" in json.loads(raw)["error"]["message"]
    assert not decode.bodies


def test_engine_errors_and_bad_bodies_are_answered_not_raised() -> None:
    failing = Engine(lambda body: (400, {"error": {"message": "prompt too long"}}))
    decode = Engine(lambda body: (200, {}))
    with proxied(failing, decode.url, (decode,)) as url:
        assert _post(url + "/v1/completions", {"prompt": "a"}) == (
            400,
            b'{"error": {"message": "prompt too long"}}',
        )
        status, raw = _post(url + "/v1/completions", b"{not json")
        assert status == 400 and "bad request body" in json.loads(raw)["error"]["message"]
        assert _post(url + "/v1/embeddings", {})[0] == 404
        # the proxy still serves after each
        assert _post(url + "/v1/completions", {"prompt": "b"})[0] == 400
    assert not decode.bodies


def test_an_unreachable_decode_is_a_502_naming_it() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with proxied(kvconn_prefill(), nobody) as url:
        status, raw = _post(url + "/v1/completions", {"prompt": "a"})
    assert status == 502 and nobody in json.loads(raw)["error"]["message"]


def test_a_client_that_leaves_mid_stream_closes_decodes_connection() -> None:
    """vLLM aborts a request whose connection closes: the proxy must close
    decode's connection once its client is gone, not drain it to the end."""
    closed = threading.Event()

    class Streaming(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for i in range(200):  # 10 s at most
                    self.wfile.write(f'data: {{"n": {i}}}\n\n'.encode())
                    self.wfile.flush()
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                closed.set()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    decode = ThreadingHTTPServer(("127.0.0.1", 0), Streaming)
    decode_url = f"http://127.0.0.1:{decode.server_port}"
    with running(decode), proxied(kvconn_prefill(), decode_url) as url:
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps({"prompt": "a", "stream": True}).encode()
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.readline().startswith(b"data: ")
        # the client is gone; decode's next writes must fail
        assert closed.wait(8), "the proxy kept decode's stream open after its client left"


# -- draining an engine ----------------------------------------------------------
@contextmanager
def _two_prefills(cooldown_s: float = 60.0) -> Iterator[tuple[str, Engine, Engine, Engine]]:
    a, b = kvconn_prefill(), kvconn_prefill()
    decode = Engine(lambda body: (200, {"choices": [{"text": "ok"}]}))
    proxy = serve(
        Proxy([a.url, b.url], [decode.url], timeout_s=10, unreachable_cooldown_s=cooldown_s), port=0
    )
    with running(proxy, a.server, b.server, decode.server):
        yield f"http://127.0.0.1:{proxy.server_port}", a, b, decode


def test_a_prefill_told_to_drain_gets_no_new_request_and_comes_back_when_undrained() -> None:
    with _two_prefills() as (url, a, b, decode):
        status, raw = _post(url + "/kvconn/drain", {"prefill": a.url})
        assert status == 200 and json.loads(raw)["prefill"][0] == {
            "url": a.url,
            "draining": True,
            "in_flight": 0,
            "unreachable_for_s": 0.0,
        }
        for _ in range(4):
            assert _post(url + "/v1/completions", {"prompt": "a"})[0] == 200
        assert (len(a.bodies), len(b.bodies), len(decode.bodies)) == (0, 4, 4)
        assert _post(url + "/kvconn/undrain", {"prefill": a.url})[0] == 200
        for _ in range(4):
            _post(url + "/v1/completions", {"prompt": "a"})
        assert (len(a.bodies), len(b.bodies)) == (2, 6)


def test_every_engine_draining_is_a_503_and_bad_drain_requests_are_refused() -> None:
    with _two_prefills() as (url, a, b, _):
        assert _post(url + "/kvconn/drain", {"prefill": a.url})[0] == 200
        assert _post(url + "/kvconn/drain", {"prefill": b.url})[0] == 200
        status, raw = _post(url + "/v1/completions", {"prompt": "a"})
        assert status == 503 and "draining" in json.loads(raw)["error"]["message"]
        assert _post(url + "/kvconn/drain", {"prefill": "http://elsewhere:1"})[0] == 404
        assert _post(url + "/kvconn/drain", {"engine": a.url})[0] == 400
        assert _post(url + "/kvconn/drain", [a.url])[0] == 400


def test_a_prefill_going_away_never_fails_a_request_that_had_not_started() -> None:
    """An engine shutting down refuses connections or answers 503: the leg
    goes to the next engine, and the gone one is skipped for the cooldown."""
    with _two_prefills() as (url, a, b, decode):
        a.server.shutdown()
        a.server.server_close()  # refuses connections from now on
        for _ in range(6):
            assert _post(url + "/v1/completions", {"prompt": "a"})[0] == 200
        assert (len(b.bodies), len(decode.bodies)) == (6, 6)
        with urllib.request.urlopen(url + "/kvconn/engines", timeout=10) as response:
            engines = json.loads(response.read())
        assert engines["prefill"][0]["unreachable_for_s"] > 0
    shutting = Engine(lambda body: (503, {"error": "shutting down"}))
    fine = kvconn_prefill()
    decode = Engine(lambda body: (200, {"choices": [{"text": "ok"}]}))
    proxy = serve(Proxy([shutting.url, fine.url], [decode.url], timeout_s=10), port=0)
    with running(proxy, shutting.server, fine.server, decode.server):
        for _ in range(3):
            assert _post(f"http://127.0.0.1:{proxy.server_port}/v1/completions", {"prompt": "a"})[0] == 200
    assert (len(shutting.bodies), len(fine.bodies)) == (1, 3)  # tried once, then skipped


# -- connections: kept alive both ways, Nagle off ----------------------------------
@contextmanager
def _standins() -> Iterator[tuple[str, Proxy, StandinEngine, StandinEngine]]:
    prefill, decode = StandinEngine().start(), StandinEngine().start()
    proxy = Proxy([prefill.url], [decode.url], timeout_s=10)
    server = serve(proxy, port=0)
    try:
        with running(server):
            yield f"127.0.0.1:{server.server_port}", proxy, prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def _ask(conn: http.client.HTTPConnection, stream: bool) -> tuple[http.client.HTTPResponse, bytes]:
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "a", "stream": stream}))
    response = conn.getresponse()
    return response, response.read()


def test_one_client_connection_and_one_per_engine_serve_every_request() -> None:
    """A new connection per leg (and one per client request) cost ~30 ms a
    request: TCP set-up, and Nagle holding a response's second write."""
    with _standins() as (address, proxy, prefill, decode):
        client = http.client.HTTPConnection(address, timeout=10)
        for stream in (False, True, False, True, False, True):
            response, data = _ask(client, stream)
            assert response.status == 200 and not response.will_close
            if stream:
                assert response.getheader("Transfer-Encoding") == "chunked"
                events = [e for e in data.split(b"\n\n") if e]
                assert events[-1] == b"data: [DONE]" and len(events) == standin_engine.EVENTS + 1
            else:
                assert json.loads(data) == {"choices": [{"text": "decoded"}]}
        client.close()
        assert (prefill.requests, decode.requests) == (6, 6)
        assert (prefill.connections, decode.connections, proxy.upstream.opened) == (1, 1, 2)


def test_no_answer_waits_for_the_clients_delayed_ack() -> None:
    """With Nagle's algorithm on, the body written after the headers waits
    for the client to ACK them, and a client delays its ACK (40 ms on
    Linux): every request on a kept connection took 40 ms more."""
    with _standins() as (address, _, _, _):
        client = http.client.HTTPConnection(address, timeout=10)
        took = []
        for stream in (False, True) * 4:
            started = time.perf_counter()
            response, _ = _ask(client, stream)
            took.append(time.perf_counter() - started)
            assert response.status == 200
        client.close()
    assert sorted(took)[len(took) // 2] < 0.03, took


def test_an_http10_client_gets_a_streamed_answer_ended_by_closing() -> None:
    with _standins() as (address, _, _, _):
        host, port = address.split(":")
        body = json.dumps({"prompt": "a", "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            raw = b""
            while chunk := sock.recv(65536):  # the proxy closes at the end
                raw += chunk
    head, _, data = raw.partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower() and data.endswith(b"data: [DONE]\n\n")


def test_a_kept_connection_the_engine_closed_is_retried_on_a_new_one() -> None:
    with _standins() as (address, _, prefill, decode):
        prefill.close_after_each = decode.close_after_each = True
        client = http.client.HTTPConnection(address, timeout=10)
        for stream in (False, True, False, True):
            response, _ = _ask(client, stream)
            assert response.status == 200
        assert (prefill.requests, decode.requests) == (4, 4)  # each leg once: no request twice
        assert prefill.connections == decode.connections == 4


def _engines(url: str) -> dict[str, dict[str, dict[str, Any]]]:
    with urllib.request.urlopen(url + "/kvconn/engines", timeout=10) as response:
        listed = json.loads(response.read())
    return {role: {e["url"]: e for e in engines} for role, engines in listed.items()}


def test_engines_list_the_requests_in_flight_at_each_until_the_decode_leg_ends() -> None:
    """What to watch while draining: a request counts at its prefill engine
    from its leg until the decode leg that took its KV from there ended, and
    at its decode engine for that leg; a client that leaves ends it too."""
    release = threading.Event()

    class Streaming(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b"data: {}\n\n")
            self.wfile.flush()
            release.wait(10)
            with suppress(OSError):  # the client left
                self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    decode = ThreadingHTTPServer(("127.0.0.1", 0), Streaming)
    decode_url = f"http://127.0.0.1:{decode.server_port}"
    prefill = kvconn_prefill()
    with proxied(prefill, decode_url) as url, running(decode):
        conns = [
            http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10) for _ in range(2)
        ]
        for conn in conns:
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "a", "stream": True}))
        responses = [conn.getresponse() for conn in conns]
        for r in responses:
            assert r.status == 200 and r.read1(100)  # the first event: both legs in flight
        engines = _engines(url)
        assert engines["prefill"][prefill.url]["in_flight"] == 2
        assert engines["decode"][decode_url]["in_flight"] == 2
        conns[0].sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conns[0].close()  # a client that leaves (reset): its request ends at both engines
        release.set()
        responses[1].read()  # the second one's answer ends
        deadline = time.monotonic() + 10
        while any(e["in_flight"] for role in _engines(url).values() for e in role.values()):
            assert time.monotonic() < deadline, _engines(url)
            time.sleep(0.02)
        conns[1].close()


def test_an_engines_503_and_a_client_that_left_are_one_log_line_each_not_a_traceback(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    class Unready(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(503)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    decode = ThreadingHTTPServer(("127.0.0.1", 0), Unready)
    decode_url = f"http://127.0.0.1:{decode.server_port}"
    with (
        caplog.at_level(logging.INFO, logger="kvconn_vllm.proxy"),
        proxied(kvconn_prefill(), decode_url) as url,
        running(decode),
    ):
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(urllib.error.HTTPError) as answered:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert answered.value.code == 503
        for request in (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b""):
            # a client that resets its connection, with a request sent or before one
            with socket.create_connection(("127.0.0.1", port), timeout=10) as gone:
                gone.sendall(request)
                gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            time.sleep(0.3)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
    lines = [r.getMessage() for r in caplog.records]
    assert f"decode engine {decode_url} answered 503: skipped for 10 s" in lines
    assert "GET /health -> 503: {}" in lines
    assert sum("left" in line for line in lines) >= 1, lines
    assert not any(r.exc_info for r in caplog.records)


def test_help_is_plain_text_and_names_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    from kvconn_vllm.proxy import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert ":class:" not in text and "`" not in text, text
    # each option's entry: its signature (``--port PORT``), then its help
    entries = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    helped = {e.split()[0].rstrip(","): " ".join(e.split()[2:]) for e in entries if e.strip()}
    for option in ("--host", "--port", "--prefill", "--decode", "--timeout", "--unreachable-cooldown"):
        assert len(helped.get(option, "")) > 10, f"{option} has no help: {helped}"
