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
from kvconn.conformance.stakes import at_stake
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
from kvconn.testing.hosts import Host, round_trip_s, tcp_queues_to

MiB = 1 << 20
SIZE = 32 * MiB
ROWS = [[i * MiB, (i * 7 % 32) * MiB, MiB] for i in range(32)]
#: How long into its post a writer whose ``on_post`` landed (nearly) all of
#: it is frozen from outside, to show that the write was in flight there:
#: a transport that lands 24 MiB within it has nothing for a fence to stop.
FREEZE_AFTER_S = 0.002
#: How many posts the writer is frozen inside, until one has a quarter still
#: pending: on a loaded machine the stop itself may come late (loopback, beside
#: two CPU hogs, had copied all 32 MiB by then in one try).
INSIDE_TRIES = 5
LATE = "bytes landed after on_fence returned True (the fence does not stop a resumed writer)"


def _fenced(child: BareWriter, round_no: int) -> None:
    fenced = child.answer("fence", round_no)["fenced"]
    if fenced is not True:
        raise ConformanceFailure(
            f"writer fence: the backend declares writer_fence but on_fence answered {fenced!r}"
        )


#: The first fence's writes: ROWS in :data:`MANY` writes of 4 MiB, posted back
#: to back to two peers (regions ``a`` and ``d``), none waited for: on a
#: transport that queues them, all but the first are queued, not yet on the
#: wire, when it fences.
MANY = 8
MANY_ROUNDS = [(("a", "d")[k % 2], ROWS[k * 4 : k * 4 + 4]) for k in range(MANY)]


def figures_line(figures: dict[str, Any]) -> str:
    """What the writer-fence check measured, for the suite's summary."""
    line = (
        f"{figures['writes_at_fence']} of {MANY} writes to 2 peers, {figures['in_flight_at_fence'] / MiB:.1f} of "
        f"32 MiB, in flight at the first fence; {figures['past_deadline'] / MiB:.1f} MiB at the second"
    )
    if "in_flight_inside_post" in figures:
        line += (
            f" (on_post lands its write before it returns: {figures['in_flight_inside_post'] / MiB:.1f} "
            f"MiB still pending {FREEZE_AFTER_S * 1000:.0f} ms into it)"
        )
    return line


def writer_fence_check(settings: Settings) -> dict[str, Any]:
    """Two fences: one right after :data:`MANY` writes to two peers were
    posted, one after a barrier past its deadline; nothing lands after
    either (see the test's docstring)."""
    # Every source filled first, so that the posts follow each other at once.
    rounds = [
        round_of(rows, ["fill_all", "post"] if k == 0 else ["post"], peer)
        for k, (peer, rows) in enumerate(MANY_ROUNDS[:-1])
    ]
    rounds.append(round_of(MANY_ROUNDS[-1][1], ["post", "freeze", "fence", "freeze"], MANY_ROUNDS[-1][0]))
    fence_round = len(rounds)
    deadline_round, inside_round = fence_round + 1, fence_round + 2
    rounds += [
        round_of(ROWS, ["fill", "post", "freeze", "barrier", "freeze", "fence", "freeze"], "b"),
    ]
    # Only if the posts left too little in flight: frozen from outside inside on_post.
    rounds += [round_of(ROWS, ["wait", "fill", "post", "barrier"], "c") for _ in range(INSIDE_TRIES)]
    figures: dict[str, Any] = {}
    with open_regions(settings, {"a": SIZE, "d": SIZE, "b": SIZE, "c": SIZE}) as regions:
        images = {name: RegionImage(region, SIZE) for name, region in regions.items()}
        child = BareWriter(settings, metadata_of(regions), rounds, SIZE)
        kept = False
        try:
            child.expect(60, "writer fence: writer start", event="ready")
            child.frozen(30, "writer fence: the writes are posted", round=fence_round)
            pending_each = []
            for k, (peer, rows) in enumerate(MANY_ROUNDS, start=1):
                images[peer].land(k, rows)
                pending_each.append(images[peer].differing(rows))
            pending = figures["in_flight_at_fence"] = sum(pending_each)
            writes = figures["writes_at_fence"] = sum(1 for n in pending_each if n)
            child.resume()  # its next step is the fence, with those bytes in flight
            child.frozen(limit_of(settings) + 30, "writer fence: the fence returns", round=fence_round)
            _fenced(child, fence_round)
            for peer in ("a", "d"):
                images[peer].recanary()  # the writer is frozen: from here on, nothing may change
            child.resume()
            fenced_first = [images["a"], images["d"]]
            figures["past_deadline"] = past_deadline(
                settings, child, images["b"], ROWS, deadline_round, fenced_first
            )
            _fenced(child, deadline_round)
            images["b"].last = ROWS
            images["b"].recanary()
            child.resume()
            fenced = {name: images[name] for name in ("a", "d", "b")}
            watch(
                settings,
                list(fenced.values()),
                f"writer fence: within {settings.late_write_watch_s:.1f} s, {LATE}",
            )
            if pending < SIZE // 4:
                figures["in_flight_inside_post"] = _in_flight_inside_post(
                    settings, child, images["c"], inside_round
                )
            else:
                at_stake(
                    writes,
                    2,
                    f"{writes} of {MANY} writes to 2 peers ({pending / MiB:.1f} of 32 MiB) in flight at the "
                    f"first fence; {figures['past_deadline'] / MiB:.1f} MiB at the second",
                    "two writes at least in flight at a fence (a fence honest with one proves nothing of more)",
                )
            keep_for_the_run(regions, fenced, "regions a writer fenced", child)
            kept = True
        finally:
            if not kept:
                child.close()
    return figures


