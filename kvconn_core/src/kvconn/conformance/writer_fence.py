"""The writer-fence check through a bare writer
(``test_writer_fence_stops_frozen_writer``), and the past-deadline barrier
round it shares with ``test_done_barrier_past_deadline``.

A fence proves something only if a write is in flight when it runs. The
writer freezes itself right after ``on_post`` returned; the bytes of its
32 MiB still pending then are what the fence must stop. A transport whose
``on_post`` moves every byte before it returns (nixl's ``transfer()`` over
tcp on an idle machine) has nothing in flight at any fence the runtime
could run: for it the check proves instead that the write really was in
flight inside ``on_post`` (the writer frozen from outside
:data:`FREEZE_AFTER_S` into its post, a quarter of it at least still
pending), and says so in its figures; only a transport that lands three
quarters of 32 MiB within that time fails for proving nothing.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from typing import Any

from kvconn.conformance.harness import (
    ConformanceFailure,
    RegionImage,
    Settings,
    decode_host,
    prefill_host,
    wait_for,
)
from kvconn.conformance.writing import (
    LANDED,
    BareWriter,
    keep_for_the_run,
    limit_of,
    metadata_of,
    open_regions,
    round_of,
    watch,
)
from kvconn.testing.hosts import round_trip_s

MiB = 1 << 20
SIZE = 32 * MiB
ROWS = [[i * MiB, (i * 7 % 32) * MiB, MiB] for i in range(32)]
#: How long into its post a writer whose ``on_post`` landed (nearly) all of
#: it is frozen from outside, to show that the write was in flight there:
#: a transport that lands 24 MiB within it has nothing for a fence to stop.
FREEZE_AFTER_S = 0.002
LATE = "bytes landed after on_fence returned True (the fence does not stop a resumed writer)"


def _fenced(child: BareWriter, round_no: int) -> None:
    fenced = child.answer("fence", round_no)["fenced"]
    if fenced is not True:
        raise ConformanceFailure(
            f"writer fence: the backend declares writer_fence but on_fence answered {fenced!r}"
        )


def figures_line(figures: dict[str, Any]) -> str:
    """What the writer-fence check measured, for the suite's summary."""
    line = f"{figures['in_flight_at_fence'] / MiB:.1f} of 32 MiB in flight at the first fence"
    if "in_flight_inside_post" in figures:
        line += (
            f" (on_post lands its write before it returns: {figures['in_flight_inside_post'] / MiB:.1f} "
            f"MiB still pending {FREEZE_AFTER_S * 1000:.0f} ms into it)"
        )
    return line


def writer_fence_check(settings: Settings) -> dict[str, Any]:
    """Two fences: one right after the post, one after a barrier past its
    deadline; nothing lands after either (see the test's docstring)."""
    rounds = [
        round_of(ROWS, ["post", "freeze", "fence", "freeze"], "a"),
        round_of(ROWS, ["post", "freeze", "barrier", "freeze", "fence", "freeze"], "b"),
        # Only if the first post left too little in flight: frozen from outside inside on_post.
        round_of(ROWS, ["wait", "fill", "post", "barrier"], "c"),
    ]
    figures: dict[str, Any] = {}
    with open_regions(settings, {"a": SIZE, "b": SIZE, "c": SIZE}) as regions:
        images = {name: RegionImage(region, SIZE) for name, region in regions.items()}
        child = BareWriter(settings, metadata_of(regions), rounds, SIZE)
        kept = False
        try:
            child.expect(60, "writer fence: writer start", event="ready")
            child.frozen(30, "writer fence: the write is posted", round=1)
            first = images["a"]
            first.land(1, ROWS)
            pending = figures["in_flight_at_fence"] = first.differing()
            child.resume()  # its next step is the fence, with those bytes in flight
            child.frozen(limit_of(settings) + 30, "writer fence: the fence returns", round=1)
            _fenced(child, 1)
            first.recanary(ROWS)  # the writer is frozen: from here on, nothing may change
            child.resume()
            past_deadline(settings, child, images["b"], ROWS, 2, [first])
            _fenced(child, 2)
            images["b"].last = ROWS
            images["b"].recanary()
            child.resume()
            fenced = {name: images[name] for name in ("a", "b")}
            watch(
                settings,
                list(fenced.values()),
                f"writer fence: within {settings.late_write_watch_s:.1f} s, {LATE}",
            )
            if pending < SIZE // 4:
                figures["in_flight_inside_post"] = _in_flight_inside_post(child, images["c"])
            keep_for_the_run(regions, fenced, "regions a writer fenced", child)
            kept = True
        finally:
            if not kept:
                child.close()
    return figures


