"""The fault matrix: faults that happen in production, each met in the same
run by kvconn's mode and by the timeout-only mode (the policy SGLang, vLLM
and TensorRT-LLM ship: acks off, pages freed at decode's deadline), on
loopback with real processes (``kvconn bench --faults``).

Each row is one fault in one mode, on fresh processes: two prefill ranks
(:mod:`kvconn.testing.faults`) and a decode process
(:mod:`kvconn.testing.matrix_decode`) whose client sends requests at a fixed
rate, whatever the fault, and checks every answer byte for byte. Both
modes meet each fault at the same moment (a barrier), on the same machine
load. Decode and the ranks run on two hosts (network namespaces) when they
can be made (root, iproute2); the partitions need them.

Per row, what safety costs and what liveness gives:

* ``corrupted``: pages a write reached after decode handed them back (found
  free with their canary changed, or in a later request's answer);
* ``hung``: requests that did not end within the fault's bound
  (:data:`BOUNDS`, stated in docs/reliability.md), and prefill halves (a
  rank's rooms) still unsettled past it (``hung_prefill``);
* ``answered`` (bytes verified), ``recomputed`` (answered by a retry after a
  failure with a reason), ``failed`` (with a reason, retry included);
* ``pinned_page_seconds``: pages decode held for aborted or failed rooms,
  integrated over the row;
* ``capacity_back_s``: the longest any page stayed held after a proof for
  it became possible (the fault cleared, or the room was aborted after
  that), until its release; None while pages are still held at the end;
* ``false_rank_downs``: ranks called down although they had been alive and
  reachable for the whole peer timeout and two heartbeats before.

How a row is run and each figure judged is :mod:`kvconn.testing.matrix_row`'s.

Interrupted (Ctrl-C, or a SIGTERM handler that raises), :func:`run` stops
both modes' threads, closes their processes (a frozen one is continued and
told to exit), stops the CPU hogs and removes the hosts, and re-raises,
within seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from kvconn.runtime.procs import all_threads_stopped, wait_until_stopped
from kvconn.testing import hosts
from kvconn.testing.hosts import Fabric, HostsUnavailable
from kvconn.testing.matrix_row import (
    BRIEF_S,
    CAPACITY_TARGET_S,
    CUT_PAGES,
    CUT_ROOM,
    DEADLINE_S,
    DECODE_FROZEN_S,
    FREEZE_ROOM,
    HEARTBEAT_S,
    LATE_ROOM,
    LATE_S,
    OVERLOAD_S,
    PAGES,
    PAST_S,
    PEER_S,
    RATE,
    SILENT_BOUND_S,
    STORM_ROOM,
    STORM_ROOMS,
    TAIL_S,
    UNWIND_S,
    WRITE_S,
    Hogs,
    Outcome,
    Row,
    Stop,
    Stopped,
    bootstrap_at_same_address,
    close_row,
    measure,
    start_decode,
    start_row,
)
from kvconn.testing.waiting import wait_for

__all__ = [
    "BOUNDS",
    "DEADLINE_S",
    "FAULTS",
    "HEARTBEAT_S",
    "MATRIX",
    "PEER_S",
    "RATE",
    "SHORT",
    "WRITE_S",
    "Fault",
    "Outcome",
    "Stopped",
    "misses",
    "run",
]


def _freeze_rank(seconds: float) -> Callable[[Row], None]:
    """Rank 0 stops itself half way through a chunk of a room (a GC pause, a
    frozen host), which decode aborts; continued ``seconds`` later."""

    def inject(row: Row) -> None:
        row.victim(FREEZE_ROOM, PAGES)
        pid = row.rank(0).proc.pid
        wait_for(row.stop.until(lambda: all_threads_stopped(pid)), 30, "rank 0 frozen mid-write", poll=0.001)
        t = row.abort(FREEZE_ROOM)
        row.stop.sleep(t + seconds - time.monotonic())
        row.rank(0).signal(signal.SIGCONT)
        row.proof_at = time.monotonic()
        row.windows.append((0, t, row.proof_at))

    return inject


def _late_queue(row: Row) -> None:
    """Half a chunk of rank 0 waits in the transport's queue and lands
    LATE_S after its post, past decode's deadline; decode aborts the room."""
    row.victim(LATE_ROOM, PAGES)
    wait_for(row.stop.until(lambda: row.landed(LATE_ROOM, rank=0) > 0), 30, "rank 0's first bytes")
    t = row.abort(LATE_ROOM)
    row.proof_at = t + LATE_S  # the queued half lands about now: the writer's fence can end
    row.stop.sleep(row.proof_at - time.monotonic())


def _kill_rank(restart: bool) -> Callable[[Row], None]:
    def inject(row: Row) -> None:
        rank = row.rank(0)
        t = time.monotonic()
        rank.signal(signal.SIGKILL)
        rank.proc.wait(10)
        row.proof_at = t  # its exit is a proof at once
        if not restart:
            row.windows.append((0, t, None))
            return
        row.cluster.restart_rank(0)  # at the same address
        row.windows.append((0, t, time.monotonic()))

    return inject


