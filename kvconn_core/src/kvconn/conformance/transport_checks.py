"""Checks of what the transport itself promises, through a bare writer
process (:mod:`kvconn.conformance.writer_proc`) and regions in this process.

Each check gates the writer the same way: the writer freezes itself (every
thread of it) right after the hook whose answer is checked, so the suite
compares the destination with that answer while nothing of the writer can
move, and lays fresh canaries before it lets the writer run again. A copy
that the answer said was over, and that runs on, is then caught whatever
its speed. What runs outside the writer process (a DMA engine, a helper
process) is watched for ``Settings.late_write_watch_s``.
"""

from __future__ import annotations

import ctypes
import json
import random
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from kvconn.conformance.harness import (
    Child,
    ConformanceFailure,
    RegionImage,
    Settings,
    decode_host,
    fabric,
    gpu_on_host,
    host_options,
    prefill_host,
    scattered_rows,
)
from kvconn.conformance.plugin import require_capability
from kvconn.testing import hosts as hosts_harness
from kvconn.testing.hosts import Host
from kvconn.testing.waiting import wait_for
from kvconn.transport import PageRegion, Settlement, capabilities_of

MiB = 1 << 20
LANDED, FAILED_SETTLED, UNSETTLED = (s.value for s in Settlement)


class BareWriter(Child):
    """A writer process and the rounds it runs (see ``writer_proc``)."""

    def __init__(
        self,
        settings: Settings,
        peers: Mapping[str, bytes],
        rounds: Sequence[Mapping[str, Any]],
        src_bytes: int,
        options: Mapping[str, str] | None = None,
        write_timeout_s: float | None = None,
        prefix: Sequence[str] = (),
        host: Host | None = None,
    ) -> None:
        """``host``: where the writer runs; in cross-host mode it defaults to
        the first prefill host (with its address and interface options)."""
        if host is None and not prefix:
            host = prefill_host(0)
        extra = host_options(settings.backend, host)
        super().__init__(
            "kvconn.conformance.writer_proc",
            {
                "backend": settings.backend_name,
                "options": {**(settings.options if options is None else options), **extra},
                "src_bytes": src_bytes,
                "peers": {name: metadata.hex() for name, metadata in peers.items()},
                "write_timeout_s": settings.write_timeout_s if write_timeout_s is None else write_timeout_s,
                "rounds": [dict(r) for r in rounds],
            },
            prefix,
            host=host,
        )

    def answer(self, step: str, round_no: int) -> dict[str, Any]:
        """The report of ``step`` in round ``round_no`` (already received)."""
        for event in reversed(self.history()):
            if event.get("event") == step and event.get("round") == round_no:
                return dict(event)
        raise ConformanceFailure(f"suite bug: no {step!r} report for round {round_no}")

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def settlement(self, settings: Settings, what: str, round_no: int = 1) -> str:
        """Wait until the writer froze after round ``round_no``'s barrier and
        return the settlement that barrier answered."""
        self.frozen(30 + _limit(settings), what, round=round_no)
        return str(self.answer("barrier", round_no)["settlement"])


def _round(rows: list[list[int]], steps: Sequence[str], peer: str = "a") -> dict[str, Any]:
    return {"peer": peer, "segments": rows, "steps": list(steps)}


@contextmanager
def _regions(settings: Settings, sizes: Mapping[str, int], **extra: str) -> Iterator[dict[str, PageRegion]]:
    options = {**settings.options_on(decode_host()), **extra}
    opened: dict[str, PageRegion] = {}
    try:
        for name, size in sizes.items():
            opened[name] = settings.backend.open_region(size, options)
        yield opened
    finally:
        for region in opened.values():
            region.close()


def _metadata(regions: Mapping[str, PageRegion]) -> dict[str, bytes]:
    return {name: region.metadata for name, region in regions.items()}


def _limit(settings: Settings) -> float:
    return settings.capabilities.max_write_timeout_s or 0.0


def _watch(settings: Settings, images: Sequence[RegionImage], what: str) -> None:
    """Watch ``images`` for the late-write window: any change is a late write."""
    deadline = time.monotonic() + settings.late_write_watch_s
    while True:
        for image in images:
            found = image.diff()
            if found:
                raise ConformanceFailure(f"{what}: {found}")
        if time.monotonic() >= deadline:
            return
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