def _in_flight_inside_post(
    settings: Settings, child: BareWriter, image: RegionImage, first_round: int
) -> int:
    """The last rounds: the writer frozen from outside :data:`FREEZE_AFTER_S`
    after its post began (the rounds have no freeze of their own, so a stop
    is ours alone), up to :data:`INSIDE_TRIES` posts until a quarter was
    still pending; the most bytes still pending then."""
    pending = 0
    for round_no in range(first_round, first_round + INSIDE_TRIES):
        image.land(round_no, ROWS)
        child.send_line()
        filled = child.expect(
            30, "writer fence: a last write is about to be posted", event="fill", round=round_no
        )
        try:
            child.stop_at(
                float(filled["t"]) + FREEZE_AFTER_S, "writer fence: the writer froze inside its post"
            )
            pending = max(pending, image.differing())
        finally:
            child.resume()
        if pending >= SIZE // 4:
            break
        answered = child.expect(
            limit_of(settings) + 60, "writer fence: its barrier answers", event="barrier", round=round_no
        )
        if answered["settlement"] != LANDED:
            break  # its bytes may still land: the next try's would be miscounted
    at_stake(
        pending,
        SIZE // 4,
        f"on_post lands its writes before it returns (less than a quarter of 32 MiB in flight at the "
        f"fences), and {pending / MiB:.1f} MiB were still pending {FREEZE_AFTER_S * 1000:.0f} ms into a post "
        f"(the most in up to {INSIDE_TRIES} posts)",
        "a quarter of the write in flight inside on_post at least (a transport that lands every write this "
        "fast has nothing to fence: do not declare writer_fence)",
    )
    return pending


def past_deadline(
    settings: Settings,
    child: BareWriter,
    image: RegionImage,
    rows: list[list[int]],
    round_no: int,
    fenced: Sequence[RegionImage],
) -> int:
    """Round ``round_no``: frozen right after its post, resumed past its
    deadline, its barrier must tell the truth. ``fenced`` regions must not
    change meanwhile; if there are any, the round fences next. How many
    bytes were still to land when the writer froze (what the barrier past
    its deadline had at stake)."""
    child.frozen(30, "past deadline: write posted", round=round_no)
    image.land(round_no, rows)
    pending = image.differing(rows)
    time.sleep(settings.write_timeout_s + 0.1)
    for done in fenced:
        found = done.diff()
        if found:
            raise ConformanceFailure(f"writer fence: {LATE}: {found}")
    child.resume()
    settlement = child.settlement(settings, "past deadline: the barrier answers", round_no)
    if settlement == LANDED:
        found = image.diff()
        if found:
            raise ConformanceFailure(
                f"DONE barrier answered LANDED past its deadline while bytes were still in flight: {found}"
            )
    if fenced:
        child.resume()
        child.frozen(limit_of(settings) + 30, "writer fence: the fence returns", round=round_no)
    return pending


