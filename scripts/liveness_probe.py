"""Where a heartbeat's time goes under load: one prefill rank process, one
decode endpoint here, a room open on the rank (so decode watches it: it
Hellos the silent rank every heartbeat), and timestamps at each hop of a
Hello's round trip (CLOCK_MONOTONIC is one clock for every process of a host):

  sent      decode's listener thread hands the Hello to its outbox
  read      the rank's listener thread decodes it
  answered  the rank hands the HelloAck to its outbox
  back      decode's listener thread decodes the HelloAck
  heard     decode's state machine counts it as hearing from the rank

Loads (each optional, combined as given): ``--hogs N`` CPU-bound processes
(a pure-Python loop each), ``--rank-gil`` a thread in the rank's process
that holds the GIL (a pure-Python loop, as an engine's step loop between
its C calls), ``--decode-gil`` the same in decode's.

    python scripts/liveness_probe.py --seconds 20 --hogs 20 --rank-gil

prints, per hop, the median / p99 / max in ms, the longest time a Hello
went unanswered, and how many ranks decode called down.
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
from collections.abc import Callable
from typing import Any

from kvconn.config import Config
from kvconn.protocol.endpoint_events import RankDown
from kvconn.protocol.messages import Hello, HelloAck, Message
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.null import NullBackend

PAGES, PAGE_BYTES = 16, 4096


def gil_hog() -> None:
    """A thread that only computes in Python: it gives the GIL up only when
    the interpreter asks it to (every switch interval)."""

    def spin() -> None:
        x = 0
        while True:
            x = (x + 1) % 1_000_003

    threading.Thread(target=spin, daemon=True, name="gil-hog").start()


def gc_hog(objects: int) -> None:
    """A thread that holds the GIL in C for long stretches: a full garbage
    collection over ``objects`` live objects (as an engine process whose
    heap holds a model's and a framework's objects), again and again. The
    interpreter cannot hand the GIL over in the middle of one."""

    def collect() -> None:
        heap = [[i] for i in range(objects)]
        while heap:
            gc.collect()

    threading.Thread(target=collect, daemon=True, name="gc-hog").start()


def wrap(obj: Any, name: str, before: Callable[..., None]) -> None:
    inner = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return inner(*args, **kwargs)

    setattr(obj, name, wrapped)


def run_rank(args: dict[str, Any]) -> None:
    """The rank's process: prints its address, then one line per Hello."""
    rank = PrefillRank(NullBackend(), 0, PAGES * PAGE_BYTES, Config())
    if args["gil"]:
        gil_hog()
    if args["gc"]:
        gc_hog(args["gc"])
    out = sys.stdout
    lock = threading.Lock()

    def emit(**fields: Any) -> None:
        with lock:
            out.write(json.dumps(fields) + "\n")
            out.flush()

    def on_message(msg: Message) -> None:
        if isinstance(msg, Hello):
            emit(event="read", t=time.monotonic())

    def on_send(address: str, msg: Message) -> None:
        if isinstance(msg, HelloAck):
            emit(event="answered", t=time.monotonic())

    wrap(rank._listener, "_handler", on_message)
    wrap(rank._outbox, "send", on_send)
    emit(event="address", address=rank.address, pid=os.getpid())
    sys.stdin.read()  # until the parent closes our stdin
    rank.close()


def percentiles(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return f"{pick(0.5) * 1e3:8.1f} {pick(0.99) * 1e3:8.1f} {xs[-1] * 1e3:8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--hogs", type=int, default=0)
    ap.add_argument("--rank-gil", action="store_true")
    ap.add_argument("--decode-gil", action="store_true")
    ap.add_argument("--rank-gc", type=int, default=0, metavar="OBJECTS")
    ap.add_argument("--decode-gc", type=int, default=0, metavar="OBJECTS")
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
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps({"gil": opts.rank_gil, "gc": opts.rank_gc})],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    events: list[tuple[str, float]] = []
    first = json.loads(child.stdout.readline())
    address = first["address"]

    def read_child() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            e = json.loads(line)
            events.append((e["event"], e["t"]))

    threading.Thread(target=read_child, daemon=True).start()
    config = Config(heartbeat_interval_s=opts.heartbeat_interval_s, peer_timeout_s=opts.peer_timeout_s)
    decode = DecodeEndpoint(NullBackend(), PAGES, PAGE_BYTES, [address], config)
    downs: list[str] = []
    carry = decode._carrier.run

    def run(actions: Any, now: float) -> Any:
        for a in actions:
            if isinstance(a, RankDown):
                downs.append(a.reason)
        return carry(actions, now)

    decode._carrier.run = run  # type: ignore[method-assign]

    def on_send(address: str, msg: Message) -> None:
        if isinstance(msg, Hello):
            events.append(("sent", time.monotonic()))

    def on_message(msg: Message) -> None:
        if isinstance(msg, HelloAck):
            events.append(("back", time.monotonic()))

    wrap(decode._outbox, "send", on_send)
    wrap(decode._listener, "_handler", on_message)
    if opts.decode_gil:
        gil_hog()
    if opts.decode_gc:
        gc_hog(opts.decode_gc)
    started = time.monotonic()
    rx = decode.receiver(1, (0, 1))  # never sent: the rank is watched and silent
    try:
        time.sleep(opts.seconds)
    finally:
        for h in hogs:
            h.send_signal(signal.SIGKILL)
            h.wait()
        polled = rx.poll()
        decode.close()
        child.stdin.close()
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)
            child.wait()
    # Pair each Hello with the next read, answer and ack after it (FIFO hops).
    sent = [t for e, t in events if e == "sent" and t >= started]
    hops: dict[str, list[float]] = {
        "sent->read": [],
        "read->answered": [],
        "answered->back": [],
        "round trip": [],
    }
    reads = sorted(t for e, t in events if e == "read" and t >= started)
    answers = sorted(t for e, t in events if e == "answered" and t >= started)
    backs = sorted(t for e, t in events if e == "back" and t >= started)
    for i, s in enumerate(sent):
        if i < len(reads) and i < len(answers) and i < len(backs):
            hops["sent->read"].append(reads[i] - s)
            hops["read->answered"].append(answers[i] - reads[i])
            hops["answered->back"].append(backs[i] - answers[i])
            hops["round trip"].append(backs[i] - s)
    result = {
        "load": os.getloadavg()[0],
        "hellos": len(sent),
        "answered": len(backs),
        "downs": downs,
        "room": polled.name,
        "hops_ms": {k: percentiles(v) for k, v in hops.items()},
    }
    if opts.json:
        print(json.dumps(result))
        return
    print(
        f"hogs={opts.hogs} rank_gil={opts.rank_gil} decode_gil={opts.decode_gil} "
        f"rank_gc={opts.rank_gc} decode_gc={opts.decode_gc} "
        f"load1={result['load']:.1f} hellos={len(sent)} answered={len(backs)} downs={len(downs)} room={polled.name}"
    )
    print(f"  {'hop':16} {'median':>8} {'p99':>8} {'max':>8}   (ms)")
    for k, v in result["hops_ms"].items():
        print(f"  {k:16} {v}")
    for reason in downs:
        print(f"  DOWN: {reason}")


if __name__ == "__main__":
    main()