def _in_flight_inside_post(child: BareWriter, image: RegionImage) -> int:
    """Round 3: the writer frozen from outside :data:`FREEZE_AFTER_S` after
    its post began (its last round has no freeze of its own, so a stop is
    ours alone); how many bytes were still pending then."""
    image.land(3, ROWS)
    child.send_line()
    filled = child.expect(30, "writer fence: the third write is about to be posted", event="fill", round=3)
    time.sleep(max(0.0, float(filled["t"]) + FREEZE_AFTER_S - time.monotonic()))
    child.signal(signal.SIGSTOP)
    try:
        wait_for(child.stopped, 5, "writer fence: the writer froze inside its post")
        pending = image.differing()
    finally:
        child.resume()
    if pending < SIZE // 4:
        raise ConformanceFailure(
            f"writer fence: {SIZE - pending} of {SIZE} bytes had landed {FREEZE_AFTER_S * 1000:.0f} ms after "
            "the post began, and on_post returned with less than a quarter of them in flight: too little "
            "in flight to show that a fence stops a write, so this run proves nothing (a transport that "
            "lands every write this fast has nothing to fence: do not declare writer_fence)"
        )
    return pending


def past_deadline(
    settings: Settings,
    child: BareWriter,
    image: RegionImage,
    rows: list[list[int]],
    round_no: int,
    fenced: Sequence[RegionImage],
) -> None:
    """Round ``round_no``: frozen right after its post, resumed past its
    deadline, its barrier must tell the truth. ``fenced`` regions must not
    change meanwhile; if there are any, the round fences next."""
    child.frozen(30, "past deadline: write posted", round=round_no)
    time.sleep(settings.write_timeout_s + 0.1)
    for done in fenced:
        found = done.diff()
        if found:
            raise ConformanceFailure(f"writer fence: {LATE}: {found}")
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


#: How long the fence may take while its writer's host is cut off before the
#: link is healed anyway (a fence that waits for the peer returns after the
#: heal; what lands before it returned is its right).
FENCE_WHILE_CUT_S = 15.0
#: The writer's host sends at this rate (a tc token bucket), so that its
#: 32 MiB take about 3 s and the cut, :data:`CUT_AFTER_S` into the post,
#: catches the write with its connections open and bytes queued in them.
PARTITION_RATE = "100mbit"
CUT_AFTER_S = 0.5


def partition_fence_check(settings: Settings) -> dict[str, Any]:
    """``test_writer_fence_holds_across_a_partition``: the writer's host is
    cut off while its 32 MiB write is in flight, it fences during the cut,
    and the link heals; once a message from the writer's host has crossed
    the healed link (as the runtime's proof of the fence would, behind
    whatever was already on the wire), nothing lands. (A TCP connection
    closed with bytes still queued in the kernel, as when a fence destroys a
    transport's connections, is left to the kernel, which sends those bytes
    at its retransmission backoff once the link is back: the fence must
    reset its connections, not close them.)"""
    host = prefill_host(0)
    assert host is not None, "cross-host mode only"
    rounds = [round_of(ROWS, ["fill", "wait", "post", "wait", "fence", "freeze"], "a")]
    figures: dict[str, Any] = {}
    with open_regions(settings, {"a": SIZE}) as regions:
        image = RegionImage(regions["a"], SIZE)
        child = BareWriter(settings, metadata_of(regions), rounds, SIZE, host=host)
        kept = False
        try:
            child.expect(60, "partition fence: writer start", event="ready")
            child.expect(30, "partition fence: the write is ready", event="fill", round=1)
            image.land(1, ROWS)
            host.slow(PARTITION_RATE)
            try:
                child.send_line()
                child.expect(30, "partition fence: the write is posted", event="post", round=1)
                time.sleep(CUT_AFTER_S)
                host.cut()
                cut_at = time.monotonic()
                try:
                    figures["in_flight_at_cut"] = image.differing()
                    child.send_line()  # it fences now, the link still cut
                    try:
                        child.frozen(FENCE_WHILE_CUT_S, "partition fence: the fence returns", round=1)
                        figures["fenced_while_cut"] = True
                    except ConformanceFailure:
                        figures["fenced_while_cut"] = False
                finally:
                    host.heal()
                cut_s = time.monotonic() - cut_at
            finally:
                host.unslow()
            if not figures["fenced_while_cut"]:
                child.frozen(
                    limit_of(settings) + 30, "partition fence: the fence returns after the heal", round=1
                )
            _fenced(child, 1)
            # What the writer's host had sent before the fence may still be on
            # the wire (a link's queue holds it through the cut); the runtime's
            # proof of the fence crosses after it. So a message from that host
            # crosses the healed link first; then nothing may change.
            decode = decode_host()
            assert decode is not None
            round_trip_s(host, decode, rounds=3)
            image.recanary(ROWS)
            child.resume()
            # A kernel retransmits a queued segment at its backoff: within
            # about twice the time the link was down, after the heal.
            watch(
                settings,
                [image],
                f"writer fence across a partition ({figures['in_flight_at_cut'] / MiB:.1f} MiB in flight at the "
                f"cut, the link down {cut_s:.1f} s): {LATE}",
                at_least_s=2 * cut_s + 1.0,
            )
            keep_for_the_run(regions, {"a": image}, "a region whose writer fenced across a partition", child)
            kept = True
        finally:
            if not kept:
                child.close()
    return figures