#: How long the fence may take while its writer's host is cut off before the
#: link is healed anyway (a fence that waits for the peer returns after the
#: heal; what lands before it returned is its right).
FENCE_WHILE_CUT_S = 15.0
#: The writer's host sends at this rate (a tc token bucket), so that its
#: 32 MiB take about 3 s and the cut, :data:`CUT_AFTER_S` into the post,
#: catches the write with its connections open and bytes queued in them.
PARTITION_RATE = "100mbit"
CUT_AFTER_S = 0.5
#: Bytes a fence may leave queued on connections no process holds: an honest
#: nixl fence across hosts left a few (under 0.005 MiB: a closing message, not
#: a write) once in CI; the closing_fence lie left 1.58 MiB.
ORPHANED_LIMIT = 64 * 1024


#: How long, at most, the watch after the heal waits for the writer's host to
#: have nothing more queued towards decode (what its kernel still sends there
#: crosses once the link is back, at its retransmission backoff).
DRAIN_WAIT_S = 60.0


def partition_fence_check(settings: Settings) -> dict[str, Any]:
    """``test_writer_fence_holds_across_a_partition``: the writer's host is
    cut off :data:`CUT_AFTER_S` into its 32 MiB post; once ``on_post``
    returned, with the link still cut, it fences; the link heals; once a
    message from the writer's host has crossed the healed link (as the
    runtime's proof of the fence would, behind whatever was already on the
    wire), nothing lands, watched until the writer's host has nothing left
    queued towards decode. (A TCP connection closed with bytes still queued
    in the kernel, as when a fence destroys a transport's connections, is
    left to the kernel, which sends those bytes at its retransmission
    backoff once the link is back: the fence must reset its connections,
    not close them.)

    At stake: the bytes not yet in decode's region when the fence was
    asked, during the cut (nothing crosses a cut link, so they are still to
    come); a run where ``on_post`` returned only after the heal, or where
    nothing was left in flight, fails for proving nothing."""
    host = prefill_host(0)
    decode = decode_host()
    assert host is not None and decode is not None, "cross-host mode only"
    rounds = [round_of(ROWS, ["fill", "wait", "post", "wait", "fence", "freeze"], "a")]
    figures: dict[str, Any] = {"in_flight_at_fence": 0, "fenced_while_cut": False, "queued_at_fence": 0}
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
                # Timed from the post's start, not its return: a post that
                # waits for its bytes to cross is cut mid-way all the same.
                child.expect(30, "partition fence: the write is being posted", event="wait", round=1)
                time.sleep(CUT_AFTER_S)
                host.cut()
                cut_at = time.monotonic()
                try:
                    figures["in_flight_at_cut"] = image.differing()
                    figures["posted_while_cut"] = _posted_within(child, FENCE_WHILE_CUT_S)
                    if figures["posted_while_cut"]:
                        # The link is down: what is not in the region now was in flight at the fence.
                        figures["in_flight_at_fence"] = image.differing()
                        child.send_line()  # it fences now, the link still cut
                        try:
                            child.frozen(FENCE_WHILE_CUT_S, "partition fence: the fence returns", round=1)
                            figures["fenced_while_cut"] = True
                            queues = tcp_queues_to(host, decode.ip)
                            figures["queued_at_fence"] = sum(q.unsent for q in queues)
                            # Closed, not reset: the kernel alone holds them, and sends them once the link heals.
                            figures["orphaned_at_fence"] = sum(q.unsent for q in queues if not q.owned)
                        except ConformanceFailure:
                            pass
                finally:
                    host.heal()
                cut_s = time.monotonic() - cut_at
            finally:
                host.unslow()
            if not figures["posted_while_cut"]:
                child.expect(
                    limit_of(settings) + 30, "partition fence: on_post returns after the heal", event="post"
                )
                child.send_line()
            if not figures["fenced_while_cut"]:
                child.frozen(
                    limit_of(settings) + 30, "partition fence: the fence returns after the heal", round=1
                )
            _fenced(child, 1)
            at_stake(
                figures["in_flight_at_fence"],
                SIZE // 8,
                _partition_stake(figures),
                "an eighth of the write at least still to cross when the fence was asked, the link cut",
            )
            orphaned = figures.get("orphaned_at_fence", 0)
            if orphaned >= ORPHANED_LIMIT:
                # Whether they land in the watch depends on the peer's side
                # (and on load): their being on the way at all is the failure.
                raise ConformanceFailure(
                    f"writer fence across a partition: {orphaned / MiB:.2f} MiB still queued towards decode "
                    "after on_fence returned True, on connections no process holds (closed, not reset: the "
                    "kernel sends them once the link heals)"
                )
            # What the writer's host had sent before the fence may still be on
            # the wire (a link's queue holds it through the cut); the runtime's
            # proof of the fence crosses after it. So a message from that host
            # crosses the healed link first; then nothing may change.
            round_trip_s(host, decode, rounds=3)
            image.recanary(ROWS)
            child.resume()
            what = (
                f"writer fence across a partition: {LATE} ({figures['in_flight_at_fence'] / MiB:.1f} MiB in flight "
                f"at the fence, {figures.get('orphaned_at_fence', 0) / MiB:.2f} MiB then queued in the writer host's "
                f"kernel on connections no process holds, the link down {cut_s:.1f} s)"
            )
            # A kernel retransmits a queued segment at its backoff: within
            # about twice the time the link was down, after the heal; and
            # the watch goes on while the writer's host still has bytes
            # queued towards decode.
            figures["drained_s"] = _watch_until_drained(settings, image, host, decode, what, 2 * cut_s + 1.0)
            keep_for_the_run(regions, {"a": image}, "a region whose writer fenced across a partition", child)
            kept = True
        finally:
            if not kept:
                child.close()
    return figures


