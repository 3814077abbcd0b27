"""Fault injection for kvconn's reliability tests.

* :class:`AckProxy`: a ZMQ PULL -> PUSH forwarder that a test puts between
  prefill ranks and decode's control socket. Every frame passes through a
  policy that may drop, duplicate, delay, hold back (reorder) or capture it
  for a later replay. It never forges a frame: with a deployment key it can
  only move valid frames around, which is exactly what a network can do.
* :class:`RaisingObserver`: a pluggy observer that raises from one hook.
* A prefill rank process with observers, an explicit bind host and a
  ``metrics`` command on stdin, so a test can read the rank's Prometheus
  counters (and a ``rooms`` command: the rooms it still works on, and how
  long since decode asked for each): ``python -m kvconn.testing.faults ARGS_JSON`` (the arguments of
  :mod:`kvconn.testing.prefill_proc` plus ``host`` and ``observers``).
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import zmq

from kvconn.chunk import Chunk, Segment
from kvconn.hookspecs import hookimpl
from kvconn.protocol import wire
from kvconn.protocol.messages import Abort, AbortAck, Message

#: A policy gets the frame and its decoded message (None when it does not
#: decode) and returns the delays (seconds) after which to forward copies of
#: it: ``[]`` drops it, ``[0.0]`` passes it, ``[0.0, 0.0]`` duplicates it.
#: Returning ``None`` holds the frame back until :meth:`AckProxy.flush`.
Policy = Callable[[bytes, Message | None], Sequence[float] | None]


def passthrough(frame: bytes, message: Message | None) -> Sequence[float]:
    return [0.0]


@attrs.define
class ProxyStats:
    seen: int = 0
    acks_seen: int = 0
    forwarded: int = 0
    dropped: int = 0
    duplicated: int = 0
    held: int = 0


class AckProxy:
    """Forwards frames from ``host:<random port>`` to ``target``."""

    def __init__(self, target: str, host: str = "127.0.0.1", key: bytes | None = None) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(target)
        self._key = key
        self._lock = threading.Lock()
        self.policy: Policy = passthrough
        self.stats = ProxyStats()
        #: Every decodable message seen, in arrival order, with its frame.
        self.log: list[tuple[Message, bytes]] = []
        self._held: list[bytes] = []
        self._timers: list[tuple[float, int, bytes]] = []
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvconn-ack-proxy", daemon=True)
        self._thread.start()

    def set_policy(self, policy: Policy) -> None:
        with self._lock:
            self.policy = policy

    def acks(self) -> list[tuple[AbortAck, bytes]]:
        with self._lock:
            return [(m, f) for m, f in self.log if isinstance(m, AbortAck)]

    def flush(self, reverse: bool = False) -> int:
        """Forward the held frames now (in reverse order if asked)."""
        with self._lock:
            frames, self._held = self._held, []
            for frame in reversed(frames) if reverse else frames:
                self._schedule(0.0, frame)
        return len(frames)

    def replay(self, frame: bytes) -> None:
        """Send an old frame again (a replayed or very late message)."""
        with self._lock:
            self._schedule(0.0, frame)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pull.close()
        self._push.close()

    def _schedule(self, delay: float, frame: bytes) -> None:
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), frame))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            with self._lock:
                wait = 0.02
                if self._timers:
                    wait = max(0.0, min(wait, self._timers[0][0] - time.monotonic()))
            if poller.poll(int(wait * 1000)):
                while True:
                    try:
                        frame = self._pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._route(frame)
            self._send_due()

    def _route(self, frame: bytes) -> None:
        try:
            message: Message | None = wire.decode(frame, self._key)
        except wire.FrameError:
            message = None
        with self._lock:
            self.stats.seen += 1
            if message is not None:
                self.log.append((message, frame))
            if isinstance(message, AbortAck):
                self.stats.acks_seen += 1
            delays = self.policy(frame, message)
            if delays is None:
                self.stats.held += 1
                self._held.append(frame)
                return
            if not delays:
                self.stats.dropped += 1
            self.stats.duplicated += max(0, len(delays) - 1)
            for delay in delays:
                self._schedule(delay, frame)

    def _send_due(self) -> None:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._timers or self._timers[0][0] > now:
                    return
                _, _, frame = heapq.heappop(self._timers)
                self.stats.forwarded += 1
            self._push.send(frame)


def only_acks(inner: Policy) -> Policy:
    """Apply ``inner`` to ABORT_ACKs only; pass every other frame."""

    def policy(frame: bytes, message: Message | None) -> Sequence[float] | None:
        return inner(frame, message) if isinstance(message, AbortAck) else [0.0]

    return policy


class InjectedFault(RuntimeError):
    pass


class RaisingObserver:
    """Raises :class:`InjectedFault` from ``hook`` for chunks of ``rooms``
    (every room when empty), at most ``times`` times (0: always)."""

    HOOKS = ("on_dequeue", "on_skip", "on_post", "on_done_barrier", "on_abort_notification", "on_fence")

    def __init__(self, hook: str, rooms: Sequence[int] = (), times: int = 0) -> None:
        if hook not in self.HOOKS:
            raise ValueError(f"unknown hook {hook!r}")
        self.hook = hook
        self.rooms = frozenset(rooms)
        self.times = times
        self.raised = 0
        self._lock = threading.Lock()

    def _maybe_raise(self, hook: str, room: int | None) -> None:
        if hook != self.hook:
            return
        if room is not None and self.rooms and room not in self.rooms:
            return
        with self._lock:
            if self.times and self.raised >= self.times:
                return
            self.raised += 1
        raise InjectedFault(f"injected fault in {hook} (room {room})")

    @hookimpl
    def on_dequeue(self, chunk: Chunk) -> None:
        self._maybe_raise("on_dequeue", chunk.room)

    @hookimpl
    def on_skip(self, chunk: Chunk) -> None:
        self._maybe_raise("on_skip", chunk.room)

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> object | None:
        self._maybe_raise("on_post", chunk.room)
        return None

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> None:
        self._maybe_raise("on_done_barrier", chunk.room)

    @hookimpl
    def on_abort_notification(self, abort: Abort, known: bool) -> None:
        self._maybe_raise("on_abort_notification", abort.room)

    @hookimpl
    def on_fence(self) -> bool | None:
        self._maybe_raise("on_fence", None)
        return None


def metric_samples(registry: Any) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a prometheus registry, as plain data."""
    return [(s.name, dict(s.labels), float(s.value)) for fam in registry.collect() for s in fam.samples]


