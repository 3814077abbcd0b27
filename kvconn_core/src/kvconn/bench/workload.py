"""One bench mode: a decode endpoint (this process) and N prefill rank
processes, a stream of requests, some aborted mid-transfer, every byte and
every released page checked.

Verification:
* a completed room's pages are compared byte for byte with the pattern;
* every page that goes back to the free pool (released after an abort, or
  taken by the engine and done with) gets a canary at once; the canary is
  checked when the page is handed out again and at the end: a changed canary
  is a write after release, charged to the room that last owned the page
  (pages never handed out are neither laid nor checked);
* every aborted room is accounted for: released with a named proof, or still
  held / quarantined at the end (counted, never freed);
* pages kvconn holds never exceed the pages of rooms aborted and not released.

Equal work for every run compared: the pool holds what the run needs and
hands the page given back last out first (so the pages a run touches stay
few, whatever its size), and a room's abort falls at a time after its
request drawn from the seed (``abort_window_s``), kept by a clock, not by
passes of the loop that polls the rooms (whose length grows with them).
"""

from __future__ import annotations

import argparse
import heapq
import random
import resource
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvconn.bench import cpu
from kvconn.bench.mode_result import KVCONN, LEGACY, ModeResult, Violation
from kvconn.bench.prefill_worker import PrefillProcs
from kvconn.bench.stats import bucket_bound
from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.hold import HoldState, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.testing.patterns import canary, shard_bytes

#: The pause between two polls of the rooms in flight, per room: about what
#: one ``Receiver.poll`` and its loop cost (2 µs), so polling takes at most
#: about half of the bench process's GIL however many rooms are in flight.
POLL_PAUSE_PER_ROOM_S = 2e-6
#: Where aborts fall after their request, by default: a fixed time, so that
#: runs on a loaded machine and on an idle one (and the points of a curve)
#: run the same schedule; a window taken from the machine's own latency made
#: two runs compared abort 15 and 199 rooms mid-transfer.
DEFAULT_ABORT_WINDOW_MS = 20.0


@attrs.frozen
class Workload:
    requests: int
    pages: int
    page_bytes: int
    chunk_pages: int
    ranks: int
    concurrency: int
    abort_fraction: float
    prefill_fail_fraction: float
    seed: int
    pool_pages: int
    stream_requests: int
    #: decode endpoints asking for every room (each its own pool of pool_pages)
    decodes: int = 1

    @property
    def shard(self) -> int:
        return self.page_bytes // self.ranks


@attrs.frozen
class Planned:
    room: int
    abort: bool
    abort_u: float  #: where in the abort window the abort falls, 0..1


def plan(wl: Workload) -> tuple[list[Planned], list[int]]:
    """The workload's rooms and their fate (same seed, same plan), and the
    streaming phase's rooms: ones no prefill rank is set to fail."""
    rng = random.Random(wl.seed)
    seen: set[int] = set()

    def new_room() -> int:
        while True:
            room = rng.getrandbits(63)
            if room and room not in seen:
                seen.add(room)
                return room

    work = [Planned(new_room(), rng.random() < wl.abort_fraction, rng.random()) for _ in range(wl.requests)]
    stream: list[int] = []
    while len(stream) < wl.stream_requests:
        room = new_room()
        # mirrors kvconn.testing.prefill_proc's per-room failure draw
        if all(
            random.Random(room ^ (wl.seed << 1) ^ r).random() >= wl.prefill_fail_fraction
            for r in range(wl.ranks)
        ):
            stream.append(room)
    return work, stream


def plan_for_decode(work: Sequence[Planned], decode: int, wl: Workload) -> list[Planned]:
    """The same rooms as seen by decode endpoint ``decode`` (prefill TP smaller
    than decode TP: every decode asks for every room): decode 0 keeps the plan,
    every other one draws its own aborts, so each copy of a room is aborted
    independently of the others."""
    if decode == 0:
        return list(work)
    rng = random.Random((wl.seed << 8) ^ decode)
    return [Planned(p.room, rng.random() < wl.abort_fraction, rng.random()) for p in work]


@attrs.define
class _Active:
    rx: Receiver
    pages: tuple[int, ...]
    started: float
    abort_at: float | None


@attrs.define
class _Aborted:
    room: int
    npages: int
    at: float
    kind: str  #: "decode" (planned abort) or "prefill_fail"


def pool_pages(wl_pages: int, concurrency: int, stream_requests: int = 0) -> int:
    """Decode pages a run needs: its rooms in flight, as many again for
    aborted rooms whose pages are held until proof (a run that holds more
    waits for pages), and at least the streaming phase's rooms."""
    return max(2 * concurrency * wl_pages, stream_requests * wl_pages, wl_pages)


