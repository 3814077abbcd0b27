"""CPU per operation of kvconn's hot path, one process, null transport: the
same calls for any kvconn version (run it with that tree's venv).

    TREE/.venv/bin/python scripts/hotpath/micro.py [--reps 5]

Prints, per figure, the best of ``--reps`` blocks (the machine is shared:
the minimum is the least disturbed): CPU microseconds of

* ``rx.poll``: one Receiver.poll() (the engine's thread);
* ``send (engine thread)``: one one-page Sender.send, the calling thread only;
* ``chunk end to end``: the whole process per one-page chunk through
  Sender.send and the worker;
* ``room, whole process``: one one-chunk room, receiver() to finish(), both
  sides and every thread;
* ``abort, whole process``: one room aborted after a first chunk landed,
  receiver() to on_release, both sides and every thread.
"""

from __future__ import annotations

import argparse
import threading
import time

from kvconn.config import Config
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank

try:
    from kvconn.testing.null import NullBackend
except ImportError:  # older trees
    from kvconn.bench.overhead import NullBackend  # type: ignore[no-redef,attr-defined]


def wait(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 30
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.0002)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    n = a.n
    backend = NullBackend()
    page_bytes = 4096
    npages = 4 * n + 64
    rank = PrefillRank(backend, 0, npages * page_bytes, Config())
    released = threading.Event()
    decode = DecodeEndpoint(
        backend,
        npages,
        page_bytes,
        [rank.address],
        Config(check_pages=False),
        on_release=lambda r: released.set(),
    )
    room_ids = iter(range(1, 10**9))
    best: dict[str, float] = {}

    def record(name: str, us: float) -> None:
        best[name] = min(best.get(name, float("inf")), us)

    try:
        for _ in range(a.reps):
            # rx.poll
            room = next(room_ids)
            rx = decode.receiver(room, (0,))
            t0 = time.thread_time()
            for _ in range(n):
                rx.poll()
            record("rx.poll (engine thread)", (time.thread_time() - t0) / n * 1e6)
            # Sender.send, one page a chunk
            wait(lambda room=room: rank.sender(room).poll() >= KVPoll.WAITING_FOR_INPUT, "request")
            rx.abort()
            room = next(room_ids)
            rx = decode.receiver(room, tuple(range(n)))
            wait(lambda room=room: rank.sender(room).poll() >= KVPoll.WAITING_FOR_INPUT, "request")
            s = rank.sender(room)
            p0, t0 = time.process_time(), time.thread_time()
            for i in range(n):
                s.send([i], last=i == n - 1)
            record("send (engine thread)", (time.thread_time() - t0) / n * 1e6)
            wait(lambda rx=rx: rx.poll() is KVPoll.SUCCESS, "success")
            record("chunk end to end (whole process)", (time.process_time() - p0) / n * 1e6)
            rx.finish()
            # one-chunk rooms, whole process
            rooms = max(50, n // 20)
            p0 = time.process_time()
            for _ in range(rooms):
                room = next(room_ids)
                rx = decode.receiver(room, (room % npages,))
                s = rank.sender(room)
                wait(lambda s=s: s.poll() >= KVPoll.WAITING_FOR_INPUT, "request")
                s.send([room % npages], last=True)
                wait(lambda rx=rx: rx.poll() is KVPoll.SUCCESS, "success")
                rx.finish()
                s.clear()
            record("room, whole process", (time.process_time() - p0) / rooms * 1e6)
            # aborted rooms, whole process
            p0 = time.process_time()
            for _ in range(rooms):
                room = next(room_ids)
                released.clear()
                rx = decode.receiver(room, (room % npages, (room + 1) % npages))
                s = rank.sender(room)
                wait(lambda s=s: s.poll() >= KVPoll.WAITING_FOR_INPUT, "request")
                s.send([room % npages])
                rx.abort()
                wait(released.is_set, "release")
                s.clear()
            record("abort, whole process", (time.process_time() - p0) / rooms * 1e6)
    finally:
        decode.close()
        rank.close()
    for k, v in best.items():
        print(f"{k:40s} {v:10.2f} us")


if __name__ == "__main__":
    main()
