"""A small prefill/decode proxy in front of ``vllm serve`` engines that run
:class:`~kvconn_vllm.KvconnConnector`.

Each OpenAI completion or chat request goes twice: to a prefill engine with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, then,
with the ``kv_transfer_params`` prefill answered, to a decode engine, whose
response (streamed or not) goes back to the client as it comes. Engines are
taken in turn; one decode can be fed by any number of prefill engines, since
each request names its prefill instance. The standard library only, so it
runs wherever the connector does::

    kvconn-vllm-proxy --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Draining an engine (scale-down, rolling upgrade): ``POST /kvconn/drain`` with
``{"prefill": URL}`` or ``{"decode": URL}`` takes it out of the rotation (the
requests it is serving finish), ``POST /kvconn/undrain`` puts it back, and
``GET /kvconn/engines`` lists them, each with ``in_flight``: the requests
the proxy sent through it that have not ended (at a prefill engine, from
its leg until the decode leg that took the request's KV ended). An engine
that refuses connections or answers 503 (shutting down) before a leg
started is skipped for ``--unreachable-cooldown`` seconds and the leg goes
to the next one: a request that had not started never fails because one
engine is going away.

It logs one line (stderr) for each error it answers and each client that
left, never a traceback for either.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvconn_vllm.params import DO_REMOTE_DECODE
from kvconn_vllm.upstream import EngineError, Response, Upstream

#: The OpenAI endpoints that generate, and so go through prefill first.
GENERATE = ("/v1/completions", "/v1/chat/completions")
#: Read endpoints answered by a decode engine.
PASS_THROUGH = ("/v1/models", "/health", "/version")
log = logging.getLogger(__name__)


class UpstreamError(Exception):
    """An engine answered with an error, or could not be reached."""

    def __init__(
        self, status: int, body: bytes, content_type: str = "application/json", elsewhere: bool = False
    ) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.content_type = status, body, content_type
        #: Nothing of the leg started there (unreachable, or 503: shutting
        #: down): it may go to another engine.
        self.elsewhere = elsewhere


class Body:
    """An engine's answer's body as the proxy relays it, in chunks; closing
    it (at its end, or early: the client left, or the answer never began)
    closes the engine's answer and ends the request's count at its engines."""

    def __init__(self, response: Response, done: Callable[[], None]) -> None:
        self._response, self._done = response, done
        self._chunks = response.chunks()
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._chunks.close()
            self._response.close_unless_read()
        finally:
            self._done()


#: An engine's answer as the proxy relays it: status, content type, body
#: length (None: streamed, its end unknown) and body.
Relayed = tuple[int, str, int | None, Body]


def _error(status: int, message: str, elsewhere: bool = False) -> UpstreamError:
    body = json.dumps({"error": {"message": message, "type": "kvconn_proxy", "code": status}})
    return UpstreamError(status, body.encode(), elsewhere=elsewhere)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """What a prefill engine gets: the prompt, one token, no stream, and the
    ask to keep the KV for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {DO_REMOTE_DECODE: True}
    return out


