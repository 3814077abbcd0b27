"""The proxy's HTTP connections to its engines: kept alive, reused, Nagle off.

The proxy used to open a connection per leg (urllib, ``Connection: close``)
and answer its clients in HTTP/1.0 (a connection, and a handler thread, per
request): about twice the CPU a request, and 1.6-5.4 ms added to each, where
this adds under 1 ms (``scripts/bench_vllm.py --proxy``; docs/vllm.md).
Here each engine's connections stay open between legs (HTTP/1.1
keep-alive), a leg takes an idle one or opens one, and every socket sends
at once (``TCP_NODELAY``): with Nagle's algorithm on, a response's body
written after its headers waits for the client's delayed ACK, 40 ms a
request on a kept connection.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Generator
from typing import Any
from urllib.parse import urlsplit

#: An idle connection older than this is closed, not reused: servers close
#: idle keep-alive connections (uvicorn, which vLLM serves with, after 5 s),
#: and a request sent as the server closes would be lost in flight.
IDLE_S = 2.0
#: Idle connections kept per engine.
MAX_IDLE = 64
RELAY_BYTES = 1 << 14


class EngineError(Exception):
    """An engine could not be reached or broke off: ``refused`` when it
    refused the connection (nothing of the request reached it)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class _Connection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        assert self.sock is not None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Response:
    """An engine's answer, its body not read yet. Read it whole
    (:meth:`read`) or in pieces (:meth:`chunks`): then its connection goes
    back to the pool; :meth:`close` drops it (an engine sees its client gone)."""

    def __init__(self, pool: Upstream, key: tuple[str, int], conn: _Connection, raw: Any) -> None:
        self._pool, self._key, self._conn, self._raw = pool, key, conn, raw
        self.status: int = raw.status
        self.content_type: str = raw.getheader("Content-Type", "application/json")
        length = raw.getheader("Content-Length")
        #: None: the body's end is the end of a chunked or closed stream.
        self.length: int | None = int(length) if length is not None and length.isdigit() else None

    def read(self) -> bytes:
        try:
            data: bytes = self._raw.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise EngineError(f"the answer broke off: {exc}") from exc
        self._done()
        return data

    def chunks(self) -> Generator[bytes, None, None]:
        """The body as it comes; closing the generator early closes the
        connection (vLLM aborts a request whose client left)."""
        try:
            while chunk := self._raw.read1(RELAY_BYTES):
                yield chunk
            # read1 leaves a body that ended on its length open; read() closes
            # it, and a connection is reused only once its response is closed.
            self._raw.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise EngineError(f"the answer broke off: {exc}") from exc
        except BaseException:  # closed early (GeneratorExit): the client left
            self.close()
            raise
        self._done()

    def _done(self) -> None:
        if self._raw.will_close:
            self.close()
        else:
            self._pool._put(self._key, self._conn)

    def close(self) -> None:
        self._conn.close()

    def close_unless_read(self) -> None:
        """Close the connection if the body was not read to its end (the
        client left, or the answer never began): the engine sees its client
        gone (vLLM aborts the request). A body read whole already went back
        to the pool."""
        if not self._raw.isclosed():
            self.close()


class Upstream:
    """Keep-alive connections to engines, shared by the proxy's handler threads."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[tuple[float, _Connection]]] = {}
        #: Connections opened, for tests and benchmarks: reuse keeps it flat.
        self.opened = 0

    def request(self, url: str, body: bytes | None) -> Response:
        """POST ``body`` (GET when None) to ``url``. A kept connection the
        engine closed meanwhile (it answered nothing) is retried once on a new one."""
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise EngineError(f"{url}: the proxy speaks plain http:// to engines")
        key = (parts.hostname, parts.port or 80)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        method = "GET" if body is None else "POST"
        headers = {} if body is None else {"Content-Type": "application/json"}
        while True:
            conn, reused = self._take(key)
            try:
                conn.request(method, path, body, headers)
                return Response(self, key, conn, conn.getresponse())
            except ConnectionRefusedError as exc:
                conn.close()
                raise EngineError(f"{url}: {exc}", refused=True) from exc
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                conn.close()
                if reused:
                    continue  # closed by the engine while idle; a new connection next
                raise EngineError(f"{url}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise EngineError(f"{url}: {exc}") from exc

    def _take(self, key: tuple[str, int]) -> tuple[_Connection, bool]:
        now = self.clock()
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                since, conn = idle.pop()
                if now - since < IDLE_S:
                    return conn, True
                conn.close()
            self.opened += 1
        return _Connection(key[0], key[1], timeout=self.timeout_s), False

    def _put(self, key: tuple[str, int], conn: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < MAX_IDLE:
                idle.append((self.clock(), conn))
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for _, conn in conns:
                conn.close()
