"""Broken variants of the protocol core, each one change the brief says must
break safety. The explorer has to catch every one of them; if it ever stops
catching one, it has gone blind to that bug."""

from __future__ import annotations

from kvconn.protocol.hold import Dropped, HoldAction, HoldTracker
from kvconn.protocol.ledger import KVPoll, LedgerAction, RoomLedger, _Room
from kvconn.protocol.messages import Abort, AbortAck


class NoDequeueCount(RoomLedger):
    """Invariant D deleted: a dequeued chunk is never counted."""

    def dequeue(self, room: int) -> bool:
        write = super().dequeue(room)
        self._rooms[room].outstanding -= 1
        return write

    def _adjust(self, room: int) -> None:
        self._rooms[room].outstanding += 1  # undo the settle's decrement

    def skipped(self, room: int) -> list[LedgerAction]:
        self._adjust(room)
        return super().skipped(room)

    def landed(self, room: int, last: bool) -> list[LedgerAction]:
        self._adjust(room)
        return super().landed(room, last)

    def failed(self, room: int, settled: bool, reason: str) -> list[LedgerAction]:
        if settled:
            self._adjust(room)
        return super().failed(room, settled, reason)


class CountAfterCheck(RoomLedger):
    """Invariant D moved: the status check decides, the count comes later
    (when the worker posts), so an ABORT can slip in between."""

    def dequeue(self, room: int) -> bool:
        entry = self._rooms.setdefault(room, _Room(cleared=True))
        if entry.status == KVPoll.FAILED or entry.cleared or entry.status < KVPoll.WAITING_FOR_INPUT:
            entry.outstanding += 1  # skipped chunks are settled through skipped()
            return False
        entry.status = KVPoll.TRANSFERRING
        return True

    def count_at_post(self, room: int) -> None:
        self._rooms[room].outstanding += 1


class AckClearedIgnoringCount(RoomLedger):
    """A cleared (concluded) room is acked without looking at its count."""

    def _try_ack(self, room: int, entry: _Room) -> list[LedgerAction]:
        if entry.cleared and entry.status == KVPoll.FAILED and entry.outstanding and entry.targets:
            saved, entry.outstanding, entry.stuck = (entry.outstanding, entry.stuck), 0, 0
            try:
                return super()._try_ack(room, entry)
            finally:
                entry.outstanding, entry.stuck = saved
        return super()._try_ack(room, entry)


class ErrAlwaysUncounts(RoomLedger):
    """An ERR with sibling writes still in flight uncounts like a settled one."""

    def failed(self, room: int, settled: bool, reason: str) -> list[LedgerAction]:
        return super().failed(room, True, reason)


class AckUnknownAtOnce(RoomLedger):
    """An ABORT for a room never seen here is acked at once, no tombstone."""

    _pending_ack: tuple[str, AbortAck] | None = None

    @property
    def mutant_state(self) -> object:
        return self._pending_ack

    def abort(self, msg: Abort, now: float) -> bool:
        if msg.room not in self._rooms:
            ack = AbortAck(msg.room, self.rank, msg.generation, False, msg.decode)
            self._pending_ack = (msg.reply_to, ack)
            return False
        return super().abort(msg, now)

    def try_ack(self, room: int) -> list[LedgerAction]:
        from kvconn.protocol.ledger import SendAck

        pending = self._pending_ack
        if pending is not None and pending[1].room == room:
            self._pending_ack = None
            return [SendAck(pending[0], pending[1])]
        return super().try_ack(room)


class RegisterBeforeFailed(RoomLedger):
    """Invariant F reversed: abort() registers the target on a room still
    taking chunks; Failed is marked only in the following try_ack() step."""

    def abort(self, msg: Abort, now: float) -> bool:
        entry = self._rooms.setdefault(msg.room, _Room(expires=now + self.tombstone_ttl))
        entry.targets[msg.decode] = (msg.reply_to, msg.generation)
        return True

    def try_ack(self, room: int) -> list[LedgerAction]:
        entry = self._rooms.get(room)
        if entry is not None:
            self._mark_failed(room, entry, "aborted by decode", notify=False)
        return super().try_ack(room)


class RegisterBeforeFailedNoGuard(RegisterBeforeFailed):
    """F reversed *and* the ack no longer demands Failed: the brief's point
    that the two guards cover for each other, and losing both is unsafe."""

    def _try_ack(self, room: int, entry: _Room) -> list[LedgerAction]:
        if entry.outstanding or entry.stuck or not entry.targets:
            return []
        saved, entry.status = entry.status, KVPoll.FAILED
        try:
            return super()._try_ack(room, entry)
        finally:
            entry.status = saved


class OneAckTargetPerRoom(RoomLedger):
    """A newer ABORT of a room overwrites its ack target, whichever decode
    sent it: with two decodes' ABORTs pending, the first is never acked."""

    def abort(self, msg: Abort, now: float) -> bool:
        known = super().abort(msg, now)
        entry = self._rooms[msg.room]
        if msg.decode in entry.targets:
            entry.targets = {msg.decode: entry.targets[msg.decode]}
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
    "AckClearedIgnoringCount",
    "AckUnknownAtOnce",
    "CountAfterCheck",
    "Dropped",
    "ErrAlwaysUncounts",
    "NoDequeueCount",
    "OneAckTargetPerRoom",
    "RegisterBeforeFailed",
    "RegisterBeforeFailedNoGuard",
]
