"""The owner-fence check (``test_owner_fence_stops_frozen_writer``): a
writer frozen mid-write of 64 MiB, the region fencing as owner, the writer
resumed: not one byte lands after the fence; then writers connecting with
the new metadata land byte-exact."""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Mapping
from typing import Any

from kvconn.conformance import guard
from kvconn.conformance.harness import (
    Child,
    ConformanceFailure,
    Settings,
    decode_host,
    prefill_host,
    scattered_rows,
)
from kvconn.conformance.stakes import at_stake
from kvconn.conformance.writing import LANDED, BareWriter, healthy_write_timeout, limit_of, round_of
from kvconn.testing.waiting import wait_for

MiB = 1 << 20


def figures_line(figures: Mapping[str, Any]) -> str:
    """What the owner-fence check measured, in one line of the suite's summary."""
    return (
        f"fence {figures['fence_s'] * 1000:.0f} ms; {figures['landed_before_fence']} of {figures['posted']} "
        f"bytes landed before it; {figures['late_bytes']} bytes after it in {figures['watch_s']:.1f} s; "
        f"resumed writer's barrier: {figures['frozen_writer_settlement']}; "
        + ("writers on other hosts" if figures["cross_host"] else "one host")
    )


#: How long after its post starts the owner-fence check freezes the writer.
#: nixl's transfer() pushes most of a write over tcp before it returns: on
#: an idle 2-core machine, across hosts, 10-16 of the 64 MiB had landed 5 ms
#: in (37 at 10 ms, 52-57 at 20), all of it by the time transfer() returned.
OWNER_FENCE_FREEZE_AFTER_S = 0.003


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
    drive_s = watch_s + 5.0 + limit_of(settings)
    figures: dict[str, Any] = {"backend": settings.backend_name, "cross_host": decode_host() is not None}
    owner = Child(
        "kvconn.conformance.owner_fence_proc",
        {"backend": settings.backend_name, "options": settings.options_on(decode_host()), "nbytes": size},
        host=decode_host(),
    )
    writers: list[BareWriter] = []
    kept = False
    try:
        ready = owner.expect(60, "owner fence: the region opens", event="ready")
        old = bytes.fromhex(ready["metadata"])
        frozen = BareWriter(
            settings,
            {"a": old},
            [
                round_of([[0, 0, 4096]], ["post", "barrier", "freeze"]),  # connected before the big write
                round_of(rows, ["fill", "post", "barrier", "freeze"]),
                round_of(again, ["connect", "post", "barrier"]),
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
        # The clock starts as the post does (the fill of 64 MiB before it takes
        # longer than the write), not when on_post returns: nixl's transfer()
        # on an idle machine can move all of it before it returns.
        filled = frozen.expect(30, "owner fence: the writer is about to post", event="fill", round=2)
        # Frozen from outside, inside on_post or with its barrier driving the
        # transfer: bytes are on the wire, in socket buffers and in the
        # transport's queues. Timed from the fill's end (the post begins
        # there), not from when its report crossed the pipe.
        time.sleep(max(0.0, float(filled["t"]) + OWNER_FENCE_FREEZE_AFTER_S - time.monotonic()))
        frozen.signal(signal.SIGSTOP)
        wait_for(frozen.stopped, 5, "owner fence: the writer froze", poll=0.002)
        if any(e.get("event") == "barrier" and e.get("round") == 2 for e in frozen.history()):
            raise ConformanceFailure(
                f"owner fence: the 64 MiB write had settled {OWNER_FENCE_FREEZE_AFTER_S * 1000:.0f} ms after "
                "its post (the writer was not caught mid-write, so this run proves nothing)"
            )
        owner.send_line(json.dumps({"cmd": "fence"}))
        fenced = owner.expect(60 + limit_of(settings), "owner fence: owner_fence() returns", event="fenced")
        figures["fence_s"] = fenced["fence_s"]
        figures["landed_before_fence"] = fenced["landed_before"]
        figures["posted"] = size
        new = bytes.fromhex(fenced["metadata"])
        if new == old:
            raise ConformanceFailure("owner fence: owner_fence() returned the old metadata")
        at_stake(
            size - fenced["landed_before"],
            1,
            f"{(size - fenced['landed_before']) / MiB:.1f} of 64 MiB not landed when the owner fenced, the "
            "writer frozen mid-write",
            "bytes of the write still to land at the fence",
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
        frozen.frozen(drive_s + limit_of(settings) + 30, "owner fence: the resumed writer's barrier answers")
        figures["frozen_writer_settlement"] = frozen.answer("barrier", 2)["settlement"]
        # Another peer, on another host, connects with the new metadata.
        other = BareWriter(
            settings,
            {"a": new},
            [round_of(second, ["post", "barrier"])],
            size,
            write_timeout_s=healthy_write_timeout(settings),
            host=prefill_host(1),
        )
        writers.append(other)
        landed = other.expect(
            60 + healthy_write_timeout(settings), "owner fence: a new writer's barrier answers", event="barrier"
        )
        if landed["settlement"] != LANDED:
            raise ConformanceFailure(
                f"owner fence: a writer connecting with the new metadata settled {landed['settlement']!r}"
            )
        # The frozen writer re-bootstraps with the new metadata, as every peer must.
        frozen.send_line(new.hex())
        frozen.resume()
        rebooted = frozen.expect(
            60 + limit_of(settings), "owner fence: the old writer reconnects", event="barrier", round=3
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
        _keep_for_the_run(owner, writers, "a region fenced as owner, its writers alive")
        kept = True
    finally:
        if not kept:
            for writer in writers:
                writer.close()
            owner.close()
    return figures


def _keep_for_the_run(owner: Child, writers: list[BareWriter], what: str) -> None:
    """The owner's region, as it is now, and the writers of the check, alive,
    go to the run's guard: a write of before the fence that lands later, past
    the check's own watch, fails the run's last check."""
    owner.send_line(json.dumps({"cmd": "rebase"}))
    owner.expect(60, "owner fence: the region's contents become what it must hold", event="rebased")

    def diff() -> str:
        owner.send_line(json.dumps({"cmd": "watch", "seconds": 0}))
        watched = owner.expect(60, "owner fence: the guard compares the region", event="watched")
        return (
            f"{watched['changed']} bytes changed (the first at offset {watched['first']})"
            if watched["changed"]
            else ""
        )

    def close() -> None:
        for writer in writers:
            writer.close()
        owner.close()

    guard.GUARD.keep(what, diff, close)


def stale_writer_check(settings: Settings) -> dict[str, Any]:
    """The owner-fence check's second half, independent of catching a write
    mid-flight (``test_owner_fence_refuses_stale_writers``): a writer that
    connected before the fence posts a new write with the old metadata
    after it. Whatever its barrier answers, not one byte of the region
    changes."""
    size = 8 * MiB
    rows = scattered_rows(random.Random(0x57A1), 300, 9999, size, size)
    watch_s = settings.late_write_watch_s
    figures: dict[str, Any] = {}
    owner = Child(
        "kvconn.conformance.owner_fence_proc",
        {"backend": settings.backend_name, "options": settings.options_on(decode_host()), "nbytes": size},
        host=decode_host(),
    )
    writer: BareWriter | None = None
    kept = False
    try:
        ready = owner.expect(60, "stale writer: the region opens", event="ready")
        writer = BareWriter(
            settings,
            {"a": bytes.fromhex(ready["metadata"])},
            [
                round_of([[0, 0, 4096]], ["post", "barrier"]),  # connected before the fence
                round_of(rows, ["wait", "post", "barrier"]),
            ],
            size,
            write_timeout_s=max(settings.write_timeout_s, 5.0) + limit_of(settings),
            host=prefill_host(0),
        )
        writer.expect(60, "stale writer: writer start", event="ready")
        first = writer.expect(
            60 + limit_of(settings), "stale writer: a first write", event="barrier", round=1
        )
        if first["settlement"] != LANDED:
            raise ConformanceFailure(f"stale writer: a healthy 4 KiB write settled {first['settlement']!r}")
        owner.send_line(json.dumps({"cmd": "fence"}))
        owner.expect(60 + limit_of(settings), "stale writer: owner_fence() returns", event="fenced")
        writer.send_line()  # post with the metadata from before the fence
        answer = writer.expect(
            60 + 2 * limit_of(settings), "stale writer: the barrier answers", event="barrier", round=2
        )
        figures["settlement"] = answer["settlement"]
        owner.send_line(json.dumps({"cmd": "watch", "seconds": watch_s}))
        watched = owner.expect(watch_s + 60, "stale writer: the region is watched", event="watched")
        if watched["changed"]:
            raise ConformanceFailure(
                f"owner fence does not cut off old writers: one posting with the metadata from before "
                f"owner_fence() wrote {watched['changed']} bytes into the region (the first at offset "
                f"{watched['first']}; its barrier answered {answer['settlement']!r})"
            )
        stake = sum(n for _, _, n in rows)
        at_stake(
            stake,
            1,
            f"a writer that had landed a first write posted {stake / MiB:.1f} MiB with the old metadata after "
            f"the fence (its barrier answered {answer['settlement']})",
            "a write posted with the old metadata by a writer that reached the region",
        )
        _keep_for_the_run(owner, [writer], "a region fenced as owner, a stale writer alive")
        kept = True
    finally:
        if not kept:
            if writer is not None:
                writer.close()
            owner.close()
    return figures