def frozen_past_deadline(settings: Settings) -> None:
    """``test_done_barrier_past_deadline``: the past-deadline round alone."""
    with open_regions(settings, {"a": SIZE}) as regions:
        image = RegionImage(regions["a"], SIZE)
        rounds = [round_of(ROWS, ["post", "freeze", "barrier", "freeze"])]
        child = BareWriter(settings, metadata_of(regions), rounds, SIZE)
        try:
            child.expect(60, "past deadline: writer start", event="ready")
            past_deadline(settings, child, image, ROWS, 1, [])
        finally:
            child.close()


#: A write small enough to fit the kernel's socket buffers (16 pieces of
#: 4 KiB, scattered): a transport that calls it done once the kernel has it
#: answers LANDED with nothing delivered.
CUT_ROWS = [[MiB + i * 4096, (i * 7 % 16) * 65536, 4096] for i in range(16)]
CUT_BYTES = sum(n for _, _, n in CUT_ROWS)
#: The write before the cut, beside it, from other source bytes: if it is
#: still in flight when the cut write posts, none of its bytes can pass for
#: the cut write's.
WARM_ROWS = [[i * 4096, (i * 7 % 16) * 65536 + 32768, 4096] for i in range(16)]


def partition_landed_check(settings: Settings) -> dict[str, Any]:
    """``test_landed_across_a_partition_means_delivered``: after a first
    write over the link (its connections open), the writer's host is cut
    off and it posts 64 KiB; if its barrier answers LANDED, every byte is in
    decode's region already, though the link is still down. (A transport
    that counts a write done once the kernel took it would let a rank ack a
    chunk whose bytes are still queued, to land after decode reused the
    pages.)"""
    host = prefill_host(0)
    assert host is not None, "cross-host mode only"
    rounds = [
        round_of(WARM_ROWS, ["post", "barrier"], "a"),
        round_of(CUT_ROWS, ["fill", "wait", "post", "barrier", "freeze"], "a"),
    ]
    with open_regions(settings, {"a": SIZE}) as regions:
        image = RegionImage(regions["a"], SIZE)
        child = BareWriter(settings, metadata_of(regions), rounds, SIZE, host=host)
        try:
            child.expect(60, "partition LANDED: writer start", event="ready")
            first = child.expect(
                30 + limit_of(settings), "partition LANDED: the first write", event="barrier", round=1
            )
            child.expect(30, "partition LANDED: the second write is ready", event="fill", round=2)
            host.cut()
            try:
                child.send_line()
                settlement = child.settlement(settings, "partition LANDED: the barrier answers", 2)
                image.land(2, CUT_ROWS)
                missing = image.differing(CUT_ROWS) if settlement == LANDED else 0
            finally:
                host.heal()
        finally:
            child.close()
    if first.get("settlement") != LANDED:
        raise ConformanceFailure(
            f"partition LANDED: the first write, over a healthy link, answered {first.get('settlement')!r}, not "
            "LANDED: its connections may not be open, so the cut proves nothing"
        )
    if missing:
        raise ConformanceFailure(
            f"DONE barrier answered LANDED with the writer's host cut off and {missing} of {CUT_BYTES} "
            "bytes not in the region: the write was only handed to the kernel (an ack sent on it would race "
            "its bytes once the link is back)"
        )
    return {"first": first.get("settlement"), "settlement": settlement}
