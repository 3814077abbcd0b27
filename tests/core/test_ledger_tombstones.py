"""Tombstones at abort-storm scale: compact, forgotten a bounded amount at a
time, never early and never kept forever.

A tombstone is safety-relevant: an ABORT that came before its request must
refuse that request until the TTL. ``expire()`` now forgets at most a budget
of rooms per call, so these tests drive it with tiny budgets, where a bug in
the amortisation (a slot skipped, a deadline lost on promotion, a chunk
freed too soon) would show as a tombstone forgotten early or never.
"""

from __future__ import annotations

import gc
import math
import tracemalloc

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvconn.protocol.ledger import KVPoll, RoomKey, RoomLedger, SendAck
from kvconn.protocol.messages import Abort

TTL = 10.0
D = "decode-a"


def abort(ledger: RoomLedger, room: int, now: float, gen: int = 1, decode: str = D) -> list[SendAck]:
    ledger.abort(Abort(room, gen, decode, f"tcp://{decode}"), now)
    return [a for a in ledger.try_ack(RoomKey(decode, room)) if isinstance(a, SendAck)]


def storm(ledger: RoomLedger, rooms: int, now: float = 0.0, decodes: int = 3) -> list[RoomKey]:
    keys = []
    for room in range(rooms):
        decode = f"decode-{room % decodes}"
        assert len(abort(ledger, room, now + room * 1e-4, gen=room + 1, decode=decode)) == 1
        keys.append(RoomKey(decode, room))
    return keys


def drain(ledger: RoomLedger, now: float, calls: int) -> list[RoomKey]:
    forgotten: list[RoomKey] = []
    for _ in range(calls):
        forgotten += ledger.expire(now)
    return forgotten


def test_a_tombstone_refuses_its_request_until_the_ttl_with_a_tiny_budget() -> None:
    ledger = RoomLedger(0, TTL, expire_budget=7)
    keys = storm(ledger, 3000)
    last = 2999 * 1e-4
    for now in (0.0, 1.0, TTL - 1e-3):
        assert ledger.expire(now) == []
    # Many calls just before the last one falls due: only the due ones go.
    assert all(k.room < 2999 for k in drain(ledger, TTL + last - 1e-6, 1000))
    # A request for each remaining one is refused.
    for key in keys[-1:]:
        ledger.request(key, seq=1)
        assert ledger.status(key) is KVPoll.FAILED
        entry = ledger.entry(key)
        assert entry is not None and entry.tombstone


def test_every_tombstone_is_forgotten_within_its_share_of_calls() -> None:
    """Never forever: with a budget of B, N due tombstones are gone after
    ceil(N / B) calls, and nothing is left anywhere (the queue's chunks, the
    compact table)."""
    ledger = RoomLedger(0, TTL, expire_budget=64)
    keys = storm(ledger, 5000)
    assert ledger.expire(0.0) == []  # spends the storm's credit: nothing due
    forgotten = drain(ledger, TTL + 1.0, math.ceil(5000 / 64))
    assert sorted(forgotten) == sorted(keys)
    assert ledger.entries() == {} and len(ledger._expiry) == 0 and not ledger._tombs
    for key in keys[:3]:  # the ids are free again: a request is a new room
        ledger.request(key, seq=1)
        assert ledger.status(key) is KVPoll.WAITING_FOR_INPUT


def test_one_expire_forgets_at_most_its_budget_plus_what_was_scheduled_since() -> None:
    ledger = RoomLedger(0, TTL, expire_budget=100)
    storm(ledger, 2000)
    ledger.expire(0.0)
    assert len(ledger.expire(TTL + 1.0)) == 100
    storm(ledger, 50, now=TTL + 1.0)  # 50 new tombstones pay for 50 more
    assert len(ledger.expire(TTL + 1.0)) == 150


def test_a_tombstone_whose_ack_is_pending_at_its_deadline_stays_until_acked() -> None:
    """The ack is owed (a hook ran between abort and try_ack): the room is
    not idle, so its deadline passing forgets nothing."""
    ledger = RoomLedger(0, TTL, expire_budget=1)
    key = RoomKey(D, 5)
    ledger.abort(Abort(5, 1, D, f"tcp://{D}"), 0.0)
    assert ledger.expire(TTL + 1) == [] and ledger.expire(TTL + 2) == []
    assert ledger.status(key) is KVPoll.FAILED
    assert [a.ack.generation for a in ledger.try_ack(key) if isinstance(a, SendAck)] == [1]
    assert ledger.expire(TTL + 3) == [key]


def test_a_promoted_tombstone_keeps_its_deadline() -> None:
    """Looking at a compact tombstone makes it a full entry: the deadline it
    had is kept (not restarted, not lost)."""
    ledger = RoomLedger(0, TTL, expire_budget=1)
    keys = storm(ledger, 3, decodes=1)
    assert ledger.entry(keys[0]) is ledger.entry(keys[0])  # one object, as handles need
    assert ledger.decodes_of(1)[keys[1].decode] is ledger.entry(keys[1])
    assert ledger.expire(TTL - 1e-3) == []
    assert drain(ledger, TTL + 1.0, 3) == keys


