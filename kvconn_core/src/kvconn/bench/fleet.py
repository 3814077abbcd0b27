"""Fleet scale, simulated (issue 35, goal 8).

``python -m kvconn.bench.fleet [--scales 0.1,1,10] [--json FILE]``

A fleet of D decode endpoints and P prefill instances of R ranks each
cannot run on one machine, but the sans-I/O core can: this drives the real
:class:`~kvconn.protocol.endpoint.EndpointState` (and its
:class:`~kvconn.protocol.hold.HoldTracker`) of every decode, bootstrapping an
instance on its first room there, and the real
:class:`~kvconn.protocol.ledger.RoomLedger` of every rank, without sockets,
under a Poisson request load with a share of them aborted, and counts the
control messages that would cross the network, by kind, per second:

* ``request`` (TransferRequest, one per rank of the room) and ``status``
  (RoomStatus: a rank's room completed, or refused);
* ``abort`` (ABORT, one per unproven rank) and ``ack`` (ABORT_ACK);
* ``heartbeat``: the Hellos each decode's real
  :class:`~kvconn.protocol.endpoint.EndpointState` sends at its heartbeats
  (protocol/liveness.py: only ranks a tracked room was asked of, silent for
  an interval; statuses and acks are hearing), each answered by a HelloAck
  one poll later;
* ``heartbeat (every rank)``: the rule before (every ``heartbeat_interval_s``
  a decode Helloed every rank it ever bootstrapped, each answered): with a
  router spreading requests over every instance, every rank of the fleet;
  counted, not simulated message by message;
* ``bootstrap``: one Hello and one HelloAck per (decode, rank) pair, once.

Memory per endpoint is the deep size of the state machines (a sample of
them) at the end of the window, and for ranks, extrapolated to a full
``tombstone_ttl_s`` of history (a rank keeps tombstones and acked rooms that
long).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import random
import sys
import time
import types
from collections import Counter
from typing import Any

import attrs

from kvconn.bench.output import write_json
from kvconn.config import Config
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import (
    BootstrapTick,
    Identified,
    Instance,
    RankDown,
    Request,
    Send,
    Tick,
    WriterIdentity,
)
from kvconn.protocol.hold import HoldState, HoldTracker
from kvconn.protocol.ledger import KVPoll, NotifyDecode, RoomKey, RoomLedger, SendAck
from kvconn.protocol.messages import Abort, Hello, HelloAck

#: How long before the window a decode bootstrapped (and last heard from) an instance.
LONG_AGO = 600.0

KINDS = ("request", "status", "abort", "ack", "heartbeat", "heartbeat (every rank)")


@attrs.frozen
class Fleet:
    decodes: int = 100
    instances: int = 100
    ranks: int = 8  #: per prefill instance
    #: Requests each decode endpoint starts per second.
    rate: float = 10.0
    abort_fraction: float = 0.3
    #: Of the aborts, those decode sends before its request (a tombstone at every rank).
    early_fraction: float = 0.2
    #: From a request to its last chunk landing.
    transfer_s: float = 0.2
    pages: int = 16
    seconds: float = 3.0  #: simulated
    step: float = 0.05  #: the listeners' poll
    seed: int = 0

    def scaled(self, factor: float) -> Fleet:
        return attrs.evolve(
            self,
            decodes=max(1, round(self.decodes * factor)),
            instances=max(1, round(self.instances * factor)),
        )


def deep_size(root: object) -> int:
    """Bytes of ``root`` and everything it alone reaches (types, modules,
    functions and interned names left out)."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def simulate(f: Fleet) -> dict[str, Any]:
    cfg = Config()
    rng = random.Random(f.seed)
    n_ranks = f.instances * f.ranks
    # A rank numbers itself within its instance and names its process's session (g + 1).
    ledgers = [RoomLedger(g % f.ranks, cfg.tombstone_ttl_s, session=g + 1) for g in range(n_ranks)]
    names = [f"decode-{d}" for d in range(f.decodes)]
    trackers = [
        HoldTracker(names[d], f"tcp://decode-{d}", cfg.abort_timeout_s, cfg.resend_interval_s)
        for d in range(f.decodes)
    ]
    states = [
        EndpointState(
            names[d],
            trackers[d],
            num_pages=f.pages,
            check_pages=False,  # every room here uses pages 0..pages-1
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            peer_timeout_s=cfg.peer_timeout_s,
        )
        for d in range(f.decodes)
    ]
    #: Each decode's bootstrapped instances (on first use: what a decode knows).
    known: list[dict[int, Instance]] = [{} for _ in range(f.decodes)]
    counts: Counter[str] = Counter()
    #: (time, tiebreak, kind, decode, room, instance)
    events: list[tuple[float, int, str, int, int, int]] = []
    #: HelloAcks on their way back: (decode, the Hello's rank address), answered one poll later.
    answers: list[tuple[int, str]] = []
    next_room = [0] * f.decodes
    requests: list[dict[int, Request]] = [{} for _ in range(f.decodes)]
    ticks = itertools.count()  # the heap's tiebreak

    def ranks_of(instance: int) -> range:
        return range(instance * f.ranks, (instance + 1) * f.ranks)

    def hello_ack(g: int) -> HelloAck:
        return HelloAck(g % f.ranks, f"rank-{g}", "sim", 100 + g, 1, "", g + 1)

    def bootstrapped(d: int, instance: int, now: float) -> Instance:
        """The instance as a serving decode knows it: bootstrapped long ago
        (a router spreads requests over every instance), last heard from
        then or when a room of this window last used it. Bootstrapped here
        on first use, at ``now - LONG_AGO``: a decode's state for the
        instances it never uses in the window is left out (not its Hellos:
        none go to them)."""
        if instance not in known[d]:
            then = now - LONG_AGO
            addresses = tuple(f"rank-{g}" for g in ranks_of(instance))
            hello = Hello(names[d], f"tcp://decode-{d}", "sim", 4096, f.ranks, 0, b"")
            boot = states[d].begin_bootstrap(addresses, hello, then, timeout_s=30.0, resend_interval_s=1.0)
            for g in ranks_of(instance):
                ack = hello_ack(g)
                writer = WriterIdentity(ack.address, "sim", ack.pid, 1, ack.session)
                states[d].handle(ack, then)
                states[d].handle(Identified(ack, writer), then)
            states[d].handle(BootstrapTick(boot), then)
            known[d][instance] = boot
        return known[d][instance]

    def to_decode(d: int, actions: list[Any], now: float) -> None:
        for a in actions:
            if isinstance(a, SendAck):
                counts["ack"] += 1
                carry(d, states[d].handle(a.ack, now), now)
            elif isinstance(a, NotifyDecode):
                counts["status"] += 1
                carry(d, states[d].handle(a.status, now), now)

    def carry(d: int, actions: list[Any], now: float) -> None:
        """The runtime's part: an ABORT to its rank's ledger, a Hello counted
        (its HelloAck comes back at the next poll)."""
        for a in actions:
            if isinstance(a, Send) and isinstance(a.message, Abort):
                counts["abort"] += 1
                g = int(a.address.removeprefix("rank-"))
                ledgers[g].abort(a.message, now)
                to_decode(d, ledgers[g].try_ack(RoomKey(names[d], a.message.room)), now)
            elif isinstance(a, Send) and isinstance(a.message, Hello):
                counts["heartbeat"] += 2  # the Hello and its HelloAck
                answers.append((d, a.address))
            elif isinstance(a, RankDown):
                counts["rank down"] += 1

    def start(d: int, now: float) -> None:
        counts["rooms"] += 1
        room = next_room[d]
        next_room[d] += 1
        instance = rng.randrange(f.instances)
        request, sends = states[d].open(
            room, tuple(range(f.pages)), bootstrapped(d, instance, now), None, None, now
        )
        requests[d][room] = request
        aborted = rng.random() < f.abort_fraction
        if aborted and rng.random() < f.early_fraction:
            carry(d, states[d].abort(request, now), now)  # before its request: tombstones
            return
        carry(d, states[d].sent(request, [], now), now)
        for send in sends:
            counts["request"] += 1
            g = int(send.address.removeprefix("rank-"))
            key = RoomKey(names[d], room)
            ledgers[g].request(key, send.message.seq)  # type: ignore[union-attr]
            ledgers[g].dequeue(key)  # its chunk in flight
        when = now + (rng.uniform(0, f.transfer_s) if aborted else f.transfer_s)
        heapq.heappush(events, (when, next(ticks), "abort" if aborted else "done", d, room, instance))

    def finish(kind: str, d: int, room: int, instance: int, now: float) -> None:
        key = RoomKey(names[d], room)
        request = requests[d].pop(room)
        aborted = kind == "abort"
        if aborted:
            carry(d, states[d].abort(request, now), now)  # no ack yet: a chunk is in flight
        for g in ranks_of(instance):
            to_decode(d, ledgers[g].landed(key, last=not aborted), now)
            to_decode(d, ledgers[g].clear(key), now)
        if not aborted and request.poll() is KVPoll.SUCCESS:
            states[d].finish(request)

    cpu = time.process_time()
    now = 0.0
    next_beat = 0.0
    steps = round(f.seconds / f.step)
    for _ in range(steps):
        now += f.step
        for d, address in answers[:]:
            g = int(address.removeprefix("rank-"))
            carry(d, states[d].handle(hello_ack(g), now), now)
        answers.clear()
        for _ in range(_poisson(rng, f.rate * f.decodes * f.step)):
            start(rng.randrange(f.decodes), now)
        while events and events[0][0] <= now:
            _, _, kind, d, room, instance = heapq.heappop(events)
            finish(kind, d, room, instance, now)
        for d, state in enumerate(states):
            # nothing exits here: every rank's process lives (nothing proven gone)
            carry(d, state.handle(Tick(frozenset(), True), now), now)
        if now >= next_beat:
            next_beat = now + cfg.heartbeat_interval_s
            for ledger in ledgers:
                ledger.expire(now)
            # Before (every heartbeat, every rank a decode knows: with a router
            # spreading requests over every instance, the whole fleet).
            counts["heartbeat (every rank)"] += 2 * f.decodes * n_ranks
    cpu = time.process_time() - cpu

    sample = range(0, n_ranks, max(1, n_ranks // 16))
    empty = deep_size(RoomLedger(0))
    rank_bytes = sum(deep_size(ledgers[g]) for g in sample) / len(sample)
    steady = empty + (rank_bytes - empty) * max(1.0, cfg.tombstone_ttl_s / f.seconds)
    decode_sample = range(0, f.decodes, max(1, f.decodes // 16))
    decode_bytes = sum(deep_size(trackers[d]) for d in decode_sample) / len(decode_sample)
    state_bytes = sum(deep_size(states[d]) for d in decode_sample) / len(decode_sample)
    per_s = {k: counts[k] / f.seconds for k in KINDS}
    held = sum(len(t.rooms_in(HoldState.HELD)) + len(t.rooms_in(HoldState.QUARANTINED)) for t in trackers)
    work = sum(per_s[k] for k in ("request", "status", "abort", "ack"))
    return {
        "decodes": f.decodes,
        "instances": f.instances,
        "ranks": n_ranks,
        "requests_per_s": f.rate * f.decodes,
        "per_s": per_s,
        "work_per_s": work,
        "bootstrap_once": 2 * f.decodes * n_ranks,
        "per_rank_per_s": {k: v / n_ranks for k, v in per_s.items()},
        "per_decode_per_s": {k: v / f.decodes for k, v in per_s.items()},
        "heartbeat_to_work": per_s["heartbeat"] / work if work else float("inf"),
        "every_rank_to_work": per_s["heartbeat (every rank)"] / work if work else float("inf"),
        "rank_kib": rank_bytes / 1024,
        "rank_kib_at_ttl": steady / 1024,
        "decode_kib": decode_bytes / 1024,
        #: the whole EndpointState: its tracker, and a writer and heartbeat
        #: state for every rank of each instance it bootstrapped
        "endpoint_kib": state_bytes / 1024,
        "peers_per_decode": n_ranks,
        "known_per_decode": sum(len(k) for k in known) * f.ranks / f.decodes,
        "peers_per_rank": f.decodes,
        "cpu_s": cpu,
        "rooms": counts["rooms"],
        "counts": dict(counts),
        #: Aborted rooms still waiting for proof (acks come at once here: none).
        "held_at_end": held,
        "tombstones_at_end": sum(e.tombstone for ledger in ledgers for e in ledger.entries().values()),
        "simulated_s": f.seconds,
    }


def _poisson(rng: random.Random, mean: float) -> int:
    if mean > 30:  # a normal approximation, fine at these means
        return max(0, round(rng.gauss(mean, mean**0.5)))
    n, p, limit = 0, 1.0, pow(2.718281828459045, -mean)
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1


def report(rows: list[dict[str, Any]], fleet: Fleet) -> str:
    cfg = Config()
    lines = [
        f"fleet: {fleet.rate:g} requests/s per decode, {fleet.abort_fraction:.0%} aborted "
        f"({fleet.early_fraction:.0%} of those before the request), {fleet.ranks} ranks per instance, "
        f"heartbeat every {cfg.heartbeat_interval_s:g} s, tombstone TTL {cfg.tombstone_ttl_s:g} s, "
        f"{fleet.seconds:g} s simulated",
        f"{'decodes x ranks':>16} {'requests/s':>10} {'request':>9} {'status':>9} {'abort':>9} {'ack':>9} "
        f"{'every rank':>11} {'/work':>6} {'heartbeat':>9} {'hb/work':>8}",
    ]
    for r in rows:
        p = r["per_s"]
        lines.append(
            f"{r['decodes']:>6} x {r['ranks']:<7} {r['requests_per_s']:>10.0f} {p['request']:>9.0f} "
            f"{p['status']:>9.0f} {p['abort']:>9.0f} {p['ack']:>9.0f} {p['heartbeat (every rank)']:>11.0f} "
            f"{r['every_rank_to_work']:>6.1f} {p['heartbeat']:>9.0f} {r['heartbeat_to_work']:>8.2f}"
        )
    lines.append("per endpoint (messages/s in and out; memory of its state machine):")
    for r in rows:
        pr, pd = r["per_rank_per_s"], r["per_decode_per_s"]
        size = f"{r['decodes']:>5} x {r['ranks']:<6}"
        lines.append(
            f"  {size} a rank:   work {sum(pr[k] for k in KINDS[:4]):6.1f}/s, heartbeats {pr['heartbeat']:6.2f}/s "
            f"(every rank: {pr['heartbeat (every rank)']:.0f}/s), ledger {r['rank_kib']:.0f} KiB "
            f"({r['rank_kib_at_ttl']:.0f} KiB at the TTL)"
        )
        lines.append(
            f"  {size} a decode: work {sum(pd[k] for k in KINDS[:4]):6.1f}/s, heartbeats {pd['heartbeat']:6.2f}/s "
            f"(every rank: {pd['heartbeat (every rank)']:.0f}/s), tracker {r['decode_kib']:.0f} KiB, "
            f"endpoint {r['endpoint_kib']:.0f} KiB ({r['known_per_decode']:.0f} ranks known) "
            f"[{r['cpu_s']:.1f} s CPU]"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvconn.bench.fleet", description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="0.1,1,10", help="fleet sizes, as factors of the base fleet")
    p.add_argument("--decodes", type=int, default=100, help="decode endpoints at scale 1")
    p.add_argument("--instances", type=int, default=100, help="prefill instances at scale 1")
    p.add_argument("--ranks", type=int, default=8, help="ranks per prefill instance")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second per decode")
    p.add_argument("--abort-fraction", type=float, default=0.3)
    p.add_argument("--early-fraction", type=float, default=0.2, help="of the aborts, before the request")
    p.add_argument("--seconds", type=float, default=3.0, help="simulated seconds")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON ('-': stdout)")
    args = vars(p.parse_args(argv))
    scales, path = args.pop("scales"), args.pop("json")
    base = Fleet(**args)  # every other option is the Fleet field of its name
    rows = [simulate(base.scaled(float(s))) for s in scales.split(",")]
    print(report(rows, base))
    if path:
        write_json(path, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
