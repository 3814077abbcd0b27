"""A prefill rank process for the conformance suite.

It is :mod:`kvconn.testing.prefill_proc` (a self-driving rank) plus an
observer plugin that reports, pauses at, stops at or raises from the hook
points of watched rooms. Every report is one JSON line on stdout carrying
``time.monotonic()`` (CLOCK_MONOTONIC is shared by the processes of a host),
so the parent can order a chunk's life against decode's release.

``faults`` in the JSON argument maps a room (as a string) to::

    {"pause": POINT, "pause_s": 0.15,   # sleep at POINT (chunk ``index``)
     "stop": POINT or [POINT, ...],      # SIGSTOP this whole process at each POINT
     "raise": POINT,                     # raise from the hook at POINT
     "await_abort": POINT,               # at POINT, wait (10 s at most) until the
                                         # room's ABORT reached on_abort_notification
     "gather": POINT, "gather_n": 2,     # at POINT, wait (10 s at most) until the chunks
                                         # of gather_n watched rooms are all there, then
                                         # go on together (two workers post at once)
     "hold": POINT, "hold_s": 2.5,       # after the stop at POINT, hold the hook that
                                         # long (the core acts on its answer only then),
                                         # if the answer is one the suite watches after:
                                         # FAILED_SETTLED, a fence that answered True
     "index": 0,                         # which chunk (default: the first)
     "raise_index": 0}                   # which chunk raises (default: index)

POINT is one of ``dequeue``, ``skip``, ``before_post``, ``after_post``,
``before_barrier``, ``after_barrier``, ``abort``; a ``stop`` may also name
``fencing``: right before ``on_fence`` is called, and ``fenced``: right
after it returned (before the core acts on it), whichever room the fence
was for.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Generator, Sequence
from typing import Any

from kvconn.chunk import Chunk, Segment
from kvconn.hookspecs import hookimpl
from kvconn.protocol.messages import Abort
from kvconn.testing.child import emit, load_args, stop_self
from kvconn.testing.prefill_proc import Driver
from kvconn.transport import Settlement


class InjectedFault(RuntimeError):
    pass


class Faults:
    """The observer: watches the rooms named in ``spec``."""

    def __init__(self, spec: dict[str, dict[str, Any]]) -> None:
        self.spec = {int(room): rule for room, rule in spec.items()}
        self._aborted: set[int] = set()
        self._abort_seen = threading.Condition()
        self._gathered: dict[str, int] = {}
        self._gathering = threading.Condition()

    @staticmethod
    def _stops(rule: dict[str, Any]) -> list[str]:
        stop = rule.get("stop", [])
        return [stop] if isinstance(stop, str) else list(stop)

    def _point(self, point: str, room: int, index: int = -1, **extra: Any) -> None:
        rule = self.spec.get(room)
        if rule is None:
            return
        emit({"event": point, "room": room, "index": index, **extra})

        def at(index_key: str) -> bool:
            return index < 0 or index == int(rule.get(index_key, rule.get("index", 0)))

        if rule.get("pause") == point and at("index"):
            emit({"event": "paused", "point": point, "room": room, "index": index})
            time.sleep(float(rule.get("pause_s", 0.15)))
        if rule.get("gather") == point and at("index"):
            with self._gathering:
                self._gathered[point] = self._gathered.get(point, 0) + 1
                self._gathering.notify_all()
                n = int(rule.get("gather_n", 2))
                met = self._gathering.wait_for(lambda: self._gathered[point] >= n, timeout=10.0)
            emit({"event": "gathered", "room": room, "index": index, "met": met})
        if rule.get("await_abort") == point and at("index"):
            with self._abort_seen:
                seen = self._abort_seen.wait_for(lambda: room in self._aborted, timeout=10.0)
            emit({"event": "awaited_abort", "room": room, "index": index, "seen": seen})
        if point in self._stops(rule) and at("index"):
            emit({"event": "stopping", "point": point, "room": room, "index": index})
            stop_self()
            if extra.get("settlement", Settlement.FAILED_SETTLED.value) == Settlement.FAILED_SETTLED.value:
                self._hold(rule, point)
        if rule.get("raise") == point and at("raise_index"):
            emit({"event": "raising", "point": point, "room": room, "index": index})
            raise InjectedFault(f"conformance: injected failure at {point} of room {room}")

    @hookimpl
    def on_dequeue(self, chunk: Chunk) -> None:
        self._point("dequeue", chunk.room, chunk.index)

    @hookimpl
    def on_skip(self, chunk: Chunk) -> None:
        self._point("skip", chunk.room, chunk.index)

    @hookimpl(wrapper=True)
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> Generator[None, object, object]:
        self._point("before_post", chunk.room, chunk.index)
        result = yield
        self._point("after_post", chunk.room, chunk.index)
        return result

    @hookimpl(wrapper=True)
    def on_done_barrier(
        self, chunk: Chunk, posted: object, deadline: float
    ) -> Generator[None, object, object]:
        self._point("before_barrier", chunk.room, chunk.index)
        result = yield
        settlement = result.value if isinstance(result, Settlement) else repr(result)
        self._point("after_barrier", chunk.room, chunk.index, settlement=settlement)
        return result

    @hookimpl(wrapper=True)
    def on_abort_notification(self, abort: Abort, known: bool) -> Generator[None, object, object]:
        self._point("abort", abort.room, -1, generation=abort.generation)
        try:
            return (yield)
        finally:  # the transport has seen it (``await_abort`` waits for this)
            with self._abort_seen:
                self._aborted.add(abort.room)
                self._abort_seen.notify_all()

    @hookimpl(wrapper=True)
    def on_fence(self) -> Generator[None, object, object]:
        emit({"event": "fencing"})
        for rule in self.spec.values():
            if "fencing" in self._stops(rule):
                emit({"event": "stopping", "point": "fencing"})
                stop_self()
                break
        result = yield
        emit({"event": "fenced", "result": result is True})
        for rule in self.spec.values():
            if "fenced" in self._stops(rule):
                emit({"event": "stopping", "point": "fenced", "result": result is True})
                stop_self()
                if result is True:
                    self._hold(rule, "fenced")
                break
        return result

    @staticmethod
    def _hold(rule: dict[str, Any], point: str) -> None:
        """Resumed after a stop: the transport's threads run on while the
        hook holds its answer back from the core (no ack, no release)."""
        hold_s = float(rule.get("hold_s", 0.0))
        if rule.get("hold") == point and hold_s > 0:
            emit({"event": "holding", "hold_s": hold_s})
            time.sleep(hold_s)


def main() -> None:
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    args = load_args(sys.argv[1])
    driver = Driver(args)
    driver.rank.pm.register(Faults(args.get("faults", {})), name="conformance-faults")
    emit({"event": "ready", "address": driver.rank.address, "pid": os.getpid()})
    sys.stdin.read()  # serve until the parent closes our stdin
    driver.rank.close()


if __name__ == "__main__":
    main()