def test_duplicate_aborts_of_a_compact_tombstone() -> None:
    ledger = RoomLedger(0, TTL)
    assert len(abort(ledger, 3, 0.0, gen=4)) == 1
    assert abort(ledger, 3, 1.0, gen=4) == []  # a duplicate: at most one ack each
    assert [a.ack.generation for a in abort(ledger, 3, 2.0, gen=6)] == [6]  # a newer one is acked
    assert abort(ledger, 3, 3.0, gen=6) == []
    assert ledger.expire(TTL - 1e-3) == []  # the first ABORT's deadline, not restarted
    assert ledger.expire(TTL) == [RoomKey(D, 3)]


def test_one_room_id_tombstoned_for_two_decodes() -> None:
    ledger = RoomLedger(0, TTL)
    assert len(abort(ledger, 3, 0.0, decode="a")) == 1
    assert len(abort(ledger, 3, 0.0, decode="b")) == 1
    assert sorted(ledger.decodes_of(3)) == ["a", "b"]
    assert sorted(ledger.expire(TTL)) == [RoomKey("a", 3), RoomKey("b", 3)]


def test_tombstone_memory_is_small_and_comes_back() -> None:
    """A storm's tombstones cost about 100-150 B each (a full entry is about
    1 KB) and, once expired, nothing of them stays allocated."""
    n = 20_000
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        ledger = RoomLedger(0, TTL)
        storm(ledger, n)
        held = tracemalloc.get_traced_memory()[0] - base
        ledger.expire(0.0)
        assert len(drain(ledger, TTL + n * 1e-4, n // ledger.expire_budget + 2)) == n
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held / n < 250, held / n
    assert after < 16 << 10, after


KEYS = [RoomKey(decode, room) for decode in ("decode-a", "decode-b") for room in range(4)]


class TombstonesNeverEarlyNorForever(RuleBasedStateMachine):
    """Random ABORTs (fresh, duplicated, newer), acks late or at once,
    promotions by looking, and expire() calls with a budget of 1-3: a
    tombstone is remembered (and refuses) until its deadline and while its
    ack is owed, and forgotten a bounded number of calls after."""

    @initialize(budget=st.integers(1, 3))
    def start(self, budget: int) -> None:
        self.ledger = RoomLedger(0, TTL, expire_budget=budget)
        self.now = 0.0
        self.gen = 0
        self.deadline: dict[RoomKey, float] = {}
        self.acked: dict[RoomKey, set[int]] = {}
        self.pending: dict[RoomKey, int] = {}  #: the generation whose ack is owed

    @rule(key=st.sampled_from(KEYS), ack_now=st.booleans(), again=st.booleans())
    def abort(self, key: RoomKey, ack_now: bool, again: bool) -> None:
        if not again:
            self.gen += 1
        gen = max(self.gen, 1)
        self.ledger.abort(Abort(key.room, gen, key.decode, "tcp://d"), self.now)
        self.deadline.setdefault(key, self.now + TTL)
        if gen not in self.acked.setdefault(key, set()) and self.pending.get(key, 0) < gen:
            self.pending[key] = gen
        if ack_now:
            self.try_ack(key)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def late_ack(self, data: st.DataObject) -> None:
        self.try_ack(data.draw(st.sampled_from(sorted(self.pending))))

    def try_ack(self, key: RoomKey) -> None:
        acks = [a.ack.generation for a in self.ledger.try_ack(key) if isinstance(a, SendAck)]
        want = self.pending.pop(key, None)
        assert acks == ([] if want is None else [want]), (key, acks, want)
        if want is not None:
            self.acked[key].add(want)

    @rule(key=st.sampled_from(KEYS), how=st.sampled_from(["entry", "decodes_of", "incarnation"]))
    def look(self, key: RoomKey, how: str) -> None:
        if how == "decodes_of":
            self.ledger.decodes_of(key.room)
        else:
            getattr(self.ledger, how)(key)

    @rule(dt=st.sampled_from([0.0, 0.5, 3.0, 9.9, 10.0, 30.0]))
    def expire(self, dt: float) -> None:
        self.now += dt
        for key in self.ledger.expire(self.now):
            assert key in self.deadline, f"{key} forgotten, never tombstoned"
            assert self.deadline.pop(key) <= self.now, f"{key} forgotten before its deadline"
            assert key not in self.pending, f"{key} forgotten with its ack owed"
            del self.acked[key]

    @invariant()
    def remembered_until_forgotten(self) -> None:
        if not hasattr(self, "ledger"):
            return
        for key in KEYS:
            assert (self.ledger.status(key) is KVPoll.FAILED) == (key in self.deadline), key

    def teardown(self) -> None:
        if not hasattr(self, "ledger"):
            return
        for key in sorted(self.pending):
            self.try_ack(key)
        self.now += TTL
        calls = len(self.deadline) + 1  # a budget of at least one each
        for _ in range(calls):
            self.expire(0.0)
        assert not self.deadline, f"kept past {calls} calls: {sorted(self.deadline)}"
        assert len(self.ledger._expiry) == 0 and not self.ledger._tombs


TombstonesNeverEarlyNorForever.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
TestTombstonesNeverEarlyNorForever = TombstonesNeverEarlyNorForever.TestCase


def test_the_tombstone_bench_runs_small() -> None:
    from kvconn.bench.tombstones import measure, report

    r = measure(rooms=3000, decodes=4, ttl=TTL)
    assert r["bytes_per_tombstone"] < 250 and r["mib_after_expiry"] < 0.05
    assert r["expire_calls"] >= 3000 // RoomLedger(0).expire_budget
    assert "worst single expire()" in report(r)
