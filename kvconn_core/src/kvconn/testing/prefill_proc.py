"""A self-driving prefill rank process.

When decode asks for a room, the rank fills its source pages with the room's
pattern and sends them in chunks, as an engine would after a forward pass.
Run as ``python -m kvconn.testing.prefill_proc ARGS_JSON``; it prints its
control address as one JSON line on stdout, then serves until stdin closes.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import threading
import time
from collections import deque
from typing import Any

from kvconn.bench.cpu import CallTimer
from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.prefill import PrefillRank, Sender
from kvconn.testing.kvpattern import EngineShape, fill_page
from kvconn.testing.patterns import shard_bytes


class Driver:
    """Feeds rooms to a :class:`PrefillRank` like a prefill engine."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.chunk_pages = int(args.get("chunk_pages", 4))
        self.chunk_gap_s = float(args.get("chunk_gap_s", 0.0))
        self.fail_fraction = float(args.get("prefill_fail_fraction", 0.0))
        self.seed = int(args.get("seed", 0))
        self.num_ranks = int(args["num_ranks"])
        self.rank_id = int(args["rank"])
        #: With ``engine`` (an EngineShape's arguments) the rank sends from
        #: per-layer numpy buffers it registers, as an engine's KV cache.
        self.shape = EngineShape.from_args(args["engine"]) if "engine" in args else None
        if self.shape is not None:
            self.layout = self.shape.layout(self.num_ranks, self.rank_id)
            self.arrays = self.shape.buffers(self.num_ranks)
            self.page_bytes = self.shard = 0
            self.source_pages = self.shape.pages
        else:
            self.page_bytes = int(args["page_bytes"])
            self.shard = self.page_bytes // self.num_ranks
            self.source_pages = int(args.get("source_pages", 256))
        config = Config(
            write_timeout_s=float(args.get("write_timeout_s", 5.0)),
            abort_timeout_s=float(args.get("abort_timeout_s", 30.0)),
            acks_enabled=bool(args.get("acks_enabled", True)),
            workers=int(args.get("workers", 1)),
            host=str(args.get("host", "127.0.0.1")),
            auth_key=bytes.fromhex(args["auth_key"]) if args.get("auth_key") else None,
            backend_options=dict(args.get("backend_options", {})),
            gil_switch_interval_s=args.get("gil_switch_interval_s"),
            tracing=bool(args.get("tracing", False)),
            metrics_port=args.get("metrics_port"),
        )
        self._jobs: list[tuple[int, int]] = []
        self._cond = threading.Condition()
        if self.shape is not None:
            self.rank = PrefillRank(
                get_backend(args["backend"]),
                self.rank_id,
                None,
                config,
                on_request=self._on_request,
                buffers=self.arrays,
                layout=self.layout,
            )
        else:
            self.rank = PrefillRank(
                get_backend(args["backend"]),
                self.rank_id,
                self.source_pages * self.shard,
                config,
                on_request=self._on_request,
            )
        self._next_src = 0
        self._inflight: deque[tuple[Sender, int, int]] = deque()
        #: kvconn's calls on the driver's (the engine's) thread, timed
        self.calls = CallTimer()
        #: When decode asked for each room not yet known settled (unsettled()).
        self._asked: dict[int, float] = {}
        #: Senders of the rooms taken off the queue, until settled.
        self._senders: dict[int, Sender] = {}
        threading.Thread(target=self._feed, daemon=True, name="kvconn-driver").start()

    def _on_request(self, room: int, npages: int) -> None:
        with self._cond:
            self._jobs.append((room, npages))
            self._asked.setdefault(room, time.monotonic())
            self._cond.notify()

    def unsettled(self) -> list[tuple[int, float]]:
        """(room, seconds since decode asked for it) of every room this rank
        still works on: queued, being sent, or with chunks not yet settled
        (the prefill half of a request; one that never settles has hung)."""
        now = time.monotonic()
        with self._cond:
            queued = {room for room, _ in self._jobs}
            asked, senders = dict(self._asked), dict(self._senders)
        out = []
        for room, at in asked.items():
            sender = senders.get(room)
            if room in queued or sender is None or not sender.settled():
                out.append((room, now - at))
            else:
                self._forget(room)
        return out

    def _forget(self, room: int) -> None:
        with self._cond:
            self._asked.pop(room, None)
            self._senders.pop(room, None)

    def _feed(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                room, npages = self._jobs.pop(0)
            try:
                self._send_room(room, npages)
            except Exception:
                logging.exception("driver failed on room %d", room)

    def _alloc(self, n: int) -> int:
        """``n`` contiguous source pages, once the rooms that used them settled."""
        if n > self.source_pages:
            raise ValueError(f"a room of {n} pages does not fit {self.source_pages} source pages")
        if self._next_src + n > self.source_pages:
            self._next_src = 0
        first = self._next_src
        self._next_src += n
        deadline = time.monotonic() + 120
        while len(self._inflight) > 64 or any(lo < first + n and first < hi for _, lo, hi in self._inflight):
            sender = self._inflight[0][0]
            while not self.calls(sender.settled):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"room {sender.room} never settled")
                time.sleep(0.0005)
            self.calls(sender.clear)
            self._inflight.popleft()
            self._forget(sender.room)
        return first

    def _send_room(self, room: int, npages: int) -> None:
        sender = self.calls(self.rank.sender, room)
        with self._cond:
            self._senders[room] = sender
        if self.calls(sender.poll) is KVPoll.BOOTSTRAPPING:
            # The request was aborted before we got to it. Kept, the sender
            # would take the next decode's request for the id (prefill TP
            # smaller than decode TP) and never send it: the rooms behind
            # it would wait for it to settle for good.
            self._forget(room)
            return
        rng = random.Random(room ^ (self.seed << 1) ^ self.rank_id)
        fail_at = rng.randrange(npages) if rng.random() < self.fail_fraction else -1
        first = self._alloc(npages)
        self._inflight.append((sender, first, first + npages))
        sent = 0
        while sent < npages:
            n = min(self.chunk_pages, npages - sent)
            if fail_at >= 0 and sent <= fail_at < sent + n:
                self.calls(sender.fail, "prefill-initiated failure (injected)")
                break
            src = list(range(first + sent, first + sent + n))
            last = sent + n == npages
            extras_slot = None
            if self.shape is not None and self.shape.extras_bytes and last:
                extras_slot = room % self.shape.extras_slots
                self.shape.fill_extras(self.arrays, room, extras_slot)
            for i, page in zip(range(sent, sent + n), src, strict=True):
                if self.shape is not None:
                    fill_page(self.shape, self.layout, self.arrays, room, i, page)
                else:
                    self.rank.writer.write(page * self.shard, shard_bytes(room, self.rank_id, i, self.shard))
            self.calls(sender.send, src, last=last, extras_slot=extras_slot)
            sent += n
            if self.chunk_gap_s:
                time.sleep(self.chunk_gap_s)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = json.loads(sys.argv[1])
    driver = Driver(args)
    print(json.dumps({"address": driver.rank.address}), flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin
    driver.rank.close()


if __name__ == "__main__":
    main()