def source_pages(wl: Workload) -> int:
    """A rank's source pages (each decode's rooms have their own): its rooms
    in flight, and as many again for rooms whose senders have not settled
    (the stand-in engine waits for the oldest to settle when it wraps
    around); at least 512, as a small run always had."""
    return max(2 * wl.concurrency * wl.pages * wl.decodes, 512, wl.pages)


@attrs.frozen
class Settings:
    """How one mode runs, beside its workload: decode's and every rank's
    configuration (JSON-able: ``--hosts`` sends it to decode's process)."""

    backend: str
    options: dict[str, str]
    #: False: kvconn (ABORT_ACK, quarantine); True: timeout-only (acks off
    #: at prefill, unsafe release at decode)
    legacy: bool
    decode_timeout_s: float
    drain_s: float
    settle_s: float
    gil_switch_interval_s: float | None = None
    #: every endpoint traces, each rank process's spans appended to this file
    #: (this process's provider is the caller's to set)
    trace_file: str | None = None
    #: P: decode serves its metrics on P (every decode of this process
    #: shares it), prefill rank r on P+1+r
    metrics_port: int | None = None
    #: the address decode's control plane binds
    host: str = "127.0.0.1"

    @classmethod
    def of(cls, args: argparse.Namespace, options: Mapping[str, str], **changes: Any) -> Settings:
        """kvconn's mode as the command line sets it, with ``changes``."""
        gil = args.gil_switch_ms / 1e3 if args.gil_switch_ms > 0 else None
        base = cls(args.backend, dict(options), False, args.abort_timeout, args.drain_s, args.settle_s, gil)
        return attrs.evolve(base, **changes)

    @property
    def mode(self) -> str:
        return LEGACY if self.legacy else KVCONN

    @property
    def write_timeout_s(self) -> float:
        return min(5.0, self.decode_timeout_s / 2)


def rank_args(settings: Settings, wl: Workload, rank: int) -> dict[str, Any]:
    """The arguments of prefill rank ``rank``'s process (:mod:`kvconn.bench.prefill_worker`)."""
    port = settings.metrics_port
    return {
        "backend": settings.backend,
        "rank": rank,
        "page_bytes": wl.page_bytes,
        "num_ranks": wl.ranks,
        "chunk_pages": wl.chunk_pages,
        "source_pages": source_pages(wl),
        "seed": wl.seed,
        "prefill_fail_fraction": wl.prefill_fail_fraction,
        "write_timeout_s": settings.write_timeout_s,
        "abort_timeout_s": settings.decode_timeout_s,
        "acks_enabled": not settings.legacy,
        "backend_options": dict(settings.options),
        "gil_switch_interval_s": settings.gil_switch_interval_s,
        "tracing": settings.trace_file is not None,
        "trace_file": settings.trace_file,
        "metrics_port": None if port is None else port + 1 + rank,
    }