def _partition(seconds: float, room: bool) -> Callable[[Row], None]:
    """The ranks' host cut off (its bridge port down), healed ``seconds``
    later; with ``room``, a long room aborted right after the cut, whose
    writers go on writing it (loopback's data plane does not cross the link)."""

    def inject(row: Row) -> None:
        assert row.link is not None
        if room:
            row.victim(CUT_ROOM, CUT_PAGES)
            wait_for(row.stop.until(lambda: row.landed(CUT_ROOM) > 0), 30, "the room's first bytes")
        row.link.cut()
        row.cut = True
        t = time.monotonic()
        if room:
            row.abort(CUT_ROOM)
        row.stop.sleep(t + seconds - time.monotonic())
        row.link.heal()
        row.cut = False
        row.proof_at = time.monotonic()
        row.windows.append((None, t, row.proof_at))

    return inject


def _lost(row: Row) -> None:
    """The ranks' host cut off, then every process on it killed (no FIN or
    RST reaches decode); on one machine their exit is still a proof."""
    assert row.link is not None and row.fabric is not None
    row.link.cut()
    row.cut = True
    t = time.monotonic()
    row.stop.sleep(BRIEF_S)
    row.proof_at = time.monotonic()
    hosts.kill_all_in(row.link.netns)
    row.windows.append((None, t, None))


def _freeze_decode(row: Row) -> None:
    pid = row.decode.proc.pid
    t = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    wait_until_stopped(pid)
    row.stop.sleep(t + DECODE_FROZEN_S - time.monotonic())
    os.kill(pid, signal.SIGCONT)
    row.proof_at = time.monotonic()


def _kill_decode(restart: bool) -> Callable[[Row], None]:
    def inject(row: Row) -> None:
        old = row.decode
        old.kill_now()
        row.capacity_note = "n/a: decode's pages died with it"
        if restart:
            port = int(old.address.rsplit(":", 1)[1])
            # Its rooms numbered apart: a rank may still hold the killed one's.
            row.decodes.append(start_decode(row.mode, row.fabric, row.stop, port, first_room=2 << 20))
            bootstrap_at_same_address(row, port)
            row.start_client(TAIL_S)

    return inject


def _overload(row: Row) -> None:
    """No fault at all: the machine's CPUs busy with hogs (10 per core), and
    every rank and decode busy in Python (an engine's step loop, taking the
    GIL from kvconn's threads)."""
    for rank in row.cluster.ranks:
        rank.send_line(f"busy {OVERLOAD_S}")
    row.decode.send_json({"op": "busy", "seconds": OVERLOAD_S})
    row.hogs.on()
    try:
        row.stop.sleep(OVERLOAD_S)
    finally:
        row.hogs.off()
    row.proof_at = time.monotonic()


def _abort_storm(row: Row) -> None:
    """Many rooms opened at once, aborted together mid-transfer."""
    done = row.decode.ask("storm", 60, op="storm", first=STORM_ROOM, rooms=STORM_ROOMS, pages=PAGES)
    row.proof_at = float(done["t"])  # every writer lives: acks can prove them at once


@attrs.frozen
class Fault:
    inject: Callable[[Row], None]
    #: How long it lasts: the row's users arrive for WARM_S + span_s + TAIL_S.
    span_s: float
    #: A request not ended this long after its arrival has hung
    #: (docs/reliability.md states each).
    bound_s: float = SILENT_BOUND_S
    needs_hosts: bool = False  #: it cuts a link


#: The matrix, in the order it runs.
MATRIX: dict[str, Fault] = {
    "frozen_brief": Fault(_freeze_rank(BRIEF_S), BRIEF_S),
    "frozen_past_peer": Fault(_freeze_rank(PEER_S + PAST_S), PEER_S + PAST_S),
    "frozen": Fault(_freeze_rank(DEADLINE_S + PAST_S), DEADLINE_S + PAST_S),
    "late_queue": Fault(_late_queue, LATE_S),
    "killed": Fault(_kill_rank(restart=False), 0.0),
    "restarted": Fault(_kill_rank(restart=True), 1.0),
    "partition_brief": Fault(_partition(BRIEF_S, room=False), BRIEF_S, needs_hosts=True),
    "partition": Fault(_partition(DEADLINE_S + PAST_S, room=True), DEADLINE_S + PAST_S, needs_hosts=True),
    "lost": Fault(_lost, BRIEF_S, needs_hosts=True),
    # Its users' requests wait with it: the freeze, then the usual bound.
    "decode_frozen": Fault(_freeze_decode, DECODE_FROZEN_S, DECODE_FROZEN_S + SILENT_BOUND_S),
    "decode_killed": Fault(_kill_decode(restart=False), 0.0),
    "decode_restarted": Fault(_kill_decode(restart=True), 0.0),
    # A machine this busy serves slower: its users wait through it, then the usual bound.
    "overload": Fault(_overload, OVERLOAD_S, OVERLOAD_S + SILENT_BOUND_S),
    "abort_storm": Fault(_abort_storm, 0.5),
}
FAULTS = tuple(MATRIX)
#: The bound on each fault's requests, from their arrival.
BOUNDS = {name: fault.bound_s for name, fault in MATRIX.items()}
#: The selection ``kvconn bench --faults short`` (and CI) runs: the whole
#: matrix is ``--faults long``.
SHORT = ("frozen", "late_queue", "partition", "killed", "restarted", "overload")