# -- the rank process --------------------------------------------------------
def main() -> None:
    import kvconn.testing.prefill_proc as prefill_proc
    from kvconn.runtime.prefill import PrefillRank
    from kvconn.testing.child import busy, emit, load_args

    logging.basicConfig(level=logging.CRITICAL, stream=sys.stderr)
    args = load_args(sys.argv[1])
    if "wire_version" in args:
        from kvconn.protocol import wire

        # An older peer: its frames carry that version, and it takes no other.
        wire.VERSION = int(args["wire_version"])
    if args.get("tracing"):
        from kvconn.testing.tracing import finished_spans, memory_exporter

        memory_exporter()
    host = str(args.get("host", "127.0.0.1"))
    port = int(args.get("port", 0))  # fixed: a restarted rank comes back at its address
    observers = [
        RaisingObserver(o["hook"], o.get("rooms", ()), int(o.get("times", 0)))
        for o in args.get("observers", ())
    ]

    class _Rank(PrefillRank):
        def __init__(self, *a: Any, **kw: Any) -> None:
            if len(a) >= 4:
                a = (*a[:3], attrs.evolve(a[3], host=host, port=port), *a[4:])
            kw["observers"] = observers
            super().__init__(*a, **kw)

    setattr(prefill_proc, "PrefillRank", _Rank)  # noqa: B010
    driver = prefill_proc.Driver(args)
    if args.get("drain_on_sigterm") is not None:
        _drain_on_sigterm(driver.rank, float(args["drain_on_sigterm"]))
    print(json.dumps({"address": driver.rank.address}), flush=True)
    for line in sys.stdin:
        if line.strip() == "metrics":
            out = {"samples": metric_samples(driver.rank.metrics.registry)}
            print(json.dumps(out), flush=True)
        elif line.startswith("drain "):  # the API path: "drain GRACE_S"
            report = driver.rank.drain(float(line.split()[1]))
            emit({"drain": attrs.asdict(report)})
        elif line.startswith("busy "):  # an engine busy in Python: "busy SECONDS"
            busy(float(line.split()[1]))
        elif line.strip() == "rooms":  # the rooms it still works on, and for how long
            print(json.dumps({"unsettled": driver.unsettled()}), flush=True)
        elif line.strip() == "spans":
            print(json.dumps({"spans": finished_spans() if args.get("tracing") else []}), flush=True)
    driver.rank.close()


def _drain_on_sigterm(rank: Any, grace_s: float) -> None:
    """SIGTERM drains the rank (the engine's signal path), reports, exits."""
    from kvconn.runtime.drain_signal import drain_on_signal
    from kvconn.testing.child import emit

    def then(reports: list[Any]) -> None:
        emit({"drain": attrs.asdict(reports[0])})
        rank.close()
        os._exit(0)

    drain_on_signal([rank], grace_s, then)


if __name__ == "__main__":
    main()
