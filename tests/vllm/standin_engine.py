"""A stand-in for a ``vllm serve`` engine behind the proxy, as quick as an
HTTP server in Python gets: HTTP/1.1 keep-alive, Nagle off, each answer in
one write (a prefill's with ``kv_transfer_params``; a decode's as JSON, or
streamed as server-sent events in chunked framing, as uvicorn sends them).
It counts the connections it accepted. For the proxy's tests and its
benchmark (``scripts/bench_vllm.py --proxy``); run alone it prints its port:

    python tests/vllm/standin_engine.py
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PARAMS = {
    "do_remote_prefill": True,
    "kvconn_room": 7,
    "kvconn_prefill": ["tcp://127.0.0.1:1"],
    "remote_num_tokens": 3,
}
EVENTS = 3


class StandinEngine(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.connections = 0
        self.requests = 0
        #: Close each connection after its answer, without saying so (as a
        #: server closing an idle keep-alive connection does).
        self.close_after_each = False
        self._count = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_port}"

    def start(self) -> StandinEngine:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StandinEngine

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server._count:
            self.server.connections += 1

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server._count:
            self.server.requests += 1
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            answer: dict[str, Any] = {"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}
        else:
            answer = {"choices": [{"text": "decoded"}]}
        if not body.get("stream"):
            data = json.dumps(answer).encode()
            self._write(200, "application/json", f"Content-Length: {len(data)}", data)
            return
        events = [f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode() for i in range(EVENTS)]
        events.append(b"data: [DONE]\n\n")
        framed = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
        self._write(200, "text/event-stream", "Transfer-Encoding: chunked", framed)

    def _write(self, status: int, content_type: str, framing: str, data: bytes) -> None:
        head = f"HTTP/1.1 {status} OK\r\nContent-Type: {content_type}\r\n{framing}\r\n\r\n"
        self.wfile.write(head.encode() + data)
        self.close_connection = self.server.close_after_each

    def log_message(self, format: str, *args: Any) -> None:
        pass


if __name__ == "__main__":
    engine = StandinEngine()
    print(engine.server_port, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        engine.serve_forever(poll_interval=0.05)