class TransportChecks:
    """The bare-writer checks (mixed into :class:`ConformanceSuite`)."""

    # -- the DONE barrier ------------------------------------------------------
    @pytest.mark.parametrize("memory", ["dram", "vram"])
    def test_done_barrier_means_landed(self, kvconn_settings: Settings, memory: str) -> None:
        """Right after on_done_barrier answers LANDED every byte is there, and
        not one byte more: guard bytes around every segment and the bytes never
        posted keep their canary. Rounds go up to thousands of scattered,
        odd-sized segments in one chunk."""
        settings = kvconn_settings
        require_capability(memory in settings.capabilities.memory, f"memory kind {memory!r} not declared")
        extra = {"memory": memory} if memory != "dram" else {}
        size = 40 * MiB
        rng = random.Random(0xB0A7)
        wide = 20000 if settings.thorough else 3000
        rounds_rows: list[list[list[int]]] = [
            [[0, 0, 4096]],
            [[i * 65536, (37 * i % 61) * 262144 + 4096, 65536] for i in range(24)],
            [[0, 8 * MiB, 24 * MiB]],
            [[0, 3, 1], [8, 4100, 7], [4096, 9000, 4097], [20000, 30000, 65537]],
            [[MiB, 33 * MiB, 4 * MiB], [6 * MiB, MiB, 2 * MiB]],
            scattered_rows(rng, 25, 9999, size, size),
            scattered_rows(rng, wide, 4999 if wide <= 3000 else 1023, size, size),
            [[0, 0, 32 * MiB]],
        ]
        try:
            regions_cm = _regions(settings, {"a": size}, **extra)
            regions = regions_cm.__enter__()
        except Exception as exc:
            pytest.skip(f"cannot open a {memory} region on this host: {exc}")
        try:
            image = RegionImage(regions["a"], size)
            rounds = [_round(rows, ["wait", "post", "barrier", "freeze"]) for rows in rounds_rows]
            child = BareWriter(settings, _metadata(regions), rounds, size, {**settings.options, **extra}, 5.0)
            try:
                child.expect(60, "DONE barrier: writer start", event="ready")
                for i, rows in enumerate(rounds_rows, start=1):
                    child.send_line()
                    settlement = child.settlement(settings, f"DONE barrier: round {i} settles", i)
                    if settlement != LANDED:
                        raise ConformanceFailure(
                            f"DONE barrier: a healthy write of {len(rows)} segments settled {settlement!r}"
                        )
                    image.land(i, rows)
                    found = image.diff()
                    if found:
                        raise ConformanceFailure(
                            f"DONE barrier answered LANDED for round {i} ({len(rows)} segments) but the "
                            f"region does not hold exactly what was posted: {found}"
                        )
                    child.resume()
            finally:
                child.close()
        finally:
            regions_cm.__exit__(None, None, None)

    def test_done_barrier_past_deadline(self, kvconn_settings: Settings) -> None:
        """A writer frozen right after posting, resumed past its deadline: the
        barrier answers LANDED only if every byte is there (UNSETTLED is the
        honest answer for bytes still in flight). A backend with a fence has
        this checked on the way to its fence (the next check)."""
        require_capability(
            not kvconn_settings.capabilities.writer_fence,
            "writer_fence declared: test_writer_fence_stops_frozen_writer checks this barrier",
        )
        self._frozen_past_deadline(kvconn_settings, fence=False)

    def test_writer_fence_stops_frozen_writer(self, kvconn_settings: Settings) -> None:
        """A writer frozen mid-write, resumed past its deadline: its barrier
        answers LANDED only if every byte is there; then it fences, and from the
        fence's answer on not one byte lands, for the whole watch window."""
        require_capability(kvconn_settings.capabilities.writer_fence, "writer_fence not declared")
        self._frozen_past_deadline(kvconn_settings, fence=True)

    def _frozen_past_deadline(self, settings: Settings, fence: bool) -> None:
        size = 32 * MiB
        rows = [[i * MiB, (i * 7 % 32) * MiB, MiB] for i in range(32)]
        steps = ["post", "freeze", "barrier", "freeze"] + (["fence", "freeze"] if fence else [])
        with _regions(settings, {"a": size}) as regions:
            image = RegionImage(regions["a"], size)
            child = BareWriter(settings, _metadata(regions), [_round(rows, steps)], size)
            try:
                child.expect(60, "past deadline: writer start", event="ready")
                child.frozen(30, "past deadline: write posted")
                time.sleep(settings.write_timeout_s + 0.1)
                child.resume()
                settlement = child.settlement(settings, "past deadline: the barrier answers")
                if settlement == LANDED:
                    image.land(1, rows)
                    found = image.diff()
                    if found:
                        raise ConformanceFailure(
                            f"DONE barrier answered LANDED past its deadline while bytes were still in "
                            f"flight: {found}"
                        )
                if not fence:
                    return
                child.resume()
                child.frozen(_limit(settings) + 30, "writer fence: the fence returns")
                fenced = child.answer("fence", 1)["fenced"]
                if fenced is not True:
                    raise ConformanceFailure(
                        f"writer fence: the backend declares writer_fence but on_fence answered {fenced!r}"
                    )
                image.last = rows
                image.recanary()  # the writer is frozen: from here on, nothing may change
                child.resume()
                _watch(
                    settings,
                    [image],
                    f"writer fence: bytes landed within {settings.late_write_watch_s:.1f} s after on_fence "
                    "returned True (the fence does not stop a resumed writer)",
                )
            finally:
                child.close()

    # -- the owner fence ---------------------------------------------------------
    def test_owner_fence_stops_frozen_writer(
        self, kvconn_settings: Settings, record_property: Callable[[str, object], None]
    ) -> None:
        """(owner_fence) A writer (on another host in cross-host mode) frozen
        mid-write of 64 MiB; the region fences as owner; the writer is resumed
        and left to drive its transfer: not one byte of the whole region
        changes after the fence, over the watch window. Then a writer on
        another peer (another host), and the frozen writer itself, connect
        with the new metadata and land byte-exact."""
        settings = kvconn_settings
        require_capability(settings.capabilities.owner_fence, "owner_fence not declared")
        figures = owner_fence_check(settings)
        record_property("figures", _figures_line(figures))

    # -- a cancel ------------------------------------------------------------
    def test_failed_settled_means_nothing_lands(self, kvconn_settings: Settings) -> None:
        """An abort right after the post: whatever the barrier answers must be
        true. FAILED_SETTLED (or LANDED) means nothing more of the chunk lands,
        however fast or slow the transport copies."""
        settings = kvconn_settings
        size = 32 * MiB
        rows = [[i * 65536, (i * 263 % 512) * 65536, 65536] for i in range(512)]
        with _regions(settings, {"a": size}) as regions:
            image = RegionImage(regions["a"], size)
            child = BareWriter(
                settings, _metadata(regions), [_round(rows, ["post", "abort", "barrier", "freeze"])], size
            )
            try:
                child.expect(60, "cancel: writer start", event="ready")
                settlement = child.settlement(settings, "cancel: the barrier answers")
                if settlement == LANDED:
                    image.land(1, rows)
                    found = image.diff()
                    if found:
                        raise ConformanceFailure(f"cancel: the barrier answered LANDED but {found}")
                if settlement == UNSETTLED:
                    return  # honest: the core would poison the room and fence
                image.last = rows
                image.recanary(rows)
                child.resume()
                _watch(
                    settings,
                    [image],
                    f"cancel: the barrier answered {settlement!r} (nothing more can land) but bytes of "
                    "the chunk landed after the answer (a cancel requested is not a cancel settled)",
                )
            finally:
                child.close()

    # -- which decode ------------------------------------------------------------
    def test_each_chunk_lands_in_its_decode(self, kvconn_settings: Settings) -> None:
        """One writer, two decodes: every chunk lands in the decode it names and
        nowhere else, also after one decode restarts (a new region, connected
        again under the same name)."""
        settings = kvconn_settings
        size = 4 * MiB
        rng = random.Random(0x2DEC)
        plan = ["a", "b", "a", "b", "restart-a", "b", "a"]
        go = ["wait", "post", "barrier", "freeze"]
        rounds, rows_of = [], []
        for peer in plan:
            rows = scattered_rows(rng, 40, 9999, size, size)
            restart = peer.startswith("restart-")
            rounds.append(_round(rows, (["connect"] if restart else []) + go, peer.removeprefix("restart-")))
            rows_of.append(rows)
        with _regions(settings, {"a": size, "b": size}) as regions:
            images = {name: RegionImage(region, size) for name, region in regions.items()}
            # A healthy-write check: a first write to a new peer may set up a
            # connection, so a deadline no transport needs to meet.
            child = BareWriter(
                settings, _metadata(regions), rounds, size, write_timeout_s=max(settings.write_timeout_s, 5.0)
            )
            old: list[PageRegion] = []
            try:
                child.expect(60, "two decodes: writer start", event="ready")
                for i, (peer, rows) in enumerate(zip(plan, rows_of, strict=True), start=1):
                    name = peer.removeprefix("restart-")
                    if peer.startswith("restart-"):
                        old.append(regions[name])
                        regions[name] = settings.backend.open_region(size, settings.options_on(decode_host()))
                        images[name] = RegionImage(regions[name], size)
                        child.send_line(regions[name].metadata.hex())
                    child.send_line()
                    settlement = child.settlement(settings, f"two decodes: round {i} settles", i)
                    if settlement != LANDED:
                        raise ConformanceFailure(
                            f"two decodes: a healthy write (round {i}, to decode {peer!r}) settled {settlement!r}"
                        )
                    images[name].land(i, rows)
                    for other, image in images.items():
                        found = image.diff()
                        if found:
                            raise ConformanceFailure(
                                f"two decodes: round {i} was for decode {name!r}"
                                f"{' (restarted)' if peer != name else ''}, and decode {other!r} "
                                f"does not hold what it must: {found}"
                            )
                    child.resume()
            finally:
                child.close()
                for region in old:
                    region.close()

    # -- claims ------------------------------------------------------------
    def test_vram_claim_is_device_memory(self, kvconn_settings: Settings) -> None:
        """A backend that declares vram: a memory=vram region is device memory
        (a CUDA pointer query says so), and on a host without a GPU it cannot
        open at all."""
        settings = kvconn_settings
        require_capability("vram" in settings.capabilities.memory, "memory kind 'vram' not declared")
        options = {**settings.options_on(decode_host()), "memory": "vram"}
        gpu = gpu_on_host()
        try:
            region = settings.backend.open_region(MiB, options)
        except Exception as exc:
            if gpu:
                raise ConformanceFailure(
                    f"vram declared, but a memory=vram region fails to open: {exc}"
                ) from exc
            pytest.skip(f"no GPU on this host, and the memory=vram region refused to open ({exc})")
        try:
            if not gpu:
                raise ConformanceFailure(
                    "vram declared, and a memory=vram region opened on a host without a GPU "
                    "(no /dev/nvidiactl): the region is host memory"
                )
            address = _region_address(region)
            if address is None:
                pytest.skip("the region exposes no address (addr) to ask CUDA where it lives")
            kind = _cuda_memory_type(address)
            if kind != "device":
                raise ConformanceFailure(f"vram declared, but the memory=vram region is {kind} memory")
        finally:
            region.close()

    def test_cross_host_claim(self, kvconn_settings: Settings) -> None:
        """A backend that declares cross_host: a writer in another network, mount
        and PID namespace (no shared loopback, /dev/shm or processes) lands a
        round byte-exact through the barrier."""
        settings = kvconn_settings
        made = fabric()
        if made is not None:
            require_capability(settings.capabilities.cross_host, "cross_host not declared")
            _cross_host_round(settings, made["decode"], made["prefill0"])
            return
        # Without the hosts made: what the backend claims once bound to a host.
        sample = hosts_harness.Host("decode", "", "10.64.0.1", hosts_harness.IFACE, "", None)  # type: ignore[arg-type]
        declared = capabilities_of(settings.backend, settings.options_on(sample)).cross_host
        require_capability(declared, "cross_host not declared")
        why = hosts_harness.unavailable()
        if why:
            pytest.skip(f"cross_host: {why}")
        with hosts_harness.hosts(("decode", "prefill0")) as pair:
            _cross_host_round(settings, pair["decode"], pair["prefill0"])


