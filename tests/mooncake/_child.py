"""A child process for the Mooncake tests: runs one kvconn endpoint and obeys commands.

Started with multiprocessing "spawn"; talks over a Pipe. It leaves with
os._exit, skipping the ~1 s engine teardown.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

PAGE = 4096
_PERIOD = (1 << 20) + 4093  # not a multiple of any page size: a misplaced page differs


def pattern(seed: int, n: int) -> Any:
    """Deterministic source bytes, never zero (so landed bytes are countable)."""
    import numpy as np

    block = np.random.default_rng(seed).integers(1, 256, _PERIOD, dtype=np.uint8)
    return np.resize(block, n)


class _Endpoint:
    def __init__(self) -> None:
        import pluggy

        import kvconn.hookspecs
        from kvconn_mooncake import backend

        self.backend = backend
        self.hookspecs = kvconn.hookspecs
        self.pluggy = pluggy
        self.region: Any = None
        self.writer: Any = None
        self.pm: Any = None
        self.raw_engine: Any = None
        self.tokens: dict[int, tuple[Any, Any]] = {}
        self.patterns: dict[tuple[int, int], Any] = {}

    # decode side
    def region_open(self, nbytes: int) -> bytes:
        self.region = self.backend.open_region(nbytes, {})
        return bytes(self.region.metadata)

    def fill(self, value: int) -> None:
        self.region.array()[:] = value

    def count_nonzero(self) -> tuple[float, int]:
        import numpy as np

        t = time.monotonic()
        return t, int(np.count_nonzero(self.region.array()))

    def verify(self, seed: int, src_size: int, segs: list[tuple[int, int, int]]) -> int:
        """Bytes in the region that differ from what ``segs`` should have written."""
        import numpy as np

        key = (seed, src_size)
        if key not in self.patterns:
            self.patterns = {key: pattern(seed, src_size)}
        src = self.patterns[key]
        arr = self.region.array()
        bad = 0
        for s, d, n in segs:
            bad += int(np.count_nonzero(arr[d : d + n] != src[s : s + n]))
        return bad

    # writer side
    def writer_open(self, nbytes: int, seed: int, options: dict[str, str]) -> None:
        self.writer = self.backend.open_writer(nbytes, options)
        self.writer.array()[:] = pattern(seed, nbytes)
        self.pm = self.pluggy.PluginManager("kvconn")
        self.pm.add_hookspecs(self.hookspecs)
        self.pm.register(self.writer)

    def connect(self, peer: str, metadata: bytes, wait_s: float = 30.0) -> bool:
        """Connect, and whether the channel opened within ``wait_s``."""
        self.writer.connect(peer, metadata)
        return bool(self.writer.wait_open(peer, wait_s)) if wait_s > 0 else False

    def writer_batched(self) -> bool:
        """Whether the writer sends many-task batches (else one transfer per segment)."""
        return bool(self.writer.batched)

    def _chunk(self, peer: str, index: int) -> Any:
        from kvconn.chunk import Chunk

        return Chunk(room=1, index=index, last=False, rank=0, peer=peer, src_pages=(), dst_pages=())

    def post(self, peer: str, segs: list[tuple[int, int, int]], key: int = 0) -> float:
        from kvconn.chunk import Segment

        chunk = self._chunk(peer, key)
        t = time.monotonic()
        tok = self.pm.hook.on_post(chunk=chunk, segments=[Segment(*s) for s in segs])
        self.tokens[key] = (chunk, tok)
        return time.monotonic() - t

    def barrier(self, key: int, timeout_s: float) -> tuple[str, float]:
        chunk, tok = self.tokens.pop(key)
        t = time.monotonic()
        res = self.pm.hook.on_done_barrier(chunk=chunk, posted=tok, deadline=t + timeout_s)
        return res.value, time.monotonic() - t

    def transfer(self, peer: str, segs: list[tuple[int, int, int]], timeout_s: float) -> tuple[str, float]:
        t = time.monotonic()
        self.post(peer, segs, key=-1)
        res, _ = self.barrier(-1, timeout_s - (time.monotonic() - t))
        return res, time.monotonic() - t

    def transfer_threads(
        self, peer: str, chunks: list[list[tuple[int, int, int]]], timeout_s: float
    ) -> tuple[list[str], float]:
        """Post and settle several chunks at once, one worker thread each."""
        from concurrent.futures import ThreadPoolExecutor

        from kvconn.chunk import Segment

        def one(i: int) -> str:
            chunk = self._chunk(peer, 1000 + i)
            tok = self.pm.hook.on_post(chunk=chunk, segments=[Segment(*s) for s in chunks[i]])
            return str(
                self.pm.hook.on_done_barrier(
                    chunk=chunk, posted=tok, deadline=time.monotonic() + timeout_s
                ).value
            )

        t = time.monotonic()
        with ThreadPoolExecutor(len(chunks)) as pool:
            out = list(pool.map(one, range(len(chunks))))
        return out, time.monotonic() - t

    def raw_transfer(self, metadata: bytes, segs: list[tuple[int, int, int]]) -> tuple[int, float]:
        """The same writes through kvconn_mooncake.raw (its own engine, same source memory)."""
        from kvconn_mooncake import raw

        if self.raw_engine is None:
            from kvconn_mooncake._engine import new_engine

            self.raw_engine = new_engine("127.0.0.1", "tcp", "")
            assert self.raw_engine.register_memory(self.writer.base, self.writer.nbytes) == 0
        return raw.write_segments(self.raw_engine, self.writer.base, metadata, segs)

    def fence_closing(self) -> tuple[bool, list[tuple[str, int, str, int]]]:
        """Fence as the core does: name the TCP connections the fence closed."""
        import attrs

        from kvconn.runtime.sockets import own_connections

        before = own_connections()
        ok = bool(self.pm.hook.on_fence())
        return ok, [attrs.astuple(c) for c in before - own_connections()]

    def wait_drained(self, closed: list[tuple[str, int, str, int]], timeout_s: float) -> float:
        """Seconds until this (decode) process's ends of ``closed`` drained."""
        from kvconn.protocol.messages import TcpConnection
        from kvconn.runtime.sockets import undrained

        conns = [TcpConnection(*c) for c in closed]
        t0 = time.monotonic()
        while undrained(conns):
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"not drained within {timeout_s} s: {undrained(conns)}")
            time.sleep(0.001)
        return time.monotonic() - t0

    def owner_fence(self) -> tuple[bytes, float]:
        """The region's owner fence: its new metadata and how long it took."""
        from kvconn.transport import owner_fence

        t = time.monotonic()
        metadata = owner_fence(self.region)
        return metadata, time.monotonic() - t

    def second_region(self, nbytes: int) -> bytes:
        self.other_region = self.backend.open_region(nbytes, {})
        return bytes(self.other_region.metadata)

    def region_digest(self) -> str:
        import hashlib

        return hashlib.sha256(self.region.array().tobytes()).hexdigest()

    def fence(self) -> tuple[bool, float, float]:
        t = time.monotonic()
        res = self.pm.hook.on_fence()
        t_end = time.monotonic()
        return bool(res), t_end - t, t_end


def serve(conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(env)
    ep = _Endpoint()
    conn.send(("ok", os.getpid()))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "exit":
            break
        try:
            conn.send(("ok", getattr(ep, op)(*args)))
        except Exception as exc:  # reported to the test, which fails on it
            conn.send(("err", repr(exc)))
    os._exit(0)
