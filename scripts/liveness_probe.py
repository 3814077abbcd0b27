"""Does load alone make decode call a live prefill rank down? One prefill
rank process, and two decode endpoints in this process watching it side by
side (each with a room open on it that the rank never writes, so each
Hellos the silent rank every heartbeat): one judges by the Hello alone (the
rule before issue 40), the other also by its control link's own heartbeat,
which the rank's libzmq answers without its Python (kvconn's rule now).

Loads, each optional, combined as given: ``--hogs N`` CPU-bound processes
(a pure-Python loop each); ``--rank-gil`` a thread in the rank's process
that only computes in Python (an engine's step loop between its C calls);
``--rank-gc N`` a thread there that runs full garbage collections over N
live objects, back to back (the GIL held in C for each: as an engine's
large collection or serialisation, stretched by CPU starvation);
``--rank-hold S`` the rank's interpreter held in one C call for S seconds
at the start (``kvconn.testing.faults.hold_gil``); ``--stop S`` the rank
SIGSTOPped for S seconds at the start (a real freeze, which both rules must
call down).

    python scripts/liveness_probe.py --seconds 40 --hogs 20 --rank-gc 4000000 --peer-timeout-s 2

prints, per rule, the rank-downs it called and the Hello round trips it saw
(median, p99, max), with the load average of the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from kvconn.config import Config
from kvconn.protocol.endpoint_events import RankDown
from kvconn.protocol.messages import Hello, HelloAck, Message
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.faults import hold_gil
from kvconn.testing.null import NullBackend

PAGES, PAGE_BYTES = 16, 4096


def gil_hog() -> None:
    """A thread that only computes in Python: it lets the GIL go only when
    the interpreter asks it to (every switch interval)."""

    def spin() -> None:
        x = 0
        while True:
            x = (x + 1) % 1_000_003

    threading.Thread(target=spin, daemon=True, name="gil-hog").start()


def gc_hog(objects: int) -> None:
    """Full garbage collections over ``objects`` live objects, back to back:
    the interpreter cannot hand the GIL over in the middle of one."""

    def collect() -> None:
        heap = [[i] for i in range(objects)]
        while heap:
            gc.collect()

    threading.Thread(target=collect, daemon=True, name="gc-hog").start()


def run_rank(args: dict[str, Any]) -> None:
    """The rank's process: prints its address, then serves until stdin closes."""
    rank = PrefillRank(NullBackend(), 0, PAGES * PAGE_BYTES, Config())
    print(json.dumps({"address": rank.address, "pid": os.getpid()}), flush=True)
    if args["gil"]:
        gil_hog()
    if args["gc"]:
        gc_hog(args["gc"])
    if args["hold"]:
        time.sleep(0.5)  # decode's rooms are open by then
        hold_gil(args["hold"])
    sys.stdin.read()
    rank.close()


class Watcher:
    """One decode endpoint with a room open on the rank, counting what it sees."""

    def __init__(self, address: str, config: Config, links: bool) -> None:
        self.decode = DecodeEndpoint(NullBackend(), PAGES, PAGE_BYTES, [address], config)
        if not links:  # the rule before: the Hello alone
            self.decode._listener._on_links = None
        self.downs: list[str] = []
        self.sent: list[float] = []
        self.back: list[float] = []
        carry, send, handler = (
            self.decode._carrier.run,
            self.decode._outbox.send,
            self.decode._listener._handler,
        )

        def run(actions: Any, now: float) -> Any:
            self.downs += [a.reason for a in actions if isinstance(a, RankDown)]
            return carry(actions, now)

        def sending(to: str, msg: Message) -> bool:
            if isinstance(msg, Hello):
                self.sent.append(time.monotonic())
            return send(to, msg)

        def handling(msg: Message) -> None:
            if isinstance(msg, HelloAck):
                self.back.append(time.monotonic())
            handler(msg)

        self.decode._carrier.run = run  # type: ignore[method-assign]
        self.decode._outbox.send = sending  # type: ignore[method-assign]
        self.decode._listener._handler = handling
        self.rx = self.decode.receiver(1, (0, 1))  # never written: the rank is watched, silent

    def round_trips(self) -> list[float]:
        """Each Hello's time to the first HelloAck after it."""
        trips, j = [], 0
        for sent in self.sent:
            while j < len(self.back) and self.back[j] < sent:
                j += 1
            if j < len(self.back):
                trips.append(self.back[j] - sent)
        return trips


def percentiles(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return f"{pick(0.5):.2f} / {pick(0.99):.2f} / {xs[-1]:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--hogs", type=int, default=0)
    ap.add_argument("--rank-gil", action="store_true")
    ap.add_argument("--rank-gc", type=int, default=0, metavar="OBJECTS")
    ap.add_argument("--rank-hold", type=float, default=0.0, metavar="SECONDS")
    ap.add_argument("--stop", type=float, default=0.0, metavar="SECONDS")
    ap.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    ap.add_argument("--peer-timeout-s", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        run_rank(json.loads(opts.child))
        return
    hogs = [
        subprocess.Popen([sys.executable, "-c", "x=0\nwhile True: x=(x+1)%1000003"]) for _ in range(opts.hogs)
    ]
    spec = {"gil": opts.rank_gil, "gc": opts.rank_gc, "hold": opts.rank_hold}
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    watchers: dict[str, Watcher] = {}
    try:
        address = json.loads(child.stdout.readline())["address"]
        config = Config(heartbeat_interval_s=opts.heartbeat_interval_s, peer_timeout_s=opts.peer_timeout_s)
        watchers = {
            "Hello alone": Watcher(address, config, False),
            "Hello and link": Watcher(address, config, True),
        }
        if opts.stop:
            child.send_signal(signal.SIGSTOP)
            time.sleep(opts.stop)
            child.send_signal(signal.SIGCONT)
        time.sleep(max(0.0, opts.seconds - opts.stop))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        load = os.getloadavg()[0]
        for w in watchers.values():
            w.decode.close()
        child.stdin.close()
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    result = {
        name: {"downs": w.downs, "hellos": len(w.sent), "round_trips": percentiles(w.round_trips())}
        for name, w in watchers.items()
    }
    if opts.json:
        print(json.dumps({"load": load, **result}))
        return
    load_desc = f"hogs={opts.hogs} rank_gil={opts.rank_gil} rank_gc={opts.rank_gc} rank_hold={opts.rank_hold}"
    print(f"{load_desc} stop={opts.stop} peer_timeout_s={opts.peer_timeout_s} load1={load:.1f}")
    print(f"  {'rule':16} {'rank-downs':>10} {'Hellos':>7}  round trip median / p99 / max")
    for name, r in result.items():
        print(f"  {name:16} {len(r['downs']):>10} {r['hellos']:>7}  {r['round_trips']}")
        for reason in r["downs"]:
            print(f"      down: {reason}")


if __name__ == "__main__":
    main()
