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
import logging
import random
import time
from collections.abc import Callable, Sequence

import pytest

from kvconn.conformance import region_host
from kvconn.conformance.harness import (
    Child,
    ConformanceFailure,
    RegionImage,
    Settings,
    decode_host,
    fabric,
    gpu_on_host,
    scattered_rows,
)
from kvconn.conformance.owner_fence import figures_line, owner_fence_check
from kvconn.conformance.plugin import require_capability
from kvconn.conformance.writing import (
    LANDED,
    UNSETTLED,
    BareWriter,
    keep_for_the_run,
    limit_of,
    metadata_of,
    open_regions,
    round_of,
    watch,
)
from kvconn.testing import hosts as hosts_harness
from kvconn.testing.hosts import Host
from kvconn.transport import PageRegion, capabilities_of

log = logging.getLogger(__name__)
MiB = 1 << 20


def _fenced(child: BareWriter, round_no: int) -> None:
    fenced = child.answer("fence", round_no)["fenced"]
    if fenced is not True:
        raise ConformanceFailure(
            f"writer fence: the backend declares writer_fence but on_fence answered {fenced!r}"
        )


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
            regions_cm = open_regions(settings, {"a": size}, **extra)
            regions = regions_cm.__enter__()
        except Exception as exc:
            pytest.skip(f"cannot open a {memory} region on this host: {exc}")
        try:
            if memory == "vram" and not gpu_on_host():
                # The vram claim's second check (the first: test_vram_claim_is_device_memory).
                raise ConformanceFailure(
                    "vram declared, and a memory=vram region opened on a host without a GPU: its "
                    "rounds would check host memory"
                )
            image = RegionImage(regions["a"], size)
            rounds = [round_of(rows, ["wait", "post", "barrier", "freeze"]) for rows in rounds_rows]
            child = BareWriter(
                settings, metadata_of(regions), rounds, size, {**settings.options, **extra}, 5.0
            )
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

    @pytest.mark.kvconn_releases
    def test_writer_fence_stops_frozen_writer(self, kvconn_settings: Settings) -> None:
        """Two fences, each with a write really in flight. First the writer
        is frozen right after posting 32 MiB: the bytes still pending then
        (a quarter of them at least, else the run proves nothing and fails
        saying so) are in flight when the resumed writer fences at once, and
        not one of them lands after on_fence answered. Then a writer frozen
        mid-write, resumed past its deadline: its barrier answers LANDED only
        if every byte is there; it fences, and nothing lands after. Both
        regions and the writer stay guarded until the end of the run."""
        require_capability(kvconn_settings.capabilities.writer_fence, "writer_fence not declared")
        self._fences(kvconn_settings)

    def _fences(self, settings: Settings) -> None:
        size = 32 * MiB
        rows = [[i * MiB, (i * 7 % 32) * MiB, MiB] for i in range(32)]
        rounds = [
            round_of(rows, ["post", "freeze", "fence", "freeze"], "a"),
            round_of(rows, ["post", "freeze", "barrier", "freeze", "fence", "freeze"], "b"),
        ]
        late = "bytes landed after on_fence returned True (the fence does not stop a resumed writer)"
        with open_regions(settings, {"a": size, "b": size}) as regions:
            images = {name: RegionImage(region, size) for name, region in regions.items()}
            child = BareWriter(settings, metadata_of(regions), rounds, size)
            kept = False
            try:
                child.expect(60, "writer fence: writer start", event="ready")
                child.frozen(30, "writer fence: the write is posted", round=1)
                first = images["a"]
                first.land(1, rows)
                pending = first.differing()
                if pending < size // 4:
                    raise ConformanceFailure(
                        f"writer fence: {size - pending} of {size} bytes had landed when the writer froze "
                        "right after on_post returned: too little in flight to show that the fence stops "
                        "a write, so this run proves nothing (a transport that lands every write inside "
                        "on_post has nothing to fence: do not declare writer_fence)"
                    )
                child.resume()  # its next step is the fence, with those bytes in flight
                child.frozen(limit_of(settings) + 30, "writer fence: the fence returns", round=1)
                _fenced(child, 1)
                log.info("writer fence: %d of %d bytes in flight when the fence ran", pending, size)
                first.recanary(rows)  # the writer is frozen: from here on, nothing may change
                child.resume()
                self._past_deadline(settings, child, images["b"], rows, 2, [first], late)
                _fenced(child, 2)
                images["b"].last = rows
                images["b"].recanary()
                child.resume()
                watch(
                    settings,
                    list(images.values()),
                    f"writer fence: within {settings.late_write_watch_s:.1f} s, {late}",
                )
                keep_for_the_run(regions, images, "regions a writer fenced", child)
                kept = True
            finally:
                if not kept:
                    child.close()

    def _frozen_past_deadline(self, settings: Settings, fence: bool) -> None:
        size = 32 * MiB
        rows = [[i * MiB, (i * 7 % 32) * MiB, MiB] for i in range(32)]
        with open_regions(settings, {"a": size}) as regions:
            image = RegionImage(regions["a"], size)
            rounds = [round_of(rows, ["post", "freeze", "barrier", "freeze"])]
            child = BareWriter(settings, metadata_of(regions), rounds, size)
            try:
                child.expect(60, "past deadline: writer start", event="ready")
                self._past_deadline(settings, child, image, rows, 1, [], "")
            finally:
                child.close()

    def _past_deadline(
        self,
        settings: Settings,
        child: BareWriter,
        image: RegionImage,
        rows: list[list[int]],
        round_no: int,
        fenced: Sequence[RegionImage],
        late: str,
    ) -> None:
        """Round ``round_no``: frozen right after its post, resumed past its
        deadline, its barrier must tell the truth. ``fenced`` regions must not
        change meanwhile."""
        child.frozen(30, "past deadline: write posted", round=round_no)
        time.sleep(settings.write_timeout_s + 0.1)
        for done in fenced:
            found = done.diff()
            if found:
                raise ConformanceFailure(f"writer fence: {late}: {found}")
        child.resume()
        settlement = child.settlement(settings, "past deadline: the barrier answers", round_no)
        if settlement == LANDED:
            image.land(round_no, rows)
            found = image.diff()
            if found:
                raise ConformanceFailure(
                    f"DONE barrier answered LANDED past its deadline while bytes were still in flight: {found}"
                )
        if fenced:
            child.resume()
            child.frozen(limit_of(settings) + 30, "writer fence: the fence returns", round=round_no)

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
        record_property("figures", figures_line(figures))

    # -- a cancel ------------------------------------------------------------
    @pytest.mark.kvconn_releases
    def test_failed_settled_means_nothing_lands(self, kvconn_settings: Settings) -> None:
        """An abort right after the post: whatever the barrier answers must be
        true. FAILED_SETTLED (or LANDED) means nothing more of the chunk lands,
        however fast or slow the transport copies."""
        settings = kvconn_settings
        size = 32 * MiB
        rows = [[i * 65536, (i * 263 % 512) * 65536, 65536] for i in range(512)]
        with open_regions(settings, {"a": size}) as regions:
            image = RegionImage(regions["a"], size)
            child = BareWriter(
                settings, metadata_of(regions), [round_of(rows, ["post", "abort", "barrier", "freeze"])], size
            )
            kept = False
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
                watch(
                    settings,
                    [image],
                    f"cancel: the barrier answered {settlement!r} (nothing more can land) but bytes of "
                    "the chunk landed after the answer (a cancel requested is not a cancel settled)",
                )
                keep_for_the_run(regions, {"a": image}, f"a region whose write settled {settlement}", child)
                kept = True
            finally:
                if not kept:
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
            rounds.append(
                round_of(rows, (["connect"] if restart else []) + go, peer.removeprefix("restart-"))
            )
            rows_of.append(rows)
        with open_regions(settings, {"a": size, "b": size}) as regions:
            images = {name: RegionImage(region, size) for name, region in regions.items()}
            # A healthy-write check: a first write to a new peer may set up a
            # connection, so a deadline no transport needs to meet.
            child = BareWriter(
                settings,
                metadata_of(regions),
                rounds,
                size,
                write_timeout_s=max(settings.write_timeout_s, 5.0),
            )
            old: list[PageRegion] = []
            try:
                child.expect(60, "two decodes: writer start", event="ready")
                for i, (peer, rows) in enumerate(zip(plan, rows_of, strict=True), start=1):
                    name = peer.removeprefix("restart-")
                    if peer.startswith("restart-"):
                        old.append(regions[name])
                        regions[name] = region_host.open_region(
                            settings.backend_name, size, settings.options_on(decode_host()), decode_host()
                        )
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
            _cross_hostround_of(settings, made["decode"], made["prefill0"])
            return
        # Without the hosts made: what the backend claims once bound to a host.
        sample = hosts_harness.Host("decode", "", "10.64.0.1", hosts_harness.IFACE, "", None)  # type: ignore[arg-type]
        declared = capabilities_of(settings.backend, settings.options_on(sample)).cross_host
        require_capability(declared, "cross_host not declared")
        why = hosts_harness.unavailable()
        if why:
            pytest.skip(f"cross_host: {why}")
        with hosts_harness.hosts(("decode", "prefill0")) as pair:
            _cross_hostround_of(settings, pair["decode"], pair["prefill0"])


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


def _cross_hostround_of(settings: Settings, decode: Host, writer_host: Host) -> None:
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
            [round_of(rows, ["post", "barrier"])],
            size,
            write_timeout_s=max(settings.write_timeout_s, 5.0),
            host=writer_host,
        )
        try:
            event = writer.expect(60 + limit_of(settings), "cross_host: the barrier answers", event="barrier")
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
