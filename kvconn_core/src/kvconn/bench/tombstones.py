"""Tombstones at abort-storm scale, in the pure ledger (issue 35, goal 7).

``python -m kvconn.bench.tombstones [--rooms N] [--json FILE]``

An abort storm leaves one tombstone per room id a rank never heard of (its
ABORT came before its request, or instead of it). Each must refuse that
request until the TTL, so a rank holds ``aborts/s x TTL`` of them; and the
thread that forgets them is the one that handles control messages. This
drives :class:`~kvconn.protocol.ledger.RoomLedger` alone (no sockets, a
simulated clock) and prints, against the goals:

* bytes per tombstone (tracemalloc, after ``abort`` then ``try_ack`` for
  every room id);
* microseconds per ``abort`` + ``try_ack`` (timed without tracemalloc);
* the worst single ``expire()`` call: right after the storm, and every call
  while the tombstones fall due (called as the listener calls it, once per
  poll, :data:`POLL_S` apart in simulated time);
* the memory still allocated once every tombstone expired.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from typing import Any

from kvconn.bench.output import write_json
from kvconn.protocol.ledger import RoomKey, RoomLedger
from kvconn.protocol.messages import Abort

#: The listener's idle poll: expire() runs at least this often (runtime/control.py).
POLL_S = 0.05
TTL_S = 600.0

#: CPU microseconds of the calibration loop on an idle recent x86 core (CPython 3.11).
NOMINAL_CALIBRATION_US = 8.0


def _storm(ledger: RoomLedger, rooms: int, decodes: list[str], rate: float, t0: float) -> float:
    """``rooms`` ABORTs of unknown rooms, ``rate`` per simulated second, each
    followed by its try_ack (as the rank's listener handles one); returns the
    simulated time of the last one."""
    now = t0
    step = 1.0 / rate
    n = len(decodes)
    for room in range(rooms):
        decode = decodes[room % n]
        now = t0 + room * step
        # The message is built here, as the wire decoder would: what the
        # ledger keeps of it is counted.
        ledger.abort(Abort(room, room + 1, decode, "tcp://127.0.0.1:5999"), now)
        ledger.try_ack(RoomKey(decode, room))
    return now


def _drain(ledger: RoomLedger, start: float, rooms: int) -> tuple[float, float, int, float]:
    """Call expire() every POLL_S from ``start`` (when every tombstone is due)
    until ``rooms`` are forgotten: returns the worst single call (s), the
    median, the calls made, and how long after ``start`` the last was
    forgotten."""
    times: list[float] = []
    calls = forgotten = 0
    now = start
    while forgotten < rooms:
        if calls > rooms + 100:
            raise AssertionError(f"{rooms - forgotten} tombstones never forgotten")
        t = _clock()
        forgotten += len(ledger.expire(now))
        times.append(_clock() - t)
        calls += 1
        now += POLL_S
    times.sort()
    return times[-1], times[len(times) // 2], calls, now - POLL_S - start


#: CPU time of this thread: on a shared machine wall time would time the
#: other processes too.
_clock = time.thread_time


def _loop_only(rooms: int, decodes: list[str]) -> float:
    """The storm's loop without the ledger (building each ABORT and key)."""
    n = len(decodes)
    t = _clock()
    for room in range(rooms):
        decode = decodes[room % n]
        Abort(room, room + 1, decode, "tcp://127.0.0.1:5999")
        RoomKey(decode, room)
    return _clock() - t


def calibrate() -> float:
    """CPU microseconds of ``sum(range(1000))`` here (about 8 on an idle
    2020s x86 core): the scale of every time this prints."""
    best = float("inf")
    for _ in range(5):
        t = _clock()
        for _ in range(100):
            sum(range(1000))
        best = min(best, (_clock() - t) / 100)
    return best * 1e6


def measure(
    rooms: int = 100_000, decodes: int = 8, rate: float = 20_000.0, ttl: float = TTL_S
) -> dict[str, Any]:
    names = [f"decode-{i}" for i in range(decodes)]
    calibration = calibrate()

    # Time, without tracemalloc (it slows every allocation several times),
    # and without the collector (its passes cost what the whole heap holds).
    gc.collect()
    gc.disable()
    try:
        loop = _loop_only(rooms, names)
        ledger = RoomLedger(0, ttl)
        t = _clock()
        end = _storm(ledger, rooms, names, rate, 0.0)
        us_per_abort = (_clock() - t - loop) / rooms * 1e6
        # The first expire() after the storm: nothing is due yet.
        t = _clock()
        assert not ledger.expire(end), "a tombstone was forgotten before its TTL"
        first_expire = _clock() - t
        # Nothing due until the TTL: the listener's polls in between find nothing.
        worst_between = 0.0
        for now in (end + 1.0, ttl / 2, ttl - 1e-3):
            t = _clock()
            assert not ledger.expire(now), "a tombstone was forgotten before its TTL"
            worst_between = max(worst_between, _clock() - t)
        # The worst case: the first poll once every tombstone is due (a burst
        # storm, or a listener busy for a while), then polls until all are gone.
        worst, median, calls, late = _drain(ledger, end + ttl, rooms)
        del ledger
    finally:
        gc.enable()

    # What the collector must walk on every full pass, per tombstone.
    gc.collect()
    objects = len(gc.get_objects())
    ledger = RoomLedger(0, ttl)
    _storm(ledger, rooms, names, rate, 0.0)
    gc.collect()
    gc_objects = (len(gc.get_objects()) - objects) / rooms
    del ledger

    # Memory: traced from before the ledger exists until after the drain
    # (tracemalloc sees only what it traced being freed).
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        ledger = RoomLedger(0, ttl)
        end = _storm(ledger, rooms, names, rate, 0.0)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        ledger.expire(end)
        _drain(ledger, end + ttl, rooms)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return {
        "rooms": rooms,
        "decodes": decodes,
        "aborts_per_s": rate,
        "ttl_s": ttl,
        "bytes_per_tombstone": held / rooms,
        "held_mib": held / 2**20,
        "us_per_abort": us_per_abort,
        "us_loop_per_abort": loop / rooms * 1e6,
        "gc_objects_per_tombstone": gc_objects,
        "calibration_us": calibration,
        "first_expire_ms": first_expire * 1e3,
        "worst_expire_ms": max(worst, worst_between, first_expire) * 1e3,
        "median_expire_ms": median * 1e3,
        "expire_calls": calls,
        "last_forgotten_late_s": late,
        #: What the ledger (an empty one included) still holds once every tombstone is gone.
        "mib_after_expiry": after / 2**20,
    }


def report(r: dict[str, Any]) -> str:
    # Times scaled to an idle core by the calibration loop: a shared
    # machine's CPU can be several times slower than its model's.
    scale = NOMINAL_CALIBRATION_US / r["calibration_us"]

    def timed(name: str, key: str, unit: str, digits: int, goal: str) -> tuple[str, str, str, str]:
        here, idle = r[key], r[key] * scale
        return name, f"{here:.{digits}f} {unit}", f"{idle:.{digits}f} {unit}", goal

    rows = [
        ("bytes per tombstone", f"{r['bytes_per_tombstone']:.0f} B", "", "<= 200 B"),
        timed("abort + try_ack", "us_per_abort", "us", 2, "<= 5 us"),
        timed("first expire() after the storm", "first_expire_ms", "ms", 3, "<= 1 ms"),
        timed("worst single expire()", "worst_expire_ms", "ms", 3, "<= 1 ms"),
        timed("median expire() while draining", "median_expire_ms", "ms", 3, ""),
        ("objects the collector walks", f"{r['gc_objects_per_tombstone']:.2f}", "", "per tombstone"),
        ("memory left after expiry", f"{r['mib_after_expiry']:.2f} MiB", "", "0 (baseline)"),
    ]
    lines = [
        f"tombstones: {r['rooms']:,} ABORTs of unknown rooms from {r['decodes']} decodes, "
        f"{r['aborts_per_s']:.0f}/s simulated, TTL {r['ttl_s']:.0f} s "
        f"({r['held_mib']:.1f} MiB held at the peak)",
        f"  {'':<{_W}}  {'here (CPU)':>12}  {'idle core':>12}   goal",
    ]
    lines += [
        f"  {name:<{_W}}  {got:>12}  {scaled:>12}   {goal}".rstrip() for name, got, scaled, goal in rows
    ]
    lines.append(
        f"  CPU times exclude building each ABORT ({r['us_loop_per_abort']:.2f} us); this machine runs "
        f"sum(range(1000)) in {r['calibration_us']:.1f} us of CPU, an idle recent x86 core in about "
        f"{NOMINAL_CALIBRATION_US:.0f} ('idle core' scales by that)"
    )
    lines.append(
        f"  all forgotten after {r['expire_calls']} expire() calls {POLL_S * 1e3:.0f} ms apart; "
        f"the last {r['last_forgotten_late_s']:.2f} s after it fell due"
    )
    return "\n".join(lines)


_W = 31


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvconn.bench.tombstones", description=__doc__.splitlines()[0])
    p.add_argument("--rooms", type=int, default=100_000, help="room ids aborted before their request")
    p.add_argument("--decodes", type=int, default=8, help="decode endpoints sending the ABORTs")
    p.add_argument("--rate", type=float, default=20_000.0, help="ABORTs per simulated second")
    p.add_argument("--ttl", type=float, default=TTL_S, help="the tombstone TTL (s)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON ('-': stdout)")
    args = p.parse_args(argv)
    r = measure(args.rooms, args.decodes, args.rate, args.ttl)
    print(report(r))
    if args.json:
        write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
