"""``RoomLedger.expire`` visits only rooms touched since its last call and the
ones due, instead of every remembered room (thousands of acked rooms wait out
their TTL, and it runs on every control message). Hypothesis drives it and a
reference ledger that scans every room, as ``expire`` did before, through
the same random stimuli: statuses and actions must never differ."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvconn.protocol.ledger import LedgerAction, RoomKey, RoomLedger, _expirable
from kvconn.protocol.messages import Abort

#: Two decodes naming the same room ids: each (decode, room) is its own room.
KEYS = [RoomKey(decode, room) for decode in ("decode-a", "decode-b") for room in range(3)]
ROOMS = st.sampled_from(KEYS)
TTL = 10.0


class ScanningLedger(RoomLedger):
    """The reference: every call walks every room, and every tombstone is a
    full entry."""

    _compact_tombstones = False

    def expire(self, now: float) -> list[RoomKey]:
        forgotten = []
        for room, entry in list(self._rooms.items()):
            if not _expirable(entry):
                continue
            if entry.expires is None:
                entry.expires = now + self.tombstone_ttl
            elif entry.expires <= now:
                self._drop(room)
                forgotten.append(room)
        return forgotten


class SameAsScanning(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.fast = RoomLedger(0, TTL)
        self.ref = ScanningLedger(0, TTL)
        self.now = 0.0
        self.generation = 0
        self.writing: dict[RoomKey, list[bool]] = {}  # room -> dequeued chunks: written or skipped

    def both(self, name: str, *args: object) -> list[LedgerAction] | None:
        got = getattr(self.fast, name)(*args)
        want = getattr(self.ref, name)(*args)
        if name == "expire":  # the same rooms, in heap order vs dict order
            got, want = sorted(got), sorted(want)
        assert got == want, f"{name}{args}: {got} != {want}"
        return got  # type: ignore[no-any-return]

    @rule(room=ROOMS)
    def request(self, room: RoomKey) -> None:
        self.both("request", room)

    @rule(room=ROOMS)
    def clear(self, room: RoomKey) -> None:
        self.both("clear", room)

    @rule(room=ROOMS)
    def fail(self, room: RoomKey) -> None:
        self.both("fail", room, "engine gave up")

    @rule(room=ROOMS)
    def poison(self, room: RoomKey) -> None:
        self.both("poison", room, "plugin raised")

    @rule(room=ROOMS)
    def dequeue(self, room: RoomKey) -> None:
        write = self.both("dequeue", room)
        self.writing.setdefault(room, []).append(bool(write))

    @precondition(lambda self: any(self.writing.values()))
    @rule(data=st.data(), outcome=st.sampled_from(["landed", "settled", "unsettled"]), last=st.booleans())
    def settle(self, data: st.DataObject, outcome: str, last: bool) -> None:
        room = data.draw(st.sampled_from(sorted(r for r, chunks in self.writing.items() if chunks)))
        written = self.writing[room].pop(0)
        if not written:
            self.both("skipped", room)
        elif outcome == "landed":
            self.both("landed", room, last)
        else:
            self.both("failed", room, outcome == "settled", "transfer failed")

    @rule()
    def fenced(self) -> None:
        self.both("fenced")

    @rule(room=ROOMS, again=st.booleans())
    def abort(self, room: RoomKey, again: bool) -> None:
        if not again:
            self.generation += 1
        msg = Abort(room.room, max(self.generation, 1), room.decode, f"tcp://{room.decode}")
        self.both("abort", msg, self.now)
        self.both("try_ack", room)

    @rule(dt=st.sampled_from([0.0, 1.0, 4.0, 9.0, 10.0, 25.0]))
    def expire(self, dt: float) -> None:
        self.now += dt
        self.both("expire", self.now)

    @invariant()
    def same_rooms(self) -> None:
        if not hasattr(self, "fast"):
            return
        for room in KEYS:
            assert self.fast.status(room) == self.ref.status(room), room
            assert self.fast.outstanding(room) == self.ref.outstanding(room), room
        assert self.fast.poisoned() == self.ref.poisoned()


SameAsScanning.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestSameAsScanning = SameAsScanning.TestCase


def test_expire_leaves_remembered_rooms_alone() -> None:
    """A thousand acked rooms waiting out their TTL are not walked again: the
    heap holds each once and the touched set empties (forgotten in one call:
    a budget of a thousand, the default is smaller)."""
    ledger = RoomLedger(0, TTL, expire_budget=1000)
    for room in range(1000):
        key = RoomKey("decode-a", room)
        ledger.request(key)
        ledger.abort(Abort(room, 1, "decode-a", "tcp://decode-a"), 0.0)
        ledger.try_ack(key)
        ledger.clear(key)
    ledger.expire(0.0)
    assert len(ledger._expiry) == 1000 and not ledger._touched
    ledger.expire(5.0)
    assert len(ledger._expiry) == 1000 and ledger.status(RoomKey("decode-a", 999)) is not None
    assert sorted(ledger.expire(TTL)) == [RoomKey("decode-a", room) for room in range(1000)]
    assert not ledger._expiry and all(
        ledger.status(RoomKey("decode-a", room)) is None for room in range(1000)
    )
