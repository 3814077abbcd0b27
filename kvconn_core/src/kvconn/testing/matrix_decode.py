"""The decode process of the fault matrix (:mod:`kvconn.testing.scenarios`):
a decode endpoint over canary pages, and a client that sends it requests
the way an engine's users do, whatever the fault.

The client is open-loop: a request arrives every ``1 / rate`` s whether or
not the ones before it ended (users do not wait for a fault to clear). Each
request takes ``pages`` free pages (it waits for them while none are free,
as an engine's scheduler does), asks every rank for its room, and ends:

* ``answered``: every rank said SUCCESS and every byte is what the ranks
  write for that room (checked before the pages are handed back);
* ``failed``: the room failed with a reason (a rank down, restarted, a
  prefill failure), and so did one retry as a new room (the second
  prefill a router's retry or an engine's recompute pays for); a retry
  that answers makes the request ``answered`` and ``recomputed``;
* ``hung``: neither within ``bound_s`` of its arrival: the client gives up
  (aborts it) and says so;
* ``wrong``: SUCCESS, but some page did not hold the room's bytes (a late
  write of another room reached it): counted as corrupted, never answered.

Every page that is not in use holds the canary, so a write that lands in a
page after decode handed it back is found at the end (``final``).

Driven by JSON lines on stdin; reports JSON lines on stdout, each stamped
``t`` with CLOCK_MONOTONIC, which the parent shares::

    {"prefill": [addresses]}                     (first line) -> ready {address, segment}
    {"op": "start", "rate": R, "pages": N, "bound_s": B, "count": C}   C requests, R a second
    {"op": "stop"}                                  no more arrivals
    {"op": "busy", "seconds": S}                    a thread computes in Python meanwhile
    {"op": "idle", "timeout_s": S}                 -> idle {open}: every request ended
    {"op": "victim", "room": R, "pages": N}        -> opened {room, pages}
    {"op": "abort", "room": R}                     -> aborted {room}
    {"op": "landed", "room": R, "rank": r|null}    -> landed {room, bytes}
    {"op": "storm", "rooms": N, "pages": P}         -> storm {rooms}: opened, then aborted together
    {"op": "final"}                                -> final {late_pages, held}
    (as they happen) arrived {id}, request {id, outcome, reason, tries, arrived},
    corrupt {room, pages}, released {room, proof, pages, held_for}, held {pages},
    rank_down {rank, cause, reason, at}, rank_restarted {rank, at}

The rank-down events are read off the endpoint's actions as its carrier
runs them (the one place this reaches into the endpoint: a test needs to
know which rank was called down, and when, exactly).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvconn.config import Config
from kvconn.errors import KvconnError
from kvconn.plugins import get_backend
from kvconn.protocol.endpoint_events import Action, RankDown, RankRestarted
from kvconn.protocol.hold import Release
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint, Receiver
from kvconn.testing.child import busy, emit, load_args, quiet_interrupts
from kvconn.testing.pages import CanaryPages
from kvconn.testing.patterns import CANARY

#: Room ids of the client's requests start here (victims and storms use small ones).
FIRST_ROOM = 1 << 20
TICK_S = 0.005  #: how often the client looks at its requests
SAMPLE_S = 0.01  #: how often the pages held are sampled
TRIES = 2  #: a request and one retry


@attrs.define
class _Request:
    id: int
    arrived: float
    deadline: float
    tries: int = 0
    room: int = 0
    pages: list[int] = attrs.Factory(list)
    rx: Receiver | None = None
    first_reason: str = ""


class Client:
    """The open-loop client: one thread owns every request it made."""

    def __init__(self, endpoint: DecodeEndpoint, pages: CanaryPages, first_room: int = FIRST_ROOM) -> None:
        self.endpoint, self.pages = endpoint, pages
        self._lock = threading.Lock()
        self._open: list[_Request] = []
        #: A decode started anew counts from elsewhere: a rank may still hold
        #: the earlier process's rooms.
        self._next_room = first_room
        self._next_id = 0
        self._arriving = False
        self._left = 0
        self._period = 0.0
        self._npages = 0
        self._bound = 0.0
        self._next_arrival = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name="matrix-client")
        self._thread.start()

    def start(self, rate: float, npages: int, bound_s: float, count: int) -> None:
        with self._lock:
            self._period, self._npages, self._bound = 1.0 / rate, npages, bound_s
            self._next_arrival = time.monotonic()
            self._arriving, self._left = True, count

    def stop(self) -> None:
        with self._lock:
            self._arriving = False

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def _run(self) -> None:
        while True:
            time.sleep(TICK_S)
            with self._lock:
                now = time.monotonic()
                # A client frozen with decode finds its users' requests waiting
                # when it resumes: they arrived at their time, not at the resume.
                while self._arriving and self._left > 0 and self._next_arrival <= now:
                    self._open.append(
                        _Request(self._next_id, self._next_arrival, self._next_arrival + self._bound)
                    )
                    emit({"event": "arrived", "id": self._next_id, "at": self._next_arrival})
                    self._next_id += 1
                    self._left -= 1
                    self._next_arrival += self._period
                for request in list(self._open):
                    if self._step(request, now):
                        self._open.remove(request)

    def _step(self, request: _Request, now: float) -> bool:
        """One look at ``request``; True once it ended."""
        if request.rx is None:
            return self._try_open(request, now)
        state = request.rx.poll()
        if state is KVPoll.SUCCESS:
            wrong = self.pages.wrong_pattern(request.room, request.pages)
            self.pages.give_back(request.rx.finish())
            if wrong:
                emit({"event": "corrupt", "room": request.room, "pages": wrong})
                return self._end(request, "wrong", f"{len(wrong)} pages held another room's bytes")
            return self._end(request, "answered", request.first_reason)
        if state is KVPoll.FAILED:
            reason = request.rx.failure() or "failed without a reason"
            request.rx.abort()  # its pages come back through on_release, with proof
            request.rx = None
            request.first_reason = request.first_reason or reason
            if request.tries < TRIES and now < request.deadline:
                return self._try_open(request, now)
            return self._end(request, "failed", request.first_reason)
        if now >= request.deadline:
            request.rx.abort()
            return self._end(request, "hung", f"still transferring after {now - request.arrived:.2f} s")
        return False

    def _try_open(self, request: _Request, now: float) -> bool:
        if now >= request.deadline:
            if request.first_reason:  # it failed with a reason; its retry found no pages in time
                return self._end(request, "failed", request.first_reason)
            return self._end(request, "hung", f"no free pages for {now - request.arrived:.2f} s")
        if len(self.pages.free_pages()) < self._npages:
            return False  # the scheduler waits for pages
        taken, _ = self.pages.take(self._npages, fresh_first=True)
        room = self._next_room
        self._next_room += 1
        request.tries += 1
        try:
            rx = self.endpoint.receiver(room, taken)
        except KvconnError as exc:
            self.pages.untake(taken)
            request.first_reason = request.first_reason or f"{type(exc).__name__}: {exc}"
            if request.tries < TRIES:
                return False
            return self._end(request, "failed", request.first_reason)
        request.room, request.pages, request.rx = room, taken, rx
        return False

    def _end(self, request: _Request, outcome: str, reason: str) -> bool:
        emit(
            {
                "event": "request",
                "id": request.id,
                "room": request.room,
                "outcome": outcome,
                "reason": reason,
                "tries": request.tries,
                "arrived": request.arrived,
            }
        )
        return True


def watch_actions(endpoint: DecodeEndpoint, seen: Callable[[Action, float], None]) -> None:
    """Call ``seen(action, now)`` for every action the endpoint carries out,
    before it is carried out (under the endpoint's lock)."""
    carrier = endpoint._carrier
    run = carrier.run

    def watched(actions: Sequence[Action], now: float) -> list[Release]:
        for action in actions:
            seen(action, now)
        return run(actions, now)

    carrier.run = watched  # type: ignore[method-assign]


def _report_rank_events(action: Action, now: float) -> None:
    if isinstance(action, RankDown):
        emit(
            {
                "event": "rank_down",
                "rank": action.rank,
                "cause": action.cause,
                "reason": action.reason,
                "at": now,
            }
        )
    elif isinstance(action, RankRestarted):
        emit({"event": "rank_restarted", "rank": action.rank, "at": now})


def _sample_held(endpoint: DecodeEndpoint, stop: threading.Event) -> None:
    last = -1
    while not stop.wait(SAMPLE_S):
        held = endpoint.held_pages()
        if held != last:
            emit({"event": "held", "pages": held})
            last = held


class _Victims:
    """Rooms the parent opens and aborts itself (a fault's own room, a storm)."""

    def __init__(self, endpoint: DecodeEndpoint, pages: CanaryPages) -> None:
        self.endpoint, self.pages = endpoint, pages
        self.rooms: dict[int, tuple[Receiver, list[int]]] = {}

    def open(self, room: int, npages: int) -> list[int]:
        taken, _ = self.pages.take(npages, fresh_first=True)
        self.rooms[room] = (self.endpoint.receiver(room, taken), taken)
        return taken

    def landed(self, room: int, rank: int | None = None) -> int:
        """Bytes of the room's pages that are not canary (with ``rank``: of
        that rank's shard of its first page)."""
        pages = self.rooms[room][1]
        if rank is None:
            return sum(self.pages.dirty_bytes(p) for p in pages)
        shard = self.pages.shard
        data = self.pages.region.read(pages[0] * self.pages.page_bytes + rank * shard, shard)
        return len(data) - data.count(CANARY)

    def storm(self, first: int, rooms: int, npages: int, timeout_s: float = 10.0) -> int:
        """Open ``rooms`` rooms, wait (bounded) until bytes landed in each,
        abort them all at once; how many were aborted mid-transfer."""
        ids = [first + i for i in range(rooms)]
        for room in ids:
            self.open(room, npages)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(self.landed(r) for r in ids):
            time.sleep(0.002)
        mid = sum(1 for r in ids if self.rooms[r][0].poll() is KVPoll.TRANSFERRING)
        for room in ids:
            self.rooms[room][0].abort()
        return mid


def main() -> None:
    quiet_interrupts()
    logging.basicConfig(level=logging.CRITICAL, stream=sys.stderr)
    args = load_args(sys.argv[1])
    page_bytes, num_pages = int(args["page_bytes"]), int(args["num_pages"])
    prefill = json.loads(sys.stdin.readline())["prefill"]
    holder: list[CanaryPages] = []

    def on_release(release: Release) -> None:
        holder[0].give_back(release.pages)  # canary first, then free: checked for late writes
        emit(
            {
                "event": "released",
                "room": release.room,
                "proof": release.proof.value,
                "pages": len(release.pages),
                "held_for": release.held_for,
            }
        )

    endpoint = DecodeEndpoint(
        get_backend(args["backend"]),
        num_pages,
        page_bytes,
        list(prefill),
        Config(**args["config"]),
        on_release=on_release,
    )
    watch_actions(endpoint, _report_rank_events)
    pages = CanaryPages(endpoint.region, num_pages, page_bytes, int(args["num_ranks"]))
    holder.append(pages)
    client = Client(endpoint, pages, int(args.get("first_room", FIRST_ROOM)))
    victims = _Victims(endpoint, pages)
    stop = threading.Event()
    threading.Thread(target=_sample_held, args=(endpoint, stop), daemon=True, name="matrix-held").start()
    emit({"event": "ready", "address": endpoint.address, "segment": endpoint.region.metadata.decode()})
    for line in sys.stdin:
        _command(json.loads(line), client, victims, endpoint, pages)
    stop.set()
    endpoint.close()


def _command(
    cmd: dict[str, Any], client: Client, victims: _Victims, endpoint: DecodeEndpoint, pages: CanaryPages
) -> None:
    op = cmd["op"]
    if op == "start":
        client.start(float(cmd["rate"]), int(cmd["pages"]), float(cmd["bound_s"]), int(cmd["count"]))
    elif op == "stop":
        client.stop()
    elif op == "busy":
        busy(float(cmd["seconds"]))
    elif op == "idle":
        deadline = time.monotonic() + float(cmd["timeout_s"])
        while client.open_count() and time.monotonic() < deadline:
            time.sleep(0.01)
        emit({"event": "idle", "open": client.open_count()})
    elif op == "victim":
        emit({"event": "opened", "room": cmd["room"], "pages": victims.open(cmd["room"], int(cmd["pages"]))})
    elif op == "abort":
        victims.rooms[cmd["room"]][0].abort()
        emit({"event": "aborted", "room": cmd["room"]})
    elif op == "landed":
        emit({"event": "landed", "room": cmd["room"], "bytes": victims.landed(cmd["room"], cmd.get("rank"))})
    elif op == "storm":
        mid = victims.storm(int(cmd["first"]), int(cmd["rooms"]), int(cmd["pages"]))
        emit({"event": "storm", "rooms": int(cmd["rooms"]), "mid_transfer": mid})
    elif op == "final":
        # Pages handed back whose canary changed: a write landed after release.
        emit(
            {
                "event": "final",
                "late_pages": pages.changed(pages.returned_pages()),
                "held": endpoint.held_pages(),
            }
        )
    else:
        raise ValueError(f"unknown op {op!r}")


if __name__ == "__main__":
    main()