class ModeRun:
    """Runs one mode (``settings.legacy``) of the workload ``wl``."""

    def __init__(self, wl: Workload, settings: Settings, procs: PrefillProcs | None = None) -> None:
        """``procs``: prefill ranks another ModeRun started (several decode
        endpoints, one per ModeRun, served by the same ranks), or that run on
        other hosts; whoever started them closes them."""
        self.wl = wl
        self.settings = settings
        self.result = ModeResult(settings.mode)
        self._lock = threading.RLock()
        #: Free pages, a stack: the page given back last goes out first.
        self._free: list[int] = list(range(wl.pool_pages - 1, -1, -1))
        self._owner: dict[int, int] = {}  # page -> room that last owned it (it carries a canary)
        self._aborted: dict[int, _Aborted] = {}
        self._held_expected = 0
        #: The rooms in flight of the phase running (stream or run).
        self._active: dict[int, _Active] = {}
        #: Rooms decode failed itself whose pages came back before the
        #: bench's loop polled them.
        self._released_unpolled: set[int] = set()
        self._canary = canary(wl.page_bytes)
        self._now = time.monotonic
        #: kvconn's calls on this (the engine's) thread
        self.calls = cpu.CallTimer()
        #: the engine's poll period; on few cores a busy loop would steal the writers' CPU
        self.poll_s = 0.0005
        self._owns_procs = procs is None
        self._progress: Callable[[int], None] = lambda n: None
        self.procs = procs or PrefillProcs([rank_args(settings, wl, r) for r in range(wl.ranks)])
        try:
            config = Config(
                host=settings.host,
                write_timeout_s=settings.write_timeout_s,
                abort_timeout_s=settings.decode_timeout_s,
                unsafe_release_at_deadline=settings.legacy,
                acks_enabled=not settings.legacy,
                backend_options=dict(settings.options),
                gil_switch_interval_s=settings.gil_switch_interval_s,
                tracing=settings.trace_file is not None,
                metrics_port=settings.metrics_port,
            )
            self.decode = DecodeEndpoint(
                get_backend(settings.backend),
                wl.pool_pages,
                wl.page_bytes,
                self.procs.addresses,
                config,
                on_release=self._on_release,
            )
        except BaseException:
            if self._owns_procs:
                self.procs.close()
            raise

    # -- pages -------------------------------------------------------------
    def _lay_canary(self, pages: Sequence[int]) -> None:
        region, pb = self.decode.region, self.wl.page_bytes
        for page in pages:
            region.write(page * pb, self._canary)

    def _check_canary(self, page: int, when: str) -> None:
        data = self.decode.region.read(page * self.wl.page_bytes, self.wl.page_bytes)
        if data != self._canary:
            room = self._owner.get(page)
            changed = sum(1 for a, b in zip(data, self._canary, strict=True) if a != b)
            self._violation(
                "write_after_release",
                room,
                f"{changed} bytes of free page {page} changed ({when}); last owner room {room}",
                page,
            )
            self.decode.region.write(page * self.wl.page_bytes, self._canary)

    def _alloc(self, n: int) -> tuple[int, ...] | None:
        with self._lock:
            if len(self._free) < n:
                return None
            pages = tuple(self._free[-n:][::-1])
            del self._free[-n:]
            given_back = [page for page in pages if page in self._owner]
        for page in given_back:  # a page never handed out carries no canary
            self._check_canary(page, "before reuse")
        return pages

    def _give_back(self, room: int, pages: Sequence[int]) -> None:
        """Pages leave the room: canary first, then the free pool (on top)."""
        self._lay_canary(pages)
        with self._lock:
            for page in pages:
                self._owner[page] = room
            self._free.extend(reversed(pages))

    def _violation(self, kind: str, room: int | None, detail: str, page: int | None = None) -> None:
        with self._lock:
            if len(self.result.violations) < 1000:
                self.result.violations.append(Violation(kind, room, detail, page))

    # -- release callback (listener thread, or ours inside abort()) ---------
    def _on_release(self, release: Release) -> None:
        now = self._now()
        self._give_back(release.room, release.pages)  # canary at once
        with self._lock:
            proof = release.proof.value
            self.result.releases_by_proof[proof] = self.result.releases_by_proof.get(proof, 0) + 1
            entry = self._aborted.pop(release.room, None)
            if entry is None:
                active = self._active.get(release.room)
                if active is not None and active.rx.poll() is KVPoll.FAILED:
                    # Decode failed the room itself (a rank found down or
                    # restarted) and it came back on proof before the loop
                    # polled it: the loop counts it as failed when it does.
                    self._released_unpolled.add(release.room)
                    return
                self._violation("unexpected_release", release.room, f"released by {proof}, never aborted")
                return
            self._held_expected -= entry.npages
            ms = (now - entry.at) * 1e3
            if entry.kind == "prefill_fail":
                self.result.prefill_fail_latencies_ms.append(ms)
            elif proof != "completed":
                self.result.latencies_ms.append(ms)

    def _failed(self, room: int, active: _Active) -> None:
        """A room the loop found FAILED (a rank failed it, or decode did):
        given up as the engine would, unless its pages are back already."""
        with self._lock:
            if room in self._released_unpolled:
                self._released_unpolled.discard(room)
                return
        self._abort(room, active, "prefill_fail")

    def _abort(self, room: int, active: _Active, kind: str) -> None:
        with self._lock:
            self._aborted[room] = _Aborted(room, len(active.pages), self._now(), kind)
            self._held_expected += len(active.pages)
            self.calls(active.rx.abort)
        self._sample()

    def _sample(self) -> None:
        with self._lock:
            held = self.decode.held_pages()
            expected = self._held_expected
            if held > expected:
                # Rooms decode failed itself (a rank found down or restarted)
                # are aborted as the bench's are, and hold their pages until
                # proven; the loop has not polled them yet.
                expected += self._failed_unseen()
            self.result.peak_pages_held = max(self.result.peak_pages_held, held)
            self.result.peak_pages_aborted_unreleased = max(
                self.result.peak_pages_aborted_unreleased, expected
            )
            if held > expected:
                self._violation(
                    "held_exceeds_aborted", None, f"kvconn holds {held} pages, aborted rooms {expected}"
                )

    def _failed_unseen(self) -> int:
        """Pages of the rooms in flight that decode already failed, and the
        bench has not counted as aborted."""
        return sum(
            len(a.pages)
            for room, a in self._active.items()
            if room not in self._aborted and a.rx.poll() is KVPoll.FAILED
        )

    # -- verification --------------------------------------------------------
    def _verify(self, room: int, pages: Sequence[int]) -> None:
        pb, shard = self.wl.page_bytes, self.wl.shard
        for i, page in enumerate(pages):
            self.result.pages_verified += 1
            data = self.decode.region.read(page * pb, pb)
            for rank in range(self.wl.ranks):
                got = data[rank * shard : (rank + 1) * shard]
                if got != shard_bytes(room, rank, i, shard):
                    self._violation("corrupt_page", room, self._explain(page, i, rank, got), page)

    def _explain(self, page: int, index: int, rank: int, got: bytes) -> str:
        shard = self.wl.shard
        base = f"page {page} (#{index}) rank {rank} shard differs"
        if got == self._canary[:shard]:
            return base + ": never written (still the canary)"
        prev = self._owner.get(page)
        if prev is not None:
            for j in range(self.wl.pages):
                if got[:8] == shard_bytes(prev, rank, j, 8):
                    return base + f": holds room {prev}'s data (a late write of the page's previous owner)"
        return base

    # -- the run -------------------------------------------------------------
    def stream(self, rooms: Sequence[int], progress: Callable[[int], None]) -> dict[str, float]:
        """No aborts, pages never reused during the timing: throughput and
        the request latency."""
        wl = self.wl
        todo = deque(rooms)
        active: dict[int, _Active] = {}
        self._active = active
        done: list[tuple[int, tuple[int, ...]]] = []
        lat: list[float] = []
        failed = 0
        warm = min(wl.concurrency, len(rooms) // 4)
        t0 = self._now()
        while todo or active:
            while todo and len(active) < wl.concurrency:
                pages = self._alloc(wl.pages)
                if pages is None:
                    break
                room = todo.popleft()
                active[room] = _Active(
                    self.calls(self.decode.receiver, room, pages), pages, self._now(), None
                )
            for room, a in list(active.items()):
                st = a.rx.poll()
                if st is KVPoll.SUCCESS:
                    lat.append(self._now() - a.started)
                    a.rx.finish()
                    done.append((room, a.pages))
                    if len(done) == warm:  # first-touch and connection costs stay out of the timing
                        t0 = self._now()
                elif st is KVPoll.FAILED:
                    failed += 1
                    self._failed(room, a)
                else:
                    continue
                del active[room]
                progress(1)
            time.sleep(self._pause_s(len(active)))
        elapsed = self._now() - t0
        for room, pages in done:
            self._verify(room, pages)
            self._give_back(room, pages)
        self.stream_rooms = done
        nbytes = (len(done) - warm) * wl.pages * wl.page_bytes
        return {
            "warmup_requests": warm,
            "requests": len(done),
            "failed": failed,
            "elapsed_s": elapsed,
            "gbps": nbytes / elapsed / 1e9 if elapsed else 0.0,
            "latency_p50_ms": statistics.median(lat) * 1e3 if lat else 0.0,
            "nbytes": nbytes,
        }

    def run(
        self, work: Sequence[Planned], abort_window_s: float, progress: Callable[[int], None]
    ) -> ModeResult:
        """The workload: every room requested as pages allow (``concurrency``
        in flight), aborted at its time (``abort_u`` of the window after its
        request, kept by the clock whatever the rooms in flight), polled
        until it completes or fails. Measured: CPU by part, in this process
        and every rank, and page faults."""
        wl, res, calls = self.wl, self.result, self.calls
        self._progress = progress
        todo = deque(work)
        active: dict[int, _Active] = {}
        self._active = active
        aborts: list[tuple[float, int]] = []  # (when, room): a heap
        poll_timed = False
        res.pages_verified = 0  # the workload's pages only, not the streaming phase's
        measured = wl.decodes == 1  # decodes side by side share this process and the ranks
        machine = cpu.sample()
        cpu_before = self._cpu() if measured else None
        t0 = self._now()
        while todo or active:
            while todo and len(active) < wl.concurrency:
                pages = self._alloc(wl.pages)
                if pages is None:
                    break
                p = todo.popleft()
                now = self._now()
                abort_at = now + p.abort_u * abort_window_s if p.abort else None
                active[p.room] = _Active(
                    self.calls(self.decode.receiver, p.room, pages), pages, now, abort_at
                )
                if abort_at is not None:
                    heapq.heappush(aborts, (abort_at, p.room))
                if not poll_timed:  # what a poll costs, on the first receiver
                    calls.per_counted(active[p.room].rx.poll)
                    poll_timed = True
            while aborts and aborts[0][0] <= self._now():  # due, however many rooms are in flight
                room = heapq.heappop(aborts)[1]
                a = active.get(room)
                if a is not None and calls.counted(a.rx.poll) not in (KVPoll.SUCCESS, KVPoll.FAILED):
                    res.aborted_mid_transfer += 1
                    self._abort(room, a, "decode")
                    self._done(room)
            for room, a in list(active.items()):
                st = calls.counted(a.rx.poll)
                if st is KVPoll.SUCCESS:
                    if a.abort_at is not None:
                        res.completed_before_abort_point += 1
                    self._verify(room, a.pages)
                    calls(a.rx.finish)
                    self._give_back(room, a.pages)
                    res.completed += 1
                    res.bytes_completed += len(a.pages) * wl.page_bytes
                elif st is KVPoll.FAILED:
                    res.prefill_failed += 1
                    self._failed(room, a)
                else:
                    continue
                self._done(room)
            self._sample()
            pause = self._pause_s(len(active))
            if aborts:
                pause = min(pause, max(0.0, aborts[0][0] - self._now()))
            time.sleep(pause)
        res.elapsed_s = self._now() - t0
        res.cpu = cpu.shares(machine, cpu.sample())
        if cpu_before is not None:
            res.cpu_per_request_us = cpu.per_request(cpu_before, self._cpu(), self.result.requests)
        self._finish()
        return res

    def _done(self, room: int) -> None:
        del self._active[room]
        self.result.requests += 1
        self._progress(1)

    def _pause_s(self, rooms: int) -> float:
        """The pause between two polls of every room in flight: ``poll_s``, or
        :data:`POLL_PAUSE_PER_ROOM_S` per room if longer. An engine polls its
        requests once a step; a scan of 512 rooms every 0.5 ms kept this
        process's GIL busy about as long as it slept, and decode's listener,
        which takes the acks, waited for it: the release latency grew with
        the rooms in flight for the bench's own sake."""
        return max(self.poll_s, rooms * POLL_PAUSE_PER_ROOM_S)

    # -- what the run cost -----------------------------------------------------
    def _cpu(self) -> dict[str, Any]:
        """This process's and every rank's CPU so far (see :func:`kvconn.bench.cpu.per_request`)."""
        return {
            "threads": cpu.thread_seconds(),
            "calls": (self.calls.total, self.calls.calls),
            "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            "ranks": self.procs.cpu() if self._owns_procs else [],
        }

    def _finish(self) -> None:
        res = self.result
        deadline = self._now() + self.settings.drain_s
        while self._now() < deadline:
            with self._lock:
                if not self._aborted:
                    break
            time.sleep(0.005)
        time.sleep(self.settings.settle_s)  # late writes of live writers land now, or never
        with self._lock:
            given_back = [page for page in self._free if page in self._owner]
        for page in given_back:
            self._check_canary(page, "at the end")
        m = self.decode.metrics
        res.acks_received = m.value("kvconn_acks_received_total")
        res.aborts_sent = m.value("kvconn_aborts_sent_total")
        res.quarantines = m.value("kvconn_quarantines_total")
        res.quarantine_seconds = m.value("kvconn_quarantine_seconds_total")
        for rank in range(self.wl.ranks):
            buckets = m.buckets("kvconn_abort_to_ack_seconds", rank=str(rank))
            if buckets and buckets[-1][1]:  # a rank with no ack has an empty series
                res.ack_wait_ms_by_rank[str(rank)] = {
                    "n": buckets[-1][1],
                    **{f"p{q}_at_most": (bucket_bound(buckets, q / 100) or 0.0) * 1e3 for q in (50, 99)},
                }

        def unreleased(state: EndpointState, now: float) -> tuple[tuple[int, int, int], tuple[()]]:
            t = state.tracker
            rooms = len(t.rooms_in(HoldState.HELD)) + len(t.rooms_in(HoldState.QUARANTINED))
            return (t.pages_in(HoldState.HELD), t.pages_in(HoldState.QUARANTINED), rooms), ()

        res.pages_held_end, res.pages_quarantined_end, res.rooms_unreleased_end = self.decode.step(unreleased)

    def close(self) -> None:
        try:
            self.decode.close()
        finally:
            if self._owns_procs:
                self.procs.close()
                totals: Counter[str] = Counter()
                for m in self.procs.metrics:
                    totals.update(m)
                self.result.prefill = dict(totals)
