"""Broken variants of the protocol core, each one change the brief says must
break safety. The explorer has to catch every one of them; if it ever stops
catching one, it has gone blind to that bug."""

from __future__ import annotations

from kvconn.protocol.hold import Dropped, HoldAction, HoldTracker
from kvconn.protocol.ledger import KVPoll, LedgerAction, RoomKey, RoomLedger, _Room
from kvconn.protocol.messages import Abort, AbortAck


class NoDequeueCount(RoomLedger):
    """Invariant D deleted: a dequeued chunk is never counted."""

    def dequeue(self, room: RoomKey, incarnation: int | None = None) -> bool:
        write = super().dequeue(room, incarnation)
        self._rooms[room].outstanding -= 1
        return write

    def _adjust(self, room: RoomKey) -> None:
        self._rooms[room].outstanding += 1  # undo the settle's decrement

    def skipped(self, room: RoomKey) -> list[LedgerAction]:
        self._adjust(room)
        return super().skipped(room)

    def landed(self, room: RoomKey, last: bool) -> list[LedgerAction]:
        self._adjust(room)
        return super().landed(room, last)

    def failed(self, room: RoomKey, settled: bool, reason: str) -> list[LedgerAction]:
        if settled:
            self._adjust(room)
        return super().failed(room, settled, reason)


class CountAfterCheck(RoomLedger):
    """Invariant D moved: the status check decides, the count comes later
    (when the worker posts), so an ABORT can slip in between."""

    def dequeue(self, room: RoomKey, incarnation: int | None = None) -> bool:
        entry = self._rooms.setdefault(room, _Room(cleared=True))
        if entry.status == KVPoll.FAILED or entry.cleared or entry.status < KVPoll.WAITING_FOR_INPUT:
            entry.outstanding += 1  # skipped chunks are settled through skipped()
            return False
        entry.status = KVPoll.TRANSFERRING
        return True

    def count_at_post(self, room: RoomKey) -> None:
        self._rooms[room].outstanding += 1


class DequeueIgnoresIncarnation(RoomLedger):
    """A chunk queued for a room's earlier request is written into the
    request that reused the id (the earlier request's pages, long released)."""

    def dequeue(self, room: RoomKey, incarnation: int | None = None) -> bool:
        return super().dequeue(room)


class ReuseFailedRoomAtOnce(RoomLedger):
    """A new request replaces a Failed room without waiting for it to drain."""

    def request(self, room: RoomKey, seq: int = 0) -> None:
        entry = self._rooms.get(room)
        if entry is not None and entry.status == KVPoll.FAILED and seq > entry.seq:
            self._drop(room)
        super().request(room, seq)


class AckClearedIgnoringCount(RoomLedger):
    """A cleared (concluded) room is acked without looking at its count."""

    def _try_ack(self, room: RoomKey, entry: _Room) -> list[LedgerAction]:
        if entry.cleared and entry.status == KVPoll.FAILED and entry.outstanding and entry.targets:
            saved, entry.outstanding, entry.stuck = (entry.outstanding, entry.stuck), 0, 0
            try:
                return super()._try_ack(room, entry)
            finally:
                entry.outstanding, entry.stuck = saved
        return super()._try_ack(room, entry)


class ErrAlwaysUncounts(RoomLedger):
    """An ERR with sibling writes still in flight uncounts like a settled one."""

    def failed(self, room: RoomKey, settled: bool, reason: str) -> list[LedgerAction]:
        return super().failed(room, True, reason)


class AckUnknownAtOnce(RoomLedger):
    """An ABORT for a room never seen here is acked at once, no tombstone."""

    _pending_ack: tuple[str, AbortAck] | None = None

    @property
    def mutant_state(self) -> object:
        return self._pending_ack

    def abort(self, msg: Abort, now: float) -> bool:
        if RoomKey(msg.decode, msg.room) not in self._rooms:
            ack = AbortAck(msg.room, self.rank, msg.generation, False, msg.decode)
            self._pending_ack = (msg.reply_to, ack)
            return False
        return super().abort(msg, now)

    def try_ack(self, room: RoomKey) -> list[LedgerAction]:
        from kvconn.protocol.ledger import SendAck

        pending = self._pending_ack
        if pending is not None and (pending[1].decode, pending[1].room) == room:
            self._pending_ack = None
            return [SendAck(pending[0], pending[1])]
        return super().try_ack(room)


class RegisterBeforeFailed(RoomLedger):
    """Invariant F reversed: abort() registers the target on a room still
    taking chunks; Failed is marked only in the following try_ack() step."""

    def abort(self, msg: Abort, now: float) -> bool:
        key = RoomKey(msg.decode, msg.room)
        entry = self._rooms.setdefault(key, _Room(decode=msg.decode, expires=now + self.tombstone_ttl))
        entry.targets[msg.decode] = (msg.reply_to, msg.generation)
        return True

    def try_ack(self, room: RoomKey) -> list[LedgerAction]:
        entry = self._rooms.get(room)
        if entry is not None:
            self._mark_failed(room, entry, "aborted by decode", notify=False)
        return super().try_ack(room)


class RegisterBeforeFailedNoGuard(RegisterBeforeFailed):
    """F reversed *and* the ack no longer demands Failed: the brief's point
    that the two guards cover for each other, and losing both is unsafe."""

    def _try_ack(self, room: RoomKey, entry: _Room) -> list[LedgerAction]:
        if entry.outstanding or entry.stuck or not entry.targets:
            return []
        saved, entry.status = entry.status, KVPoll.FAILED
        try:
            return super()._try_ack(room, entry)
        finally:
            entry.status = saved


class AckOnOtherDecodesCount(RoomLedger):
    """One room id served to two decodes: a decode's room is acked on the
    *other* decode's count (as if counts were per room id and the other
    decode's chunks were the only ones), while its own write can land."""

    def _try_ack(self, room: RoomKey, entry: _Room) -> list[LedgerAction]:
        others = [e for d, e in self._by_room.get(room.room, {}).items() if d != room.decode]
        if not others:
            return super()._try_ack(room, entry)
        saved = (entry.outstanding, entry.stuck)
        entry.outstanding, entry.stuck = others[0].outstanding, others[0].stuck
        try:
            return super()._try_ack(room, entry)
        finally:
            entry.outstanding, entry.stuck = saved


class OneAckTargetPerRoomId(RoomLedger):
    """Ack targets kept per room id rather than per (decode, room): a newer
    ABORT of the same id from another decode takes the older one's place, so
    with both decodes' ABORTs pending the first is never acked."""

    def abort(self, msg: Abort, now: float) -> bool:
        known = super().abort(msg, now)
        for decode, entry in self._by_room.get(msg.room, {}).items():
            if decode != msg.decode:
                entry.targets.clear()
        return known


class AcceptAnyGeneration(HoldTracker):
    """Decode accepts an ack whatever its generation."""

    def ack(self, msg: AbortAck, now: float) -> list[HoldAction]:
        entry = self._rooms.get(msg.room)
        if entry is not None:
            entry.generations.add(msg.generation)
        return super().ack(msg, now)


__all__ = [
    "AcceptAnyGeneration",
    "AckOnOtherDecodesCount",
    "AckClearedIgnoringCount",
    "AckUnknownAtOnce",
    "CountAfterCheck",
    "Dropped",
    "ErrAlwaysUncounts",
    "NoDequeueCount",
    "OneAckTargetPerRoomId",
    "RegisterBeforeFailed",
    "RegisterBeforeFailedNoGuard",
]
