"""Checks of what the transport itself promises, through a bare writer
process (:mod:`kvconn.conformance.writer_proc`) and regions in the
harness's region host (:mod:`kvconn.conformance.region_host`).

Each check gates the writer the same way: the writer freezes itself (every
thread of it) right after the hook whose answer is checked, so the suite
compares the destination with that answer while nothing of the writer can
move, and lays fresh canaries before it lets the writer run again. A copy
that the answer said was over, and that runs on, is then caught whatever
its speed. What runs outside the writer process (a DMA engine, a helper
process) is watched for ``Settings.late_write_watch_s``.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable

import pytest

from kvconn.conformance import region_host, writer_fence
from kvconn.conformance.harness import (
    Child,
    ConformanceFailure,
    OwnerProc,
    RankProc,
    RegionImage,
    Settings,
    decode_host,
    fabric,
    gpu_on_host,
    scattered_rows,
)
from kvconn.conformance.owner_fence import figures_line, owner_fence_check, stale_writer_check
from kvconn.conformance.plugin import NEEDS_HOSTS, require_capability
from kvconn.conformance.stakes import at_stake
from kvconn.conformance.writer_fence import frozen_past_deadline
from kvconn.conformance.writing import (
    LANDED,
    UNSETTLED,
    BareWriter,
    healthy_write_timeout,
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
            compared = 0
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
                    compared += sum(n for _, _, n in rows)
            finally:
                child.close()
            at_stake(
                compared,
                sum(n for rows in rounds_rows for _, _, n in rows),
                f"{len(rounds_rows)} LANDED answers, {compared / MiB:.1f} MiB in up to "
                f"{max(len(rows) for rows in rounds_rows)} segments a chunk, the whole {size // MiB} MiB "
                "region compared right after each",
                "every round answered and compared",
            )
        finally:
            regions_cm.__exit__(None, None, None)

    def test_done_barrier_past_deadline(self, kvconn_settings: Settings) -> None:
        """A writer frozen right after posting, resumed past its deadline: the
        barrier answers LANDED only if every byte is there (UNSETTLED is the
        honest answer for bytes still in flight). A backend with a fence has
        this checked on the way to its fence (the next check); the rank-level
        check (``test_barrier_answer_holds_in_a_rank``) checks it independently."""
        require_capability(
            not kvconn_settings.capabilities.writer_fence,
            "writer_fence declared: test_writer_fence_stops_frozen_writer checks this barrier",
        )
        frozen_past_deadline(kvconn_settings)

    @pytest.mark.kvconn_releases
    def test_writer_fence_stops_frozen_writer(
        self, kvconn_settings: Settings, record_property: Callable[[str, object], None]
    ) -> None:
        """Two fences, each with a write in flight. First the writer is
        frozen right after posting 32 MiB: the bytes still pending then are in
        flight when the resumed writer fences at once, and not one of them
        lands after on_fence answered. (If on_post landed more than three
        quarters before it returned, the writer is frozen from outside 2 ms
        into a later post: a quarter must still be pending there, else the
        run proves nothing and fails saying so.) Then a writer frozen
        mid-write, resumed past its deadline: its barrier answers LANDED only
        if every byte is there; it fences, and nothing lands after. Both
        regions and the writer stay guarded until the end of the run."""
        require_capability(kvconn_settings.capabilities.writer_fence, "writer_fence not declared")
        record_property(
            "figures", writer_fence.figures_line(writer_fence.writer_fence_check(kvconn_settings))
        )

    @pytest.mark.kvconn_releases
    def test_writer_fence_holds_across_a_partition(
        self, kvconn_settings: Settings, record_property: Callable[[str, object], None]
    ) -> None:
        """(cross_host) The writer's host is cut off with its 32 MiB write in
        flight; it fences during the cut; the link heals: once a message
        from that host has crossed the healed link (as the rank's proof of
        the fence would), not one byte lands, over the watch window and to
        the end of the run. A fence that closes its TCP connections instead of
        resetting them fails here: the kernel still holds their queued
        bytes, and sends them once the link is back."""
        require_capability(kvconn_settings.cross_host, NEEDS_HOSTS)
        require_capability(kvconn_settings.capabilities.writer_fence, "writer_fence not declared")
        figures = writer_fence.partition_fence_check(kvconn_settings)
        record_property("figures", writer_fence.partition_figures(figures))

    def test_landed_across_a_partition_means_delivered(
        self, kvconn_settings: Settings, record_property: Callable[[str, object], None]
    ) -> None:
        """(cross_host) After a first write over a healthy link, the writer's
        host is cut off and it posts 64 KiB: a barrier that answers LANDED
        must find every byte in decode's region already. A transport that
        counts a write done once its kernel took it would let the rank ack a
        chunk whose bytes still wait to cross, and land after decode reused
        the pages."""
        require_capability(kvconn_settings.cross_host, NEEDS_HOSTS)
        figures = writer_fence.partition_landed_check(kvconn_settings)
        record_property("figures", f"the barrier answered {figures['settlement']} with the link cut")

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

    def test_owner_fence_refuses_stale_writers(
        self, kvconn_settings: Settings, record_property: Callable[[str, object], None]
    ) -> None:
        """(owner_fence) A writer that connected before the region fenced as
        owner posts a new write with the old metadata after it: whatever its
        barrier answers, not one byte of the region changes over the watch
        window. (The previous check's blind spot is timing: it needs a write
        caught in flight; this one has none.)"""
        settings = kvconn_settings
        require_capability(settings.capabilities.owner_fence, "owner_fence not declared")
        figures = stale_writer_check(settings)
        record_property("figures", f"the stale write's barrier answered {figures['settlement']}")

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
            # A deadline a write meets on a loaded host: an answer past it
            # (UNSETTLED) vouches for nothing, and the check would have nothing to check.
            child = BareWriter(
                settings,
                metadata_of(regions),
                [round_of(rows, ["post", "abort", "barrier", "freeze"])],
                size,
                write_timeout_s=max(settings.write_timeout_s, 5.0) + limit_of(settings),
            )
            kept = False
            try:
                child.expect(60, "cancel: writer start", event="ready")
                settlement = child.settlement(settings, "cancel: the barrier answers")
                image.land(1, rows)
                pending = image.differing(rows)
                if settlement == LANDED:
                    found = image.diff()
                    if found:
                        raise ConformanceFailure(f"cancel: the barrier answered LANDED but {found}")
                at_stake(
                    0 if settlement == UNSETTLED else size,
                    1,
                    f"a cancelled 32 MiB write answered {settlement} with {pending / MiB:.1f} MiB not landed",
                    "an answer that vouches for the write (LANDED or FAILED_SETTLED; UNSETTLED vouches for "
                    "nothing, and the core would fence, which the fence checks check)",
                )
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
        again under the same name). Each decode numbers its rooms from 1 (a
        room id is unique per decode only), the restarted one again."""
        settings = kvconn_settings
        size = 4 * MiB
        rng = random.Random(0x2DEC)
        plan = ["a", "b", "a", "b", "restart-a", "b", "a"]
        go = ["wait", "post", "barrier", "freeze"]
        rounds, rows_of = [], []
        rooms: dict[str, int] = {}
        for peer in plan:
            rows = scattered_rows(rng, 40, 9999, size, size)
            restart = peer.startswith("restart-")
            name = peer.removeprefix("restart-")
            rooms[name] = 1 if restart else rooms.get(name, 0) + 1
            rounds.append(round_of(rows, (["connect"] if restart else []) + go, name, rooms[name]))
            rows_of.append(rows)
        with open_regions(settings, {"a": size, "b": size}) as regions:
            images = {name: RegionImage(region, size) for name, region in regions.items()}
            child = BareWriter(
                settings, metadata_of(regions), rounds, size, write_timeout_s=healthy_write_timeout(settings)
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
            rounds_of = {
                name: sum(1 for peer in plan if peer.removeprefix("restart-") == name) for name in rooms
            }
            at_stake(
                min(rounds_of.values()),
                1,
                f"{len(plan)} LANDED rounds into two decodes numbering their rooms alike "
                f"({', '.join(f'{n}: {k}' for n, k in sorted(rounds_of.items()))}, one restart), both "
                "regions compared after each",
                "rounds into each decode",
            )

    # -- claims ------------------------------------------------------------
    def test_vram_claim_is_device_memory(self, kvconn_settings: Settings) -> None:
        """A backend that declares vram: a memory=vram region (in the region
        host) is device memory (a CUDA pointer query there says so), and on
        a host without a GPU it cannot open at all."""
        settings = kvconn_settings
        require_capability("vram" in settings.capabilities.memory, "memory kind 'vram' not declared")
        options = {**settings.options_on(decode_host()), "memory": "vram"}
        gpu = gpu_on_host()
        try:
            region = region_host.open_region(settings.backend_name, MiB, options, decode_host())
        except RuntimeError as exc:  # the region's own error, from the region host
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
            kind = region.memory_kind()
            if kind is None:
                pytest.skip("the region exposes no address (addr) to ask CUDA where it lives")
            if kind != "device":
                raise ConformanceFailure(f"vram declared, but the memory=vram region is {kind} memory")
            at_stake(1, 1, "a memory=vram region CUDA calls device memory", "a region CUDA was asked about")
        finally:
            region.close()

    def test_cross_host_claim(self, kvconn_settings: Settings) -> None:
        """A backend that declares cross_host: a writer in another network, mount
        and PID namespace (no shared loopback, /dev/shm or processes) lands a
        round byte-exact through the barrier."""
        _across_hosts(kvconn_settings, _cross_hostround_of)

    def test_cross_host_claim_through_a_rank(self, kvconn_settings: Settings) -> None:
        """A backend that declares cross_host: a prefill rank (the kvconn
        runtime) on another host writes rooms into a decode endpoint's pages
        on its own host, byte-exact. (The previous check drives the hooks
        from a bare writer; this one goes through connect on decode's Hello,
        the runtime's chunks and the control plane across hosts.)"""
        _across_hosts(kvconn_settings, _cross_host_rooms)


def _across_hosts(settings: Settings, check: Callable[[Settings, Host, Host], None]) -> None:
    """Run ``check`` with decode on one host and a writer on another: the
    fabric's hosts in cross-host mode, else a pair made for it."""
    made = fabric()
    if made is not None:
        require_capability(settings.capabilities.cross_host, "cross_host not declared")
        check(settings, made["decode"], made["prefill0"])
        return
    # Without the hosts made: what the backend claims once bound to a host.
    sample = hosts_harness.Host("decode", "", "10.64.0.1", hosts_harness.IFACE, "", None)  # type: ignore[arg-type]
    declared = capabilities_of(settings.backend, settings.options_on(sample)).cross_host
    require_capability(declared, "cross_host not declared")
    why = hosts_harness.unavailable()
    if why:
        pytest.skip(f"cross_host: {why}")
    with hosts_harness.hosts(("decode", "prefill0"), sealed=True) as pair:
        check(settings, pair["decode"], pair["prefill0"])


def _crossed(
    what: str, decode: Host, writer_host: Host, before: tuple[int, int, int, int], payload: int
) -> None:
    """The payload crossed the network: the writer's host sent, and decode's
    received, at least that many bytes on their links while it was written
    (a transport that reaches the region another way, a file or memory
    the hosts share, sends next to nothing)."""
    decode_rx, _ = decode.traffic()
    _, writer_tx = writer_host.traffic()
    sent, received = writer_tx - before[3], decode_rx - before[0]
    at_stake(
        min(sent, received),
        payload,
        f"{payload / MiB:.1f} MiB {what}, {sent / MiB:.1f} MiB sent on the writer's link and "
        f"{received / MiB:.1f} MiB received on decode's",
        "the bytes written to cross the network between the hosts (the hosts share nothing else)",
    )


def _traffic(decode: Host, writer_host: Host) -> tuple[int, int, int, int]:
    return (*decode.traffic(), *writer_host.traffic())


def _cross_host_rooms(settings: Settings, decode: Host, writer_host: Host) -> None:
    page_bytes, num_pages = 64 << 10, 96
    rank = RankProc(settings, 0, 1, page_bytes, 4, num_pages, on=writer_host)
    owner: OwnerProc | None = None
    before = _traffic(decode, writer_host)
    written = 0
    try:
        owner = OwnerProc(settings, [rank.ready()], num_pages, page_bytes, on=decode)
        started = owner.next_event(
            60,
            "cross_host through a rank: decode starts",
            lambda e: e.get("event") in ("ready", "failed"),
            "ready",
        )
        if started["event"] == "failed":
            raise ConformanceFailure(
                f"cross_host declared, but a decode endpoint cannot start with a rank on another host "
                f"(network, mount and PID namespace): {started['error']}"
            )
        for room, pages in ((0xC4_0001, list(range(0, 40, 2))), (0xC4_0002, list(range(41, 96)))):
            owner.command(10, "cross_host through a rank: open a room", "open", room=room, pages=pages)
            timeout = 30.0 + limit_of(settings)
            done = owner.command(
                timeout + 10, "cross_host through a rank: the room ends", "finish", room=room, within=timeout
            )
            if done["state"] != "SUCCESS":
                failed = [e for e in rank.history() if e.get("event") in ("raising", "connect_failed")]
                raise ConformanceFailure(
                    f"cross_host declared, but a room of {len(pages)} pages written by a rank on another host "
                    f"(network, mount and PID namespace) ended {done['state']} within {timeout:.0f} s"
                    + (f" ({failed[0]})" if failed else "")
                )
            if done["bad"]:
                raise ConformanceFailure(
                    f"cross_host: a room written by a rank on another host holds wrong bytes in pages "
                    f"{done['bad'][:8]}"
                )
            written += len(pages) * page_bytes
        _crossed("of two rooms written by a rank on another host", decode, writer_host, before, written)
    finally:
        if owner is not None:
            owner.close()
        rank.close()


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
        before = _traffic(decode, writer_host)
        writer = BareWriter(
            settings,
            {"a": bytes.fromhex(ready["metadata"])},
            [round_of(rows, ["post", "barrier"])],
            size,
            write_timeout_s=healthy_write_timeout(settings),
            host=writer_host,
        )
        try:
            event = writer.expect(
                60 + healthy_write_timeout(settings), "cross_host: the barrier answers", event="barrier"
            )
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
        _crossed(
            "written by a bare writer on another host",
            decode,
            writer_host,
            before,
            sum(n for _, _, n in rows),
        )
    finally:
        owner.close()