def _region_address(region: PageRegion) -> int | None:
    """Where the region's memory starts, if it says: a public ``address``
    (or ``addr``), else the :class:`kvconn.memory.Memory` it holds."""
    for owner in (region, getattr(region, "_mem", None)):
        for name in ("address", "addr"):
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _cuda_memory_type(address: int) -> str:
    """CUDA's word on where ``address`` lives: device, host, or unknown."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    # The calling thread needs a context; the device's primary one is the
    # one CuPy and PyTorch allocate in.
    context = ctypes.c_void_p()
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) == 0:
        cuda.cuCtxSetCurrent(context)
    value = ctypes.c_uint(0)
    pointer_memory_type = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    err = cuda.cuPointerGetAttribute(ctypes.byref(value), pointer_memory_type, ctypes.c_ulonglong(address))
    if err != 0:
        return f"unknown to CUDA (error {err}), i.e. not device"
    return {1: "host", 2: "device", 3: "array", 4: "unified"}.get(value.value, f"type {value.value}")


def _cross_host_round(settings: Settings, decode: Host, writer_host: Host) -> None:
    size = 4 * MiB
    rows = scattered_rows(random.Random(0xC405), 200, 9999, size, size)
    owner = Child(
        "kvconn.conformance.region_proc",
        {"backend": settings.backend_name, "options": settings.options_on(decode), "nbytes": size},
        host=decode,
    )
    try:
        ready = owner.expect(60, "cross_host: region opens in its namespace", event="ready")
        writer = BareWriter(
            settings,
            {"a": bytes.fromhex(ready["metadata"])},
            [_round(rows, ["post", "barrier"])],
            size,
            write_timeout_s=max(settings.write_timeout_s, 5.0),
            host=writer_host,
        )
        try:
            event = writer.expect(60 + _limit(settings), "cross_host: the barrier answers", event="barrier")
        except ConformanceFailure as exc:
            failed = [e for e in writer.history() if e.get("event") == "connect_failed"]
            why = failed[0]["error"] if failed else str(exc)
            raise ConformanceFailure(
                f"cross_host declared, but a writer in another network and mount namespace cannot write "
                f"to the region: {why}"
            ) from None
        finally:
            writer.close()
        if event["settlement"] != LANDED:
            raise ConformanceFailure(
                f"cross_host: a healthy write from another namespace settled {event['settlement']!r}"
            )
        owner.send_line(json.dumps({"rows": rows}))
        checked = owner.expect(30, "cross_host: the region checks the round", event="checked")
        if checked["bad"]:
            raise ConformanceFailure(f"cross_host: the round landed wrong: {checked['bad']}")
    finally:
        owner.close()


def _figures_line(figures: Mapping[str, Any]) -> str:
    """What the owner-fence check measured, in one line of the suite's summary."""
    return (
        f"fence {figures['fence_s'] * 1000:.0f} ms; {figures['landed_before_fence']} of {figures['posted']} "
        f"bytes landed before it; {figures['late_bytes']} bytes after it in {figures['watch_s']:.1f} s; "
        f"resumed writer's barrier: {figures['frozen_writer_settlement']}; "
        + ("writers on other hosts" if figures["cross_host"] else "one host")
    )


