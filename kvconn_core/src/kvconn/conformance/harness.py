"""Real processes for the conformance suite: prefill ranks, bare writers, and
a decode endpoint in the test process that lays a canary in every page it
gets back and checks it before handing the page out again."""

from __future__ import annotations

import functools
import json
import os
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvconn.config import Config
from kvconn.conformance import region_host
from kvconn.conformance.guard import GUARD
from kvconn.plugins import get_backend
from kvconn.protocol.hold import HoldState, Proof, Release
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.testing import child, waiting
from kvconn.testing.hosts import Fabric, Host
from kvconn.testing.pages import CanaryPages
from kvconn.testing.patterns import canary, shard_bytes
from kvconn.transport import Backend, Capabilities, capabilities_of

#: Proofs that say "acked by a writer that had nothing in flight".
ACK_PROOFS = frozenset({Proof.ACKS, Proof.LATE_ACKS, Proof.COMPLETED, Proof.NOTHING_SENT})


#: The deadlines the suite runs with unless told otherwise (``kvconn
#: conformance``, the pytest plugin and :class:`Settings` share them).
WRITE_TIMEOUT_S = 0.5
ABORT_TIMEOUT_S = 2.0


class ConformanceFailure(AssertionError):
    """A check failed; the message names it."""


#: kvconn.testing's wait, failing as a check of the suite does (the suite
#: tells a failed check from a crash by this class).
wait_for = functools.partial(waiting.wait_for, poll=0.002, failure=ConformanceFailure)


#: Cross-host mode (``--kvconn-cross-host``): the hosts the suite's processes
#: run on. The test process is decode's host (it moved into its network
#: before it started a thread); writers run on the prefill hosts.
_fabric: Fabric | None = None


def place_on(fabric: Fabric | None) -> None:
    """Run the suite's processes on ``fabric``'s hosts (None: on this host).
    Its ``decode`` host must be the network this process now runs in."""
    global _fabric
    _fabric = fabric


def fabric() -> Fabric | None:
    return _fabric


def decode_host() -> Host | None:
    """Decode's host in cross-host mode (this process's network), else None."""
    return None if _fabric is None else _fabric["decode"]


def prefill_host(index: int = 0) -> Host | None:
    """The host of writer ``index`` (round robin over the prefill hosts)."""
    if _fabric is None:
        return None
    hosts = [h for name, h in sorted(_fabric.hosts.items()) if name != "decode"]
    return hosts[index % len(hosts)]


def host_options(backend: Backend, host: Host | None) -> dict[str, str]:
    """The options that bind ``backend`` to ``host``'s address and interface:
    the backend's ``host_options`` templates (``{ip}``, ``{iface}``), if it
    has any (a transport that claims cross_host says how to bind it)."""
    if host is None:
        return {}
    templates: Mapping[str, str] = getattr(backend, "host_options", None) or {}
    return {key: value.format(ip=host.ip, iface=host.iface) for key, value in templates.items()}


@attrs.frozen
class Settings:
    """What the suite runs against, and with which deadlines."""

    backend_name: str
    options: Mapping[str, str] = attrs.field(factory=dict)
    write_timeout_s: float = WRITE_TIMEOUT_S
    abort_timeout_s: float = ABORT_TIMEOUT_S
    strict: bool = False
    #: More and wider rounds (a longer run).
    thorough: bool = False
    #: How long each check watches released pages, guard bytes and fenced
    #: regions for a late write; ``None``: 2 s, or 10 s with ``strict`` or
    #: ``thorough``. The run's guard watches them on to the end of the suite.
    watch_s: float | None = None

    @property
    def late_write_watch_s(self) -> float:
        """A write deferred longer than this (a helper process, a resumed
        fence) is missed by the check that released the pages, and caught by
        the run's guard (:attr:`guard_s`) instead."""
        if self.watch_s is not None:
            return self.watch_s
        return 10.0 if self.strict or self.thorough else 2.0

    @property
    def guard_s(self) -> float:
        """How long, at least, the suite's last check keeps the youngest
        released region guarded: 15 s, 30 s with ``strict`` or ``thorough``,
        never less than the per-check watch."""
        return max(30.0 if self.strict or self.thorough else 15.0, self.late_write_watch_s)

    @property
    def backend(self) -> Backend:
        return get_backend(self.backend_name)

    @property
    def capabilities(self) -> Capabilities:
        """What the backend claims with these options (on decode's host, in
        cross-host mode)."""
        return capabilities_of(self.backend, self.options_on(decode_host()))

    @property
    def cross_host(self) -> bool:
        """Whether the suite runs across hosts (:func:`place_on`)."""
        return _fabric is not None

    def options_on(self, host: Host | None) -> dict[str, str]:
        """The backend options of an endpoint on ``host``."""
        return {**self.options, **host_options(self.backend, host)}

    def control_host(self, host: Host | None) -> str:
        """The address kvconn's control plane binds on ``host``."""
        return "127.0.0.1" if host is None else host.ip

    def effective_abort_timeout(self) -> float:
        """Decode's deadline: the configured one, or longer than the
        transport's own write timeout (e.g. Mooncake's engine timeout)."""
        limit = self.capabilities.max_write_timeout_s
        base = max(self.abort_timeout_s, self.write_timeout_s + 0.5)
        return base if limit is None else max(base, limit + 1.0)

    def config(self) -> Config:
        return Config(
            write_timeout_s=self.write_timeout_s,
            abort_timeout_s=self.effective_abort_timeout(),
            resend_interval_s=0.2,
            bootstrap_timeout_s=30.0,
            host=self.control_host(decode_host()),
            backend_options=self.options_on(decode_host()),
        )