class _Engines:
    """Round-robin over base URLs, safe across handler threads, skipping the
    engines told to drain and, for a while, those found unreachable."""

    def __init__(
        self, role: str, urls: Sequence[str], cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not urls:
            raise ValueError("at least one engine URL is needed")
        self.role = role
        self.urls = [u.rstrip("/") for u in urls]
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.cooldown_s, self.clock = cooldown_s, clock
        self.draining: set[str] = set()
        self._out_until: dict[str, float] = {}
        #: Requests sent through each engine that have not ended.
        self._in_flight: dict[str, int] = dict.fromkeys(self.urls, 0)

    def candidates(self) -> list[str]:
        """The engines to try for one leg, in order: the next in turn first."""
        with self._lock:
            start = next(self._turn)
            now = self.clock()
            ring = [self.urls[(start + i) % len(self.urls)] for i in range(len(self.urls))]
            usable = [u for u in ring if u not in self.draining and self._out_until.get(u, 0.0) <= now]
        if not usable:
            raise _error(503, f"every {self.role} engine is draining or unreachable: {self.urls}")
        return usable

    def next(self) -> str:
        return self.candidates()[0]

    def unreachable(self, url: str) -> None:
        with self._lock:
            self._out_until[url] = self.clock() + self.cooldown_s

    def started(self, url: str) -> None:
        with self._lock:
            self._in_flight[url] += 1

    def ended(self, url: str) -> None:
        with self._lock:
            self._in_flight[url] -= 1

    def set_draining(self, url: str, draining: bool) -> None:
        url = url.rstrip("/")
        if url not in self.urls:
            raise _error(404, f"{url} is not a {self.role} engine of this proxy ({self.urls})")
        with self._lock:
            (self.draining.add if draining else self.draining.discard)(url)

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            now = self.clock()
            return [
                {
                    "url": u,
                    "draining": u in self.draining,
                    "in_flight": self._in_flight[u],
                    "unreachable_for_s": max(0.0, self._out_until.get(u, 0.0) - now),
                }
                for u in self.urls
            ]


class Proxy:
    """The request flow, apart from HTTP serving (see :func:`serve`)."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        timeout_s: float = 600.0,
        unreachable_cooldown_s: float = 10.0,
    ) -> None:
        self.prefill = _Engines("prefill", prefill, unreachable_cooldown_s)
        self.decode = _Engines("decode", decode, unreachable_cooldown_s)
        self.timeout_s = timeout_s
        self.upstream = Upstream(timeout_s)

    def set_draining(self, role: str, url: str, draining: bool) -> None:
        """Take an engine out of the rotation (``draining``) or put it back."""
        engines = {"prefill": self.prefill, "decode": self.decode}.get(role)
        if engines is None:
            raise _error(400, f"name the engine as prefill or decode, got {role!r}")
        engines.set_draining(url, draining)

    def engines(self) -> dict[str, list[dict[str, Any]]]:
        return {"prefill": self.prefill.describe(), "decode": self.decode.describe()}

    def _first(self, engines: _Engines, path: str, body: dict[str, Any] | None) -> tuple[str, Response]:
        """The first engine that takes the leg, and its response; one found
        unreachable or shutting down before the leg started is skipped. The
        leg counts as in flight there (the caller ends it)."""
        error: UpstreamError | None = None
        for base in engines.candidates():
            engines.started(base)
            try:
                return base, self._open(base + path, body)
            except UpstreamError as exc:
                engines.ended(base)
                if not exc.elsewhere:
                    raise
                engines.unreachable(base)
                log.info(
                    "%s engine %s %s: skipped for %.0f s",
                    engines.role,
                    base,
                    "is unreachable" if exc.status == 502 else f"answered {exc.status}",
                    engines.cooldown_s,
                )
                error = exc
        assert error is not None  # candidates() is never empty
        raise error

    def _open(self, url: str, body: dict[str, Any] | None) -> Response:
        """The engine's answer to one leg; an error status is raised as
        :class:`UpstreamError` (503, shutting down: ``elsewhere``)."""
        data = None if body is None else json.dumps(body).encode()
        try:
            response = self.upstream.request(url, data)
            if response.status < 400:
                return response
            raise UpstreamError(
                response.status, response.read(), response.content_type, response.status == 503
            )
        except EngineError as exc:
            raise _error(502, str(exc), elsewhere=exc.refused) from exc

    def kv_params(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run the prefill leg; return the ``kv_transfer_params`` for decode."""
        base, params = self.prefill_leg(path, body)
        self.prefill.ended(base)
        return params

    def prefill_leg(self, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The prefill leg: the engine that ran it (the request stays in
        flight there until the caller ends it) and its ``kv_transfer_params``."""
        base, response = self._first(self.prefill, path, prefill_request(body))
        url = base + path
        try:
            try:
                answer = json.loads(response.read())
            except EngineError as exc:
                raise _error(502, str(exc)) from exc
            except ValueError as exc:
                raise _error(502, f"{url} answered something that is not JSON: {exc}") from exc
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if not isinstance(params, dict):
                raise _error(
                    502,
                    f"{url} answered no kv_transfer_params: is it a vllm serve with "
                    "kv_connector=KvconnConnector and kv_role kv_producer or kv_both?",
                )
        except BaseException:
            self.prefill.ended(base)
            raise
        return base, params

    def generate(self, path: str, body: dict[str, Any]) -> Relayed:
        """Both legs: status, content type and the decode engine's body. The
        request is in flight at its prefill engine until the decode leg (which
        took its KV from there) ends."""
        prefill, params = self.prefill_leg(path, body)
        try:
            decode, response = self._first(self.decode, path, {**body, "kv_transfer_params": params})
        except BaseException:
            self.prefill.ended(prefill)
            raise

        def done() -> None:
            self.decode.ended(decode)
            self.prefill.ended(prefill)

        return response.status, response.content_type, response.length, Body(response, done)

    def get(self, path: str) -> Relayed:
        base, response = self._first(self.decode, path, None)
        return (
            response.status,
            response.content_type,
            response.length,
            Body(response, lambda: self.decode.ended(base)),
        )


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # Keep-alive for clients that want it. A streamed answer goes in
        # chunked framing (HTTP/1.0 clients: until the connection closes).
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body are separate writes, token events small ones:
            # none may wait for the ACK of the one before (Nagle).
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_POST(self) -> None:
            try:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            except ValueError:
                self.close_connection = True  # its body's end is unknown
                return self._send_error(_error(400, "bad Content-Length"))
            if self.path in ("/kvconn/drain", "/kvconn/undrain"):
                return self._drain(raw, self.path == "/kvconn/drain")
            if self.path not in GENERATE:
                return self._send_error(_error(404, f"{self.path}: not a generation endpoint"))
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("the request body is not a JSON object")
            except ValueError as exc:
                return self._send_error(_error(400, f"bad request body: {exc}"))
            self._answer(lambda: proxy.generate(self.path, body))

        def _drain(self, raw: bytes, draining: bool) -> None:
            try:
                body = json.loads(raw)
                if not isinstance(body, dict) or len(body) != 1:
                    raise ValueError('send {"prefill": URL} or {"decode": URL}')
                [(role, url)] = body.items()
                proxy.set_draining(str(role), str(url), draining)
            except ValueError as exc:
                return self._send_error(_error(400, f"bad drain request: {exc}"))
            except UpstreamError as exc:
                return self._send_error(exc)
            self._send_json(proxy.engines())

        def _send_json(self, value: object) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/kvconn/engines":
                return self._send_json(proxy.engines())
            if self.path not in PASS_THROUGH:
                return self._send_error(_error(404, f"{self.path}: unknown"))
            self._answer(lambda: proxy.get(self.path))

        def _answer(self, leg: Callable[[], Relayed]) -> None:
            try:
                status, content_type, length, body = leg()
            except UpstreamError as exc:
                return self._send_error(exc)
            chunked = length is None and self.request_version == "HTTP/1.1"
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                if length is not None:
                    self.send_header("Content-Length", str(length))
                elif chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.close_connection = True
                    self.send_header("Connection", "close")
                self.end_headers()
                for chunk in body:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                    self.wfile.flush()
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
            except ConnectionError as exc:
                # The client left: closing decode's connection (closing the
                # body) makes vLLM abort the request.
                self.close_connection = True
                self._client_left(exc)
            except EngineError as exc:
                self.close_connection = True  # the engine broke off: so does this answer
                log.warning("%s %s: the engine broke off its answer: %s", self.command, self.path, exc)
            finally:
                body.close()

        def _send_error(self, exc: UpstreamError) -> None:
            if exc.status >= 500:
                log.warning("%s %s -> %d: %s", self.command, self.path, exc.status, _reason(exc))
            try:
                self.send_response(exc.status)
                self.send_header("Content-Type", exc.content_type)
                self.send_header("Content-Length", str(len(exc.body)))
                self.end_headers()
                self.wfile.write(exc.body)
            except ConnectionError as left:
                self.close_connection = True
                self._client_left(left)

        def _client_left(self, exc: BaseException) -> None:
            host, port = self.client_address[:2]
            log.info("client %s:%s left (%s %s): %s", host, port, self.command, self.path, exc)

        def handle(self) -> None:
            try:
                super().handle()
            except ConnectionError as exc:  # between requests, or before one was read
                host, port = self.client_address[:2]
                log.info("client %s:%s left: %s", host, port, exc)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # vLLM logs every request already

    return Handler


def _reason(exc: UpstreamError) -> str:
    """An error answer's message, for a log line."""
    try:
        message = json.loads(exc.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return exc.body[:200].decode(errors="replace") or f"HTTP {exc.status}"
    return str(message)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line for what escaped a handler (socketserver prints a traceback)."""
        log.exception("request from %s failed", client_address)


def serve(proxy: Proxy, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server for ``proxy``, bound; call ``serve_forever()`` on it."""
    return _Server((host, port), _handler(proxy))


DESCRIPTION = (
    "A prefill/decode proxy in front of vLLM OpenAI servers that run kvconn's KV connector "
    "(KvconnConnector): each completion or chat request goes to a prefill engine, then, with the "
    "kv_transfer_params it answered, to a decode engine, whose answer is relayed. "
    'POST /kvconn/drain or /kvconn/undrain with {"prefill": URL} or {"decode": URL} takes an '
    "engine out of the rotation or back; GET /kvconn/engines lists them with their requests in flight."
)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvconn-vllm-proxy", description=DESCRIPTION)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one)"
    )
    parser.add_argument("--prefill", nargs="+", required=True, help="base URLs of the prefill engines")
    parser.add_argument("--decode", nargs="+", required=True, help="base URLs of the decode engines")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per engine request")
    parser.add_argument(
        "--unreachable-cooldown",
        type=float,
        default=10.0,
        help="seconds an engine that refused a connection (or answered 503) is skipped",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvconn-vllm-proxy %(levelname)s %(message)s")
    proxy = Proxy(args.prefill, args.decode, args.timeout, args.unreachable_cooldown)
    server = serve(proxy, args.host, args.port)
    print(f"kvconn-vllm-proxy on http://{args.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