# -- running rows ----------------------------------------------------------------------
def run(faults: Sequence[str] = SHORT, on_step: Callable[[str], None] = print) -> list[Outcome]:
    """Every fault of ``faults`` in both modes (side by side, on two threads
    that meet at each row)."""
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}: choose from {', '.join(FAULTS)}")
    results: dict[str, list[Outcome]] = {}
    stop, hogs = Stop(), Hogs()
    stop.opened(hogs)

    def one(mode: str) -> None:
        try:
            results[mode] = _mode(mode, faults, on_step, stop, hogs)
        except BaseException:
            stop.barrier.abort()  # the other thread must not wait for this one
            if not stop.event.is_set():  # else it failed because its processes were closed under it
                raise

    # Daemons: an interrupted run returns once its processes are closed and
    # its hosts gone (below), never waiting on a thread that has not noticed.
    threads = [threading.Thread(target=one, args=(m,), name=m, daemon=True) for m in ("kvconn", "legacy")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException:
        stop.stop()
        deadline = time.monotonic() + UNWIND_S
        for t in threads:  # each leaves its hosts on the way out
            t.join(max(0.0, deadline - time.monotonic()))
        raise
    finally:
        hogs.close()
    missing = [m for m in ("kvconn", "legacy") if m not in results]
    if missing:
        raise RuntimeError(f"the fault run of {', '.join(missing)} failed (its error is above)")
    legacy = {o.fault: o for o in results["legacy"]}
    return [attrs.evolve(o, misses=misses(o, legacy.get(o.fault))) for o in results["kvconn"]] + results[
        "legacy"
    ]


def misses(k: Outcome, legacy: Outcome | None) -> tuple[str, ...]:
    """The done-when targets kvconn's row ``k`` missed."""
    if k.skipped:
        return ()
    if k.error:
        return (f"did not complete: {k.error}",)
    out = []
    if k.corrupted:
        out.append(f"{k.corrupted} pages corrupted")
    if k.hung:
        out.append(f"{k.hung} hung ({k.hung_prefill} at prefill)" if k.hung_prefill else f"{k.hung} hung")
    if k.false_rank_downs:
        out.append(f"{k.false_rank_downs} false rank-downs")
    if k.capacity_back_s is None and not k.capacity_note.startswith("n/a"):
        out.append(f"pages {k.capacity_note}")
    elif k.capacity_back_s is not None and k.capacity_back_s > CAPACITY_TARGET_S:
        out.append(f"pages back after {k.capacity_back_s:.2f} s (> {CAPACITY_TARGET_S:g} s)")
    if legacy is not None and legacy.requests and not legacy.error:
        # Both modes' users arrive at one rate, over windows a few arrivals apart.
        expected = legacy.answered * k.requests / legacy.requests
        if k.answered < expected - 1:
            out.append(
                f"answered {k.answered} of {k.requests} < timeout-only's {legacy.answered} of {legacy.requests}"
            )
    return tuple(out)


def _mode(
    mode: str, faults: Sequence[str], on_step: Callable[[str], None], stop: Stop, hogs: Hogs
) -> list[Outcome]:
    """Every row of one mode, on its own two hosts when they can be made."""
    with contextlib.ExitStack() as stack:
        fabric: Fabric | None = None
        why = ""
        try:
            stop.check()
            fabric = stack.enter_context(hosts.hosts(("decode", "prefill0")))
        except HostsUnavailable as exc:
            why = str(exc)
        out = []
        for fault in faults:
            stop.check()
            on_step(f"{mode}: {fault}")
            if MATRIX[fault].needs_hosts and fabric is None:
                out.append(Outcome(fault, mode, BOUNDS[fault], skipped=why))
                continue
            out.append(_row(fault, mode, fabric, stop, hogs))
        return out


def _row(fault: str, mode: str, fabric: Fabric | None, stop: Stop, hogs: Hogs) -> Outcome:
    row: Row | None = None
    error = ""
    try:
        row = start_row(fault, mode, MATRIX[fault].bound_s, fabric, stop, hogs)
    except (Stopped, KeyboardInterrupt):
        raise
    except Exception as exc:
        error = f"did not start: {type(exc).__name__}: {exc}"
    try:
        stop.meet()  # both modes meet the fault together, started or not
        if row is None:
            return Outcome(fault, mode, BOUNDS[fault], error=error)
        try:
            return measure(row, MATRIX[fault].inject, MATRIX[fault].span_s)
        except (Stopped, KeyboardInterrupt):
            raise
        except Exception as exc:
            return Outcome(fault, mode, BOUNDS[fault], error=f"{type(exc).__name__}: {exc}")
    finally:
        if row is not None:
            close_row(row)