class Child(child.Child):
    """A child process of the suite: a wait on it that runs out is a failed check."""

    failure = ConformanceFailure


class RankProc(Child):
    """A self-driving prefill rank (:mod:`kvconn.conformance.rank_proc`)."""

    def __init__(
        self,
        settings: Settings,
        rank: int,
        num_ranks: int,
        page_bytes: int,
        chunk_pages: int,
        source_pages: int,
        faults: Mapping[int, Mapping[str, Any]] | None = None,
        workers: int = 1,
        on: Host | None = None,
    ) -> None:
        """``on``: the host it runs on (default: the fabric's prefill host
        of ``rank``, in cross-host mode; else this one)."""
        host = on if on is not None else prefill_host(rank)
        super().__init__(
            "kvconn.conformance.rank_proc",
            {
                "backend": settings.backend_name,
                "backend_options": settings.options_on(host),
                "host": settings.control_host(host),
                "rank": rank,
                "num_ranks": num_ranks,
                "page_bytes": page_bytes,
                "chunk_pages": chunk_pages,
                "source_pages": source_pages,
                "write_timeout_s": settings.write_timeout_s,
                "abort_timeout_s": settings.effective_abort_timeout(),
                "faults": {str(room): dict(rule) for room, rule in (faults or {}).items()},
                "workers": workers,
            },
            host=host,
        )
        self.address = ""

    def ready(self, timeout: float = 60.0) -> str:
        self.address = str(self.expect(timeout, "prefill rank start", event="ready")["address"])
        return self.address


class OwnerProc(Child):
    """A decode endpoint in its own process (:mod:`kvconn.conformance.decode_proc`),
    which the suite can freeze while writes to it are in flight."""

    def __init__(
        self,
        settings: Settings,
        prefill: Sequence[str],
        num_pages: int,
        page_bytes: int,
        on: Host | None = None,
        num_ranks: int = 1,
    ) -> None:
        """``on``: the host it runs on (default: decode's, in cross-host mode)."""
        host = on if on is not None else decode_host()
        config = settings.config()
        super().__init__(
            "kvconn.conformance.decode_proc",
            {
                "backend": settings.backend_name,
                "prefill": list(prefill),
                "num_pages": num_pages,
                "page_bytes": page_bytes,
                "num_ranks": num_ranks,
                "config": {
                    "write_timeout_s": config.write_timeout_s,
                    "abort_timeout_s": config.abort_timeout_s,
                    "resend_interval_s": config.resend_interval_s,
                    "bootstrap_timeout_s": config.bootstrap_timeout_s,
                    "host": settings.control_host(host),
                    "backend_options": settings.options_on(host),
                },
            },
            host=host,
        )
        #: Handed to the run's guard: closed at the end of the suite.
        self.guarded = False
        #: The most bytes seen waiting in its sockets while it was frozen.
        self.queued = 0

    def command(self, timeout: float, what: str, op: str, **args: Any) -> dict[str, Any]:
        """Send one command and wait for its answer (the event named ``op``'s past)."""
        self.send_line(json.dumps({"op": op, **args}))
        answer = {"open": "opened", "abort": "aborted", "changed": "changed", "finish": "finished"}[op]
        return self.expect(timeout, what, event=answer)


