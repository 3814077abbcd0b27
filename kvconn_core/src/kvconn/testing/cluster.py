"""A decode endpoint in the test process, prefill ranks as real processes,
and an allocator that lays a canary in every page it hands back, so a write
that lands after a release is found and counted."""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import zmq

from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.protocol.hold import Proof, Release
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.runtime.procs import wait_until_stopped
from kvconn.testing.child import Child
from kvconn.testing.faults import AckProxy
from kvconn.testing.pages import CanaryPages

LOOPBACK_SLOW = {"piece_bytes": "16384", "piece_delay_s": "0.004"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


T = TypeVar("T")


def at_the_same_address(make: Callable[[], T], timeout: float = 10.0) -> T:
    """``make()`` an endpoint at an address just given up: ZMQ closes a
    socket on a thread of its own, so the address frees a moment after
    close() returns."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return make()
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class Rank(Child):
    """A prefill rank process (``python -m kvconn.testing.faults``)."""

    def __init__(self, args: dict[str, Any], netns: str | None = None, wrap: Sequence[str] = ()) -> None:
        """``wrap``: a command the rank runs under (e.g. ``unshare ...``)."""
        prefix = [*(["ip", "netns", "exec", netns] if netns else []), *wrap]
        env = {"NIXL_LOG_LEVEL": "WARN", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}
        super().__init__("kvconn.testing.faults", args, prefix, env)
        self.address = ""
        self.killed = False

    def ready(self, timeout: float = 30) -> str:
        self.address = str(self.next_with("address", timeout, "rank start")["address"])
        return self.address

    def metrics(self, timeout: float = 10) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """The rank's Prometheus samples; also proves its listener thread's
        process is alive and answering."""
        self.send_line("metrics")
        samples = self.next_with("samples", timeout, "rank metrics")["samples"]
        return {(n, frozenset(lab.items())): v for n, lab, v in samples}

    def value(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, frozenset(labels.items())), 0.0)

    def unsettled(self, timeout: float = 10) -> list[tuple[int, float]]:
        """(room, seconds since decode asked for it) of the rooms the rank
        still works on (``prefill_proc.Driver.unsettled``)."""
        self.send_line("rooms")
        rooms = self.next_with("unsettled", timeout, "rank rooms")["unsettled"]
        return [(int(room), float(age)) for room, age in rooms]

    def spans(self, timeout: float = 10) -> list[dict[str, Any]]:
        """The spans the rank process finished so far (a ``Cluster`` with
        ``tracing``), as :func:`kvconn.runtime.trace_export.span_record` makes them."""
        self.send_line("spans")
        spans: list[dict[str, Any]] = self.next_with("spans", timeout, "rank spans")["spans"]
        return spans

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            if sig == signal.SIGSTOP:
                wait_until_stopped(self.proc.pid)
        if sig == signal.SIGKILL:
            self.killed = True


class Cluster:
    """``num_ranks`` prefill processes and one decode endpoint over
    ``num_pages`` canary-filled pages."""

    def __init__(
        self,
        backend: str = "loopback",
        num_ranks: int = 2,
        num_pages: int = 256,
        page_bytes: int = 64 << 10,
        chunk_pages: int = 4,
        write_timeout_s: float = 0.5,
        abort_timeout_s: float = 1.5,
        backend_options: dict[str, str] | None = None,
        key: bytes | None = None,
        rank_key: bytes | str | None = "same",
        observers: Sequence[Sequence[dict[str, Any]]] = (),
        proxy: bool = False,
        decode_host: str = "127.0.0.1",
        rank_host: str = "127.0.0.1",
        netns: str | None = None,
        wrap: Sequence[str] = (),
        bootstrap_timeout_s: float = 20.0,
        start_decode: bool = True,
        legacy: bool = False,
        rank_args: dict[str, Any] | None = None,
        chunk_gap_s: float = 0.0,
        decode_config: Mapping[str, Any] | None = None,
        tracing: bool = False,
        rank_wire_version: int | None = None,
    ) -> None:
        """``legacy``: the timeout-only mode kvconn is compared with (ranks
        send no acks, decode frees pages at its deadline without proof).
        ``rank_args``: more arguments for every rank process (faults.py's
        and prefill_proc.py's, e.g. ``drain_on_sigterm``).
        ``chunk_gap_s``: each rank waits this long between two chunks (a room
        stays in flight long enough to freeze its writer in it).
        ``decode_config``: more :class:`~kvconn.config.Config` fields, for
        decode only (e.g. ``owner_fence_after_s``).
        ``tracing``: every endpoint traces (``Config.tracing``), each rank
        process into an in-memory exporter (:meth:`Rank.spans`).
        ``rank_wire_version``: the ranks stamp and accept only this wire
        version (a peer built before the current one)."""
        self.backend = get_backend(backend)
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.num_ranks = num_ranks
        self.shard = page_bytes // num_ranks
        self.key = key
        self.options = dict(
            LOOPBACK_SLOW if backend == "loopback" and backend_options is None else backend_options or {}
        )
        self.config = Config(
            write_timeout_s=write_timeout_s,
            abort_timeout_s=abort_timeout_s,
            resend_interval_s=0.25,
            bootstrap_timeout_s=bootstrap_timeout_s,
            host=decode_host,
            auth_key=key,
            backend_options=self.options,
            unsafe_release_at_deadline=legacy,
            acks_enabled=not legacy,
            tracing=tracing,
        )
        self.decode_options = dict(decode_config or {})
        rk = key if rank_key == "same" else rank_key
        self.ranks: list[Rank] = []
        self.lock = threading.Lock()
        self.releases: list[Release] = []
        self._pages: CanaryPages | None = None
        self.proxy: AckProxy | None = None
        self.decode: DecodeEndpoint | None = None
        self._rank_args: list[dict[str, Any]] = []
        self.extra_ranks: list[Rank] = []
        self._netns, self._wrap = netns, wrap
        try:
            for r in range(num_ranks):
                args = {
                    "backend": backend,
                    "rank": r,
                    "page_bytes": page_bytes,
                    "num_ranks": num_ranks,
                    "chunk_pages": chunk_pages,
                    "source_pages": num_pages,
                    "write_timeout_s": write_timeout_s,
                    "abort_timeout_s": abort_timeout_s,
                    "backend_options": self.options,
                    "host": rank_host,
                    "observers": list(observers[r]) if r < len(observers) else [],
                    "acks_enabled": not legacy,
                    "chunk_gap_s": chunk_gap_s,
                    "tracing": tracing,
                    **(rank_args or {}),
                }
                if rank_wire_version is not None:
                    args["wire_version"] = rank_wire_version
                if rk:
                    assert isinstance(rk, bytes)
                    args["auth_key"] = rk.hex()
                self._rank_args.append(args)
                self.ranks.append(Rank(args, netns, wrap))
            for rank in self.ranks:
                rank.ready()
            if start_decode:
                self.start_decode(proxy)
        except BaseException:
            self.close()
            raise

    def another_instance(self) -> list[Rank]:
        """Start a second prefill instance like the first (its ranks' processes,
        ready; decode names their addresses as ``prefill=``): closed with the
        cluster."""
        ranks = [Rank(args, self._netns, self._wrap) for args in self._rank_args]
        self.extra_ranks += ranks
        for rank in ranks:
            rank.ready()
        return ranks

    def restart_rank(self, r: int, timeout: float = 10.0) -> Rank:
        """Start rank ``r`` anew at the address of the process before it
        (which must be gone): a restart, as decode sees one. The earlier
        process is closed with the cluster."""
        old = self.ranks[r]
        port = int(old.address.rsplit(":", 1)[1])
        deadline = time.monotonic() + timeout
        while True:
            rank = Rank({**self._rank_args[r], "port": port}, self._netns, self._wrap)
            try:
                rank.ready()
                break
            except AssertionError:  # the address is not free yet (the old sockets close)
                rank.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.extra_ranks.append(old)
        self.ranks[r] = rank
        return rank

    def start_decode(self, proxy: bool = False) -> DecodeEndpoint:
        with self.lock:
            self.releases = []
        self.decode = DecodeEndpoint(
            self.backend,
            self.num_pages,
            self.page_bytes,
            [r.address for r in self.ranks],
            attrs.evolve(self.config, **self.decode_options),  # self.config as it is now
            on_release=self._on_release,
        )
        self._pages = CanaryPages(self.decode.region, self.num_pages, self.page_bytes, self.num_ranks)
        if proxy:
            self.proxy = AckProxy(self.decode.address, self.config.host, self.key)
            # ABORTs name the proxy as the place to ack: every ack crosses it.
            self.decode.tracker.reply_to = self.proxy.address
        return self.decode

    @property
    def dec(self) -> DecodeEndpoint:
        assert self.decode is not None
        return self.decode

    @property
    def pages(self) -> CanaryPages:
        """Decode's pages (a fresh pool each time decode starts)."""
        assert self._pages is not None, "decode has not started"
        return self._pages

    # -- the allocator -----------------------------------------------------
    def alloc(self, n: int, exclude: Sequence[int] = ()) -> list[int]:
        return self.pages.take(n, exclude)[0]

    def _give_back(self, pages: Sequence[int]) -> None:
        self.pages.give_back(pages)

    def _on_release(self, rel: Release) -> None:
        with self.lock:
            self.releases.append(rel)
        self._give_back(rel.pages)

    def finish(self, rx: Receiver) -> None:
        self._give_back(rx.finish())

    def open(
        self, room: int, npages: int, ranks: frozenset[int] | None = None, exclude: Sequence[int] = ()
    ) -> tuple[Receiver, list[int]]:
        pages = self.alloc(npages, exclude)
        return self.dec.receiver(room, pages, ranks), pages

    def released(self, room: int) -> Release | None:
        with self.lock:
            return next((r for r in self.releases if r.room == room), None)

    # -- checks ------------------------------------------------------------
    def landed_bytes(self, pages: Sequence[int]) -> int:
        """Bytes of ``pages`` that are not canary any more."""
        return sum(self.pages.dirty_bytes(p) for p in pages)

    def late_pages(self, pages: Sequence[int] | None = None) -> list[int]:
        """Pages handed back (of ``pages``, or all) that a write reached after
        they were given back."""
        free = self.pages.free_pages()
        if pages is not None:
            free = sorted(set(free) & set(pages))
        return [p for p in free if self.pages.dirty_bytes(p)]

    def late_bytes(self) -> int:
        """Bytes written into free pages (pages handed back) after they were
        given back: must be 0."""
        return sum(self.pages.dirty_bytes(p) for p in self.pages.free_pages())

    def correct(self, room: int, pages: Sequence[int], ranks: Sequence[int] | None = None) -> bool:
        return not self.pages.wrong_pattern(room, pages, ranks)

    def metric(self, name: str, **labels: str) -> float:
        return self.dec.metrics.value(name, **labels)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        for rank in self.ranks + self.extra_ranks:
            rank.close()
        if self.decode is not None:
            self.decode.close()


def total(metric: Callable[..., float], name: str, labels: str, values: Sequence[str]) -> float:
    return sum(metric(name, **{labels: v}) for v in values)


PROOFS = tuple(p.value for p in Proof)
