"""Child processes for the NIXL backend tests (spawn targets, so importable).

A decode child owns a region; a writer child owns a writer and calls the hooks
through a real pluggy manager. Both serve commands over a Pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvconn.runtime.procs import wait_until_stopped
from kvconn.testing import waiting

SPAWN = mp.get_context("spawn")
PAGE = 4096


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes, cheap for large sizes (a random 1 MiB block tiled
    with a per-block offset so that misplaced pages are caught)."""
    block = np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8)
    reps = -(-nbytes // block.size)
    out = np.tile(block, reps)[:nbytes]
    if reps > 1:
        out = out.reshape(-1)
        idx = np.repeat(np.arange(reps, dtype=np.uint8), block.size)[:nbytes]
        out += idx
    return out


def segments_array(segs: Any) -> np.ndarray:
    return np.asarray(segs, dtype=np.int64).reshape(-1, 3)


# ---------------------------------------------------------------- decode child


def decode_main(conn: Connection, nbytes: int, options: Mapping[str, str]) -> None:
    from kvconn_nixl import backend

    region = backend.open_region(nbytes, options)
    arr = region.array()
    conn.send(region.metadata)
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            region.close()
            conn.send("bye")
            return
        if cmd == "fill":
            arr[:] = args[0]
            conn.send(True)
        elif cmd == "count":  # bytes equal to a value
            conn.send(int(np.count_nonzero(arr == args[0])))
        elif cmd == "nonzero":
            conn.send(int(np.count_nonzero(arr)))
        elif cmd == "verify":  # seed, src_nbytes, segments -> mismatching segments
            seed, src_nbytes, segs = args
            src = pattern(seed, src_nbytes)
            bad = 0
            for s, d, n in segments_array(segs):
                if not np.array_equal(arr[d : d + n], src[s : s + n]):
                    bad += 1
            conn.send(bad)
        else:
            conn.send(ValueError(f"unknown command {cmd!r}"))


# ---------------------------------------------------------------- writer child


def writer_main(conn: Connection, nbytes: int, options: Mapping[str, str]) -> None:
    import pluggy

    from kvconn import hookspecs
    from kvconn.chunk import Chunk, Segment
    from kvconn_nixl import backend

    writer = backend.open_writer(nbytes, options)
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(writer)
    src = writer.array()
    conn.send(os.getpid())

    def chunk(room: int, peer: str) -> Chunk:
        return Chunk(room=room, index=0, last=True, rank=0, peer=peer, src_pages=(), dst_pages=())

    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "exit":
                writer.close()
                conn.send("bye")
                return
            if cmd == "connect":
                writer.connect(args[0], args[1])
                conn.send(True)
            elif cmd == "fill_seed":
                src[:] = pattern(args[0], nbytes)
                conn.send(True)
            elif cmd == "fill":
                src[:] = args[0]
                conn.send(True)
            elif cmd == "write":  # peer, segments, timeout -> settlement, seconds
                peer, segs, timeout = args
                c = chunk(1, peer)
                seg = [Segment(int(s), int(d), int(n)) for s, d, n in segments_array(segs)]
                t0 = time.perf_counter()
                posted = pm.hook.on_post(chunk=c, segments=seg)
                st = pm.hook.on_done_barrier(chunk=c, posted=posted, deadline=time.monotonic() + timeout)
                conn.send((st.value, time.perf_counter() - t0))
            elif cmd == "write_then_fence":
                # The fence scenario: post, wait at the barrier with a short
                # deadline (the test freezes us meanwhile), and on UNSETTLED
                # fence first thing.
                peer, segs, timeout = args
                c = chunk(2, peer)
                seg = [Segment(int(s), int(d), int(n)) for s, d, n in segments_array(segs)]
                deadline = time.monotonic() + timeout  # for the chunk, as the core does
                posted = pm.hook.on_post(chunk=c, segments=seg)
                conn.send(("posted", time.monotonic()))
                st = pm.hook.on_done_barrier(chunk=c, posted=posted, deadline=deadline)
                fenced = None
                t_fence = 0.0
                if st.value == "unsettled":
                    del posted
                    t0 = time.perf_counter()
                    fenced = pm.hook.on_fence()
                    t_fence = time.perf_counter() - t0
                conn.send((st.value, fenced, t_fence))
            elif cmd == "fence":
                t0 = time.perf_counter()
                conn.send((pm.hook.on_fence(), time.perf_counter() - t0))
            else:
                conn.send(ValueError(f"unknown command {cmd!r}"))
        except Exception as exc:  # report, keep serving
            conn.send(exc)


# ---------------------------------------------------------------- parent side


class Child:
    """A spawned child serving commands; stopped only by its own pid."""

    def __init__(
        self, target: Any, nbytes: int, options: Mapping[str, str], start_timeout: float = 30
    ) -> None:
        self.conn, child_conn = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=target, args=(child_conn, nbytes, dict(options)), daemon=True)
        self.proc.start()
        child_conn.close()
        self.hello = self.recv(start_timeout)

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def recv(self, timeout: float = 30) -> Any:
        """``timeout``: seconds of an idle machine (longer while it is loaded)."""
        if not waiting.wait(self.conn.poll, timeout):
            raise TimeoutError(f"child {self.proc.pid} silent for {timeout} s of an idle machine")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def call(self, *cmd: Any, timeout: float = 30) -> Any:
        self.conn.send(cmd)
        return self.recv(timeout)

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)
        if sig == signal.SIGSTOP:
            wait_until_stopped(self.pid)

    def stop(self) -> None:
        if not self.proc.is_alive():
            self.proc.join(1)
            return
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGCONT)
        try:
            self.conn.send(("exit",))
            if self.conn.poll(10):
                self.conn.recv()
        except (OSError, EOFError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
            self.proc.join(5)


@contextlib.contextmanager
def children(*specs: tuple[Any, int, Mapping[str, str]]) -> Iterator[list[Child]]:
    started: list[Child] = []
    try:
        for target, nbytes, options in specs:
            started.append(Child(target, nbytes, options))
        yield started
    finally:
        for child in reversed(started):
            child.stop()