class _KeptRegion:
    """A region whose ``close()`` waits for the run's guard too: decode's
    endpoint closes with its cluster, its pages stay watched until the
    suite's last check."""

    def __init__(self, region: Any, closed: threading.Event) -> None:
        self._region = region
        self._guard_done = closed
        self._close_asked = False
        self._closed = False

    def close(self) -> None:
        self._close_asked = True
        if self._guard_done.is_set():
            self.really_close()

    def really_close(self) -> None:
        if self._close_asked and not self._closed:
            self._closed = True
            self._region.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._region, name)


class _GuardedBackend:
    """``backend``, its regions held by the run's region host
    (:mod:`kvconn.conformance.region_host`) and kept open for the guard
    (:class:`_KeptRegion`)."""

    def __init__(self, settings: Settings, guard_done: threading.Event) -> None:
        self._settings = settings
        self._backend = settings.backend
        self._guard_done = guard_done
        self.regions: list[_KeptRegion] = []

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> _KeptRegion:
        held = region_host.open_region(self._settings.backend_name, nbytes, options, decode_host())
        region = _KeptRegion(held, self._guard_done)
        self.regions.append(region)
        return region

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class Cluster:
    """Decode (in this process) and ``num_ranks`` prefill rank processes.

    Its region stays open after :meth:`close` until the run's guard
    (:mod:`kvconn.conformance.guard`) checked the released pages one last
    time, at the end of the suite."""

    def __init__(
        self,
        settings: Settings,
        num_ranks: int = 1,
        page_bytes: int = 64 << 10,
        num_pages: int = 512,
        chunk_pages: int = 4,
        source_pages: int = 256,
        faults: Mapping[int, Mapping[str, Any]] | None = None,
        rank_faults: Mapping[int, Mapping[int, Mapping[str, Any]]] | None = None,
        workers: int = 1,
        ranks_of: Cluster | None = None,
        seed: int = 0xC0F,
        room_ids_of: Cluster | None = None,
    ) -> None:
        """``ranks_of``: another cluster whose rank processes this one's decode
        also reads from (two decodes on the same ranks); they stay its own.
        ``room_ids_of``: another cluster whose room ids this one's decode uses
        too, in the same order (a room id is unique per decode only)."""
        self.settings = settings
        self.page_bytes = page_bytes
        self.num_ranks = num_ranks
        self.shard = page_bytes // num_ranks
        self.num_pages = num_pages
        self.rng = random.Random(seed)
        self.first_room = self.rng.randrange(1 << 40, 1 << 41)
        if room_ids_of is not None:
            self.first_room = room_ids_of.first_room
        self._room_ids = iter(range(self.first_room, 1 << 62))
        self.ranks: list[RankProc] = []
        self._own_ranks = ranks_of is None
        self.decode: DecodeEndpoint | None = None
        self._lock = threading.Lock()
        self.releases: dict[int, tuple[Release, float]] = {}
        self.corrupted: list[str] = []
        self._guard_done = threading.Event()
        self._backend = _GuardedBackend(settings, self._guard_done)
        self._guarded = GUARD.keep(
            f"released pages of a decode region ({num_pages} pages of {page_bytes} bytes)",
            self._late_writes,
            self._end_guard,
            self._last_release,
        )
        try:
            if ranks_of is not None:
                self.ranks = list(ranks_of.ranks)
                addresses = [rank.address for rank in self.ranks]
            else:
                for r in range(num_ranks):
                    rf = (rank_faults or {}).get(r, faults)
                    self.ranks.append(
                        RankProc(settings, r, num_ranks, page_bytes, chunk_pages, source_pages, rf, workers)
                    )
                addresses = [rank.ready() for rank in self.ranks]
            self.decode = DecodeEndpoint(
                self._backend,
                num_pages,
                page_bytes,
                addresses,
                settings.config(),
                on_release=self._on_release,
            )
            self.region = self.decode.region
            self.pages = CanaryPages(self.region, num_pages, page_bytes, num_ranks)
        except BaseException:
            self.close()
            raise

    @property
    def endpoint(self) -> DecodeEndpoint:
        assert self.decode is not None
        return self.decode

    @property
    def owner_pid(self) -> int | None:
        """The process holding decode's region (the region host), if its pid
        means something here."""
        pid = getattr(self.region, "owner_pid", None)
        return pid if isinstance(pid, int) else None

    # -- pages ---------------------------------------------------------------
    def new_room(self) -> int:
        return next(self._room_ids)

    def alloc(self, n: int, scattered: bool = False) -> list[int]:
        """``n`` free pages; a page that came back from a room is checked for
        its canary first: a change is a write that landed after release."""
        if len(self.pages.free_pages()) < n:
            raise ConformanceFailure(f"suite bug: {n} pages wanted, {len(self.pages.free_pages())} free")
        pages, reused = self.pages.take(n, fresh_first=True, rng=self.rng if scattered else None)
        bad = self.pages.changed(reused)
        if bad:
            raise ConformanceFailure(
                f"late write after release: pages {bad[:8]} changed after decode released them "
                f"(found before handing them out again)"
            )
        return pages

    def alloc_strided(self, n: int) -> list[int]:
        """``n`` pages with a free page between each two: no two destinations
        merge, so a chunk of them is one segment per page and rank, and every
        page in between is a guard that must keep its canary."""
        span = self.alloc(2 * n - 1)
        self.pages.untake(span[1::2])
        return span[::2]

    def changed_pages(self, pages: Iterable[int]) -> list[int]:
        return self.pages.changed(pages)

    def changed_free_pages(self) -> list[int]:
        """Free pages (never handed out, or released and canaried again) whose
        canary changed: a write that landed outside the pages of its room."""
        return self.pages.changed(self.pages.free_pages())

    def changed_after_release(self, pages: Iterable[int]) -> list[int]:
        """Released pages, not handed out again since, whose canary changed."""
        return self.pages.changed(self.pages.returned_pages(pages))

    def bad_pattern_pages(
        self, room: int, pages: Sequence[int], ranks: Iterable[int] | None = None
    ) -> list[int]:
        return self.pages.wrong_pattern(room, pages, ranks)

    def _on_release(self, release: Release) -> None:
        """Decode hands the pages back: lay the canary right away."""
        self.pages.give_back(release.pages)
        with self._lock:
            self.releases[release.room] = (release, time.monotonic())

    # -- rooms ----------------------------------------------------------------
    def receiver(self, room: int, pages: Sequence[int], ranks: frozenset[int] | None = None) -> Receiver:
        return self.endpoint.receiver(room, pages, ranks)

    def finish(self, receiver: Receiver) -> None:
        """A completed room: the engine takes the pages, uses them, frees them."""
        self.pages.give_back(receiver.finish())

    def release_of(self, room: int) -> tuple[Release, float] | None:
        with self._lock:
            return self.releases.get(room)

    def wait_released(self, room: int, timeout: float, what: str) -> tuple[Release, float]:
        wait_for(lambda: self.release_of(room) is not None, timeout, f"{what}: room {room} released")
        found = self.release_of(room)
        assert found is not None
        return found

    def wait_done(self, receiver: Receiver, timeout: float, what: str) -> str:
        wait_for(lambda: receiver.poll().name in ("SUCCESS", "FAILED"), timeout, what)
        return receiver.poll().name

    def state(self, room: int) -> HoldState | None:
        return self.endpoint.step(lambda state, now: (state.tracker.state(room), ()))

    def quarantined_or_released(self, room: int) -> bool:
        """Whether decode's deadline has done its part for ``room``: moved it
        to quarantine, unless a proof released it first."""
        return self.release_of(room) is not None or self.state(room) is HoldState.QUARANTINED

    # -- the run's guard --------------------------------------------------------
    def _last_release(self) -> float:
        with self._lock:
            return max((at for _, at in self.releases.values()), default=0.0)

    def _late_writes(self) -> str:
        """ "" if every released page, not handed out since, holds its canary."""
        bad = self.changed_after_release(range(self.num_pages))
        if not bad:
            return ""
        with self._lock:
            rooms = sorted({room for room, (r, _) in self.releases.items() if set(r.pages) & set(bad)})
        return f"{len(bad)} pages changed after decode released them (pages {bad[:8]}, rooms {rooms[:4]})"

    def _end_guard(self) -> None:
        self._guard_done.set()
        for region in self._backend.regions:
            region.really_close()

    def close(self) -> None:
        if self._own_ranks:
            for rank in self.ranks:
                rank.close()
        if self.decode is not None:
            self.decode.close()
            self.decode = None
        with self._lock:
            released = bool(self.releases)
        if not released:  # nothing came back through an abort: nothing to guard
            GUARD.discard(self._guarded)
            self._end_guard()