#: How long after its post the owner-fence check freezes the writer: about
#: a fifth of a 64 MiB write over tcp on a loaded 2-core machine (~1 GB/s).
OWNER_FENCE_FREEZE_AFTER_S = 0.015


def owner_fence_check(settings: Settings) -> dict[str, Any]:
    """The owner-fence check (see ``test_owner_fence_stops_frozen_writer``);
    what it measured."""
    size = 64 * MiB
    half = size // 2
    rows = [[i * MiB, (i * 7 % 64) * MiB, MiB] for i in range(64)]  # every byte of the region
    rng = random.Random(0x0F3C)
    second = scattered_rows(rng, 300, 9999, half, half)
    again = [[src, dst + half, n] for src, dst, n in scattered_rows(rng, 300, 9999, half, half)]
    watch_s = settings.late_write_watch_s
    # Long enough that the resumed writer's barrier drives the transfer for
    # the whole watch window, never giving up on its own deadline first.
    drive_s = watch_s + 5.0 + _limit(settings)
    figures: dict[str, Any] = {"backend": settings.backend_name, "cross_host": decode_host() is not None}
    owner = Child(
        "kvconn.conformance.owner_fence_proc",
        {"backend": settings.backend_name, "options": settings.options_on(decode_host()), "nbytes": size},
        host=decode_host(),
    )
    writers: list[BareWriter] = []
    try:
        ready = owner.expect(60, "owner fence: the region opens", event="ready")
        old = bytes.fromhex(ready["metadata"])
        frozen = BareWriter(
            settings,
            {"a": old},
            [
                _round([[0, 0, 4096]], ["post", "barrier", "freeze"]),  # connected before the big write
                _round(rows, ["post", "barrier", "freeze"]),
                _round(again, ["connect", "post", "barrier"]),
            ],
            size,
            write_timeout_s=drive_s,
            host=prefill_host(0),
        )
        writers.append(frozen)
        frozen.expect(60, "owner fence: writer start", event="ready")
        if frozen.settlement(settings, "owner fence: the first, small write") != LANDED:
            raise ConformanceFailure("owner fence: a healthy 4 KiB write did not land")
        owner.send_line(json.dumps({"cmd": "canary"}))
        owner.expect(30, "owner fence: the region lays its canary again", event="canaried")
        frozen.resume()
        frozen.expect(30, "owner fence: the writer posts", event="post", round=2)
        # Frozen from outside, with its barrier driving the transfer: bytes
        # are on the wire, in socket buffers and in the transport's queues.
        time.sleep(OWNER_FENCE_FREEZE_AFTER_S)
        frozen.signal(signal.SIGSTOP)
        wait_for(frozen.stopped, 5, "owner fence: the writer froze", poll=0.002)
        if any(e.get("event") == "barrier" and e.get("round") == 2 for e in frozen.history()):
            raise ConformanceFailure(
                f"owner fence: the 64 MiB write had settled {OWNER_FENCE_FREEZE_AFTER_S * 1000:.0f} ms after "
                "its post (the writer was not caught mid-write, so this run proves nothing)"
            )
        owner.send_line(json.dumps({"cmd": "fence"}))
        fenced = owner.expect(60 + _limit(settings), "owner fence: owner_fence() returns", event="fenced")
        figures["fence_s"] = fenced["fence_s"]
        figures["landed_before_fence"] = fenced["landed_before"]
        figures["posted"] = size
        new = bytes.fromhex(fenced["metadata"])
        if new == old:
            raise ConformanceFailure("owner fence: owner_fence() returned the old metadata")
        if fenced["landed_before"] >= size:
            raise ConformanceFailure(
                "owner fence: the whole transfer had landed before the fence (the writer was not "
                "caught mid-write, so this run proves nothing)"
            )
        frozen.resume()
        owner.send_line(json.dumps({"cmd": "watch", "seconds": watch_s}))
        watched = owner.expect(watch_s + 60, "owner fence: the region is watched", event="watched")
        figures["late_bytes"] = watched["changed"]
        figures["watch_s"] = watch_s
        if watched["changed"]:
            raise ConformanceFailure(
                f"owner fence: {watched['changed']} bytes landed {watched['at_s']:.2f} s after owner_fence() "
                f"returned (the first at offset {watched['first']}): the fence does not stop a resumed writer"
            )
        # The resumed writer's own barrier: it gave up (or, for a fence that
        # lies, it landed, which the watch caught already).
        frozen.frozen(drive_s + _limit(settings) + 30, "owner fence: the resumed writer's barrier answers")
        figures["frozen_writer_settlement"] = frozen.answer("barrier", 2)["settlement"]
        # Another peer, on another host, connects with the new metadata.
        other = BareWriter(
            settings,
            {"a": new},
            [_round(second, ["post", "barrier"])],
            size,
            write_timeout_s=max(settings.write_timeout_s, 10.0) + _limit(settings),
            host=prefill_host(1),
        )
        writers.append(other)
        landed = other.expect(
            60 + _limit(settings), "owner fence: a new writer's barrier answers", event="barrier"
        )
        if landed["settlement"] != LANDED:
            raise ConformanceFailure(
                f"owner fence: a writer connecting with the new metadata settled {landed['settlement']!r}"
            )
        # The frozen writer re-bootstraps with the new metadata, as every peer must.
        frozen.send_line(new.hex())
        frozen.resume()
        rebooted = frozen.expect(
            60 + _limit(settings), "owner fence: the old writer reconnects", event="barrier", round=3
        )
        if rebooted["settlement"] != LANDED:
            raise ConformanceFailure(
                f"owner fence: the fenced writer, connected again with the new metadata, settled "
                f"{rebooted['settlement']!r}"
            )
        owner.send_line(json.dumps({"cmd": "check", "rounds": [[1, second], [3, again]]}))
        checked = owner.expect(60, "owner fence: the region checks both writes", event="checked")
        if checked["bad"]:
            raise ConformanceFailure(
                f"owner fence: after the fence the writes landed wrong: {checked['bad']}"
            )
    finally:
        for writer in writers:
            writer.close()
        owner.close()
    return figures