def _posted_within(child: BareWriter, seconds: float) -> bool:
    try:
        child.expect(seconds, "partition fence: on_post returns", event="post", round=1)
    except ConformanceFailure:
        return False
    return True


def _partition_stake(figures: dict[str, Any]) -> str:
    if not figures["posted_while_cut"]:
        return (
            f"{figures['in_flight_at_cut'] / MiB:.1f} of 32 MiB in flight at the cut, but on_post returned only "
            "after the heal, so no fence could be asked during the cut"
        )
    return (
        f"{figures['in_flight_at_fence'] / MiB:.1f} of 32 MiB still to cross when the fence was asked during the "
        f"cut ({figures['in_flight_at_cut'] / MiB:.1f} at the cut); "
        + (
            f"fenced during the cut, {figures['queued_at_fence'] / MiB:.2f} MiB queued in the writer host's "
            f"kernel towards decode then ({figures.get('orphaned_at_fence', 0) / MiB:.2f} MiB on connections "
            "no process holds)"
            if figures["fenced_while_cut"]
            else "the fence returned only after the heal"
        )
    )


def partition_figures(figures: dict[str, Any]) -> str:
    """The partition fence check's summary figures."""
    return f"watched until the writer's host had nothing queued towards decode: {figures['drained_s']:.1f} s"


def _watch_until_drained(
    settings: Settings, image: RegionImage, host: Host, decode: Host, what: str, at_least_s: float
) -> float:
    """Watch ``image`` at least ``at_least_s`` (and the late-write window),
    and on while ``host`` still has bytes queued towards ``decode`` (up to
    :data:`DRAIN_WAIT_S`): what its kernel holds crosses at its own pace.
    How long the watch took."""
    started = time.monotonic()
    watch(settings, [image], what, at_least_s=at_least_s)
    while sum(q.unsent for q in tcp_queues_to(host, decode.ip)) and time.monotonic() - started < DRAIN_WAIT_S:
        watch(settings, [image], what, at_least_s=0.5)
    watch(settings, [image], what, at_least_s=1.0)  # the last bytes out of the kernel, applied
    return time.monotonic() - started