class RegionImage:
    """What a region must hold, byte for byte: the canary everywhere except
    where rounds landed. Comparing the whole region checks the guard bytes
    around every segment and the bytes never posted, not only the posted
    ranges."""

    def __init__(self, region: Any, nbytes: int) -> None:
        self.region = region
        self.nbytes = nbytes
        self.want = np.full(nbytes, canary(1)[0], dtype=np.uint8)
        region.write(0, canary(nbytes))
        self.last: list[list[int]] = []

    def land(self, round_no: int, rows: Sequence[Sequence[int]]) -> None:
        """The round's pattern is due in its segments."""
        for j, (_, dst, n) in enumerate(rows):
            self.want[dst : dst + n] = np.frombuffer(shard_bytes(round_no, 0, j, n), dtype=np.uint8)
        self.last = [list(r) for r in rows]

    def recanary(self, rows: Sequence[Sequence[int]] | None = None) -> None:
        """Lay a fresh canary (over ``rows``, or the whole region): a byte
        that changes it afterwards landed after now."""
        spans = [(0, self.nbytes)] if rows is None else [(d, n) for _, d, n in rows]
        for dst, n in spans:
            self.region.write(dst, canary(n))
            self.want[dst : dst + n] = canary(1)[0]

    def differing(self, rows: Sequence[Sequence[int]] | None = None) -> int:
        """How many bytes of the region (of ``rows``' destinations only, if
        given) differ from what it must hold (after :meth:`land`: how many
        of the round's bytes have not landed yet)."""
        spans = [(0, self.nbytes)] if rows is None else [(d, n) for _, d, n in rows]
        return sum(
            int(
                np.count_nonzero(
                    np.frombuffer(self.region.read(dst, n), dtype=np.uint8) != self.want[dst : dst + n]
                )
            )
            for dst, n in spans
        )

    def diff(self) -> str:
        """ "" if the region holds what it must, else what differs and where."""
        got = np.frombuffer(self.region.read(0, self.nbytes), dtype=np.uint8)
        bad = np.flatnonzero(got != self.want)
        if not bad.size:
            return ""
        first = int(bad[0])
        return f"{bad.size} bytes differ, the first at offset {first} ({self._where(first)})"

    def _where(self, offset: int) -> str:
        for j, (_, dst, n) in enumerate(self.last):
            if dst <= offset < dst + n:
                return f"inside segment {j} of {len(self.last)} ({n} bytes at {dst}): wrong bytes"
        before = [(dst + n, j) for j, (_, dst, n) in enumerate(self.last) if dst + n <= offset]
        if before:
            end, j = max(before)
            return f"{offset - end} bytes past the end of segment {j} ({self.last[j][2]} bytes): outside any segment"
        return "outside any segment posted"


def scattered_rows(
    rng: random.Random, count: int, max_len: int, src_bytes: int, dst_bytes: int
) -> list[list[int]]:
    """``count`` segments of odd sizes (1 to ``max_len``), scattered over the
    destination in random order, each with guard bytes on both sides."""
    lens = [rng.randrange(1, max_len + 1) | 1 for _ in range(count)]
    room = dst_bytes - sum(lens) - 1
    gaps = [rng.randrange(1, max(2, 2 * room // count)) for _ in range(count)]
    scale = min(1.0, room / max(1, sum(gaps)))
    rows, src, dst = [], 0, 1
    for n, gap in zip(lens, gaps, strict=True):
        dst += max(1, int(gap * scale))
        rows.append([src, dst, n])
        src, dst = src + n + rng.randrange(0, 64), dst + n
    if src > src_bytes or dst >= dst_bytes:
        raise ValueError("suite bug: scattered segments do not fit")
    rng.shuffle(rows)
    return rows


def gpu_on_host() -> bool:
    """Whether this host has a CUDA device at all (its driver's device nodes)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")