def frozen_past_deadline(settings: Settings) -> None:
    """``test_done_barrier_past_deadline``: the past-deadline round alone. If
    ``on_post`` had landed the whole write before it returned (nixl over
    cma: a copy in the calling thread), nothing was in flight past the
    deadline; the writer is then frozen from outside :data:`FREEZE_AFTER_S`
    into a second post instead, held past its deadline there, and its
    barrier asked once it returns: what was still to land inside ``on_post``
    is what was at stake."""
    with open_regions(settings, {"a": SIZE, "c": SIZE}) as regions:
        images = {name: RegionImage(region, SIZE) for name, region in regions.items()}
        rounds = [
            round_of(ROWS, ["post", "freeze", "barrier", "freeze"], "a"),
            round_of(ROWS, ["wait", "fill", "post", "barrier", "freeze"], "c"),
        ]
        child = BareWriter(settings, metadata_of(regions), rounds, SIZE)
        try:
            child.expect(60, "past deadline: writer start", event="ready")
            pending = past_deadline(settings, child, images["a"], ROWS, 1, [])
            said = (
                f"{pending / MiB:.1f} of 32 MiB still to land when the writer froze, asked past its deadline"
            )
            if not pending:
                child.resume()
                pending = _past_deadline_inside_post(settings, child, images["c"], 2)
                said = (
                    f"on_post lands its write before it returns; {pending / MiB:.1f} of 32 MiB still to land "
                    f"{FREEZE_AFTER_S * 1000:.0f} ms into a post frozen past its deadline"
                )
            at_stake(pending, 1, said, "bytes in flight when the deadline passed")
        finally:
            child.close()


def _past_deadline_inside_post(
    settings: Settings, child: BareWriter, image: RegionImage, round_no: int
) -> int:
    """Round ``round_no`` frozen from outside inside its post, held past its
    deadline, resumed: its barrier tells the truth. How many bytes were
    still to land at the freeze."""
    image.land(round_no, ROWS)
    child.send_line()
    filled = child.expect(30, "past deadline: the write is about to be posted", event="fill", round=round_no)
    time.sleep(max(0.0, float(filled["t"]) + FREEZE_AFTER_S - time.monotonic()))
    child.signal(signal.SIGSTOP)
    try:
        wait_for(child.stopped, 5, "past deadline: the writer froze inside its post")
        pending = image.differing()
        time.sleep(settings.write_timeout_s + 0.1)
    finally:
        child.resume()
    settlement = child.settlement(settings, "past deadline: the barrier answers", round_no)
    if settlement == LANDED:
        found = image.diff()
        if found:
            raise ConformanceFailure(
                f"DONE barrier answered LANDED past its deadline while bytes were still in flight: {found}"
            )
    return pending


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
                # Nothing crosses a cut link: all of it is still to come, unless it went another way.
                missing = image.differing(CUT_ROWS)
            finally:
                host.heal()
        finally:
            child.close()
    if first.get("settlement") != LANDED:
        raise ConformanceFailure(
            f"partition LANDED: the first write, over a healthy link, answered {first.get('settlement')!r}, not "
            "LANDED: its connections may not be open, so the cut proves nothing"
        )
    if settlement == LANDED and missing:
        raise ConformanceFailure(
            f"DONE barrier answered LANDED with the writer's host cut off and {missing} of {CUT_BYTES} "
            "bytes not in the region: the write was only handed to the kernel (an ack sent on it would race "
            "its bytes once the link is back)"
        )
    at_stake(
        missing,
        CUT_BYTES,
        f"{missing} of {CUT_BYTES} bytes of a write posted with the link cut not in decode's region when its "
        f"barrier answered {settlement}",
        "every byte of it still to cross (a write that reached the region with the link cut does not cross "
        "the network at all)",
    )
    return {"first": first.get("settlement"), "settlement": settlement}
