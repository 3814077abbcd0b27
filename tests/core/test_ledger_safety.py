"""The ledger's safety consequences, asserted directly (issue 25).

Each test here names the plausible bug it kills. A bug must show as the
consequence the protocol forbids (an ack while a counted chunk can still be
written, an ack target lost, a chunk written into an aborted room), not as a
crash further on: a defensive ``.get()`` would hide a crash.
"""

from __future__ import annotations

from kvconn.protocol.ledger import KVPoll, LedgerAction, RoomKey, RoomLedger, SendAck
from kvconn.protocol.messages import Abort

ROOM = 1
A, B = "decode-a", "decode-b"
KEY = RoomKey(A, ROOM)  #: decode a's room (the ledger keys rooms by (decode, room))


def send_abort(ledger: RoomLedger, decode: str, generation: int = 1) -> list[LedgerAction]:
    """The runtime's two steps for an ABORT: register it, then one try."""
    ledger.abort(Abort(ROOM, generation, decode, f"tcp://{decode}"), now=0.0)
    return ledger.try_ack(RoomKey(decode, ROOM))


def acked(actions: list[LedgerAction]) -> list[tuple[str, str, int]]:
    """(reply address, decode named in the ack, generation) of every ack."""
    return sorted((a.reply_to, a.ack.decode, a.ack.generation) for a in actions if isinstance(a, SendAck))


def writing(ledger: RoomLedger, chunks: int = 1, decode: str = A) -> None:
    ledger.request(RoomKey(decode, ROOM))
    for _ in range(chunks):
        assert ledger.dequeue(RoomKey(decode, ROOM)) is True


# -- two decodes' ABORTs pending on the same room id --------------------------
# One rank serves one room id to two decodes (prefill TP < decode TP): each
# decode's room is its own (decode, room) entry, with its own count and target.


def test_two_decodes_aborts_pending_at_once_are_both_acked() -> None:
    """Both decodes abort while each has a chunk in flight. Kills a ledger
    keeping one ack target per room id, whose later abort overwrites the
    earlier one: a would sit in quarantine."""
    ledger = RoomLedger(rank=0)
    writing(ledger, decode=A)
    writing(ledger, decode=B)
    assert send_abort(ledger, A, generation=3) == []  # a's chunk may land
    assert send_abort(ledger, B, generation=3) == []  # same generation number, other decode
    assert acked(ledger.landed(RoomKey(A, ROOM), last=False)) == [(f"tcp://{A}", A, 3)]
    assert acked(ledger.landed(RoomKey(B, ROOM), last=False)) == [(f"tcp://{B}", B, 3)]
    # each (decode, generation) at most once: duplicates ack nothing more
    assert send_abort(ledger, A, generation=3) == [] and send_abort(ledger, B, generation=3) == []


def test_a_decode_is_acked_on_its_own_count_not_the_other_decodes() -> None:
    """b's room drained, a's chunk still in flight: both abort. Only b is
    acked now; a waits for its own chunk (S1 for a)."""
    ledger = RoomLedger(rank=0)
    writing(ledger, decode=A)
    ledger.request(RoomKey(B, ROOM))
    assert send_abort(ledger, A) == []
    assert acked(send_abort(ledger, B)) == [(f"tcp://{B}", B, 1)]
    assert acked(ledger.landed(RoomKey(A, ROOM), last=False)) == [(f"tcp://{A}", A, 1)]


def test_a_second_decodes_abort_keeps_the_firsts_reply_address() -> None:
    """Kills a target table that stores the newest reply address for every
    decode: each ack goes where its own decode asked."""
    ledger = RoomLedger(rank=0)
    writing(ledger, decode=A)
    writing(ledger, decode=B)
    ledger.abort(Abort(ROOM, 1, A, "tcp://a-reply"), now=0.0)
    ledger.abort(Abort(ROOM, 1, B, "tcp://b-reply"), now=0.0)
    assert acked(ledger.landed(RoomKey(A, ROOM), last=False)) == [("tcp://a-reply", A, 1)]
    assert acked(ledger.landed(RoomKey(B, ROOM), last=False)) == [("tcp://b-reply", B, 1)]


def test_a_resent_abort_replaces_only_its_own_decodes_older_generation() -> None:
    """The one case left of two ABORTs pending on one (decode, room): while
    nothing may be acked, decode a re-sends (generation 2, from quarantine)
    and decode b aborts its own room: a is acked once, for its newest
    generation, and b for its own."""
    ledger = RoomLedger(rank=0)
    writing(ledger, decode=A)
    writing(ledger, decode=B)
    send_abort(ledger, A, generation=1)
    send_abort(ledger, B, generation=7)
    send_abort(ledger, A, generation=2)
    send_abort(ledger, A, generation=1)  # a reordered, older ABORT changes nothing
    assert acked(ledger.landed(RoomKey(A, ROOM), last=False)) == [(f"tcp://{A}", A, 2)]
    assert acked(ledger.landed(RoomKey(B, ROOM), last=False)) == [(f"tcp://{B}", B, 7)]


# -- counting: no ack while a counted chunk still waits ------------------------


def test_a_second_dequeued_chunk_keeps_the_room_unacked() -> None:
    """Kills a dequeue that assigns the count (``outstanding = 1``) instead of
    adding to it: two chunks were taken, the ack waits for both."""
    ledger = RoomLedger(rank=0)
    writing(ledger, chunks=2)
    assert ledger.outstanding(KEY) == 2
    assert send_abort(ledger, A) == []
    assert acked(ledger.landed(KEY, last=False)) == []  # the other chunk can still land
    assert acked(ledger.landed(KEY, last=False)) == [(f"tcp://{A}", A, 1)]


def test_a_fence_settles_only_the_stuck_chunks_not_the_waiting_ones() -> None:
    """A chunk failed unsettled (the room is poisoned) while another chunk of
    the room was dequeued and waits at the fence gate to be posted. The fence
    proves the first one can no longer land, not the second. Kills a fence
    that zeroes the room's whole count."""
    ledger = RoomLedger(rank=0)
    writing(ledger, chunks=2)
    ledger.failed(KEY, settled=False, reason="handle error")
    assert send_abort(ledger, A) == []
    assert acked(ledger.fenced()) == []  # the waiting chunk is still counted
    assert ledger.outstanding(KEY) == 1 and ledger.in_flight(KEY) == 1
    assert acked(ledger.landed(KEY, last=False)) == [(f"tcp://{A}", A, 1)]


def test_a_poison_adds_to_the_count_of_a_chunk_in_flight() -> None:
    """A hook raised for a room with a chunk still being written. Kills a
    poison that assigns the count (``outstanding = 1``): the fence would then
    uncount the chunk in flight too and ack while it can land."""
    ledger = RoomLedger(rank=0)
    writing(ledger)
    ledger.poison(KEY, "a hook raised")
    assert ledger.outstanding(KEY) == 2
    assert send_abort(ledger, A) == []
    assert acked(ledger.fenced()) == []  # the chunk in flight is not the fence's to settle
    assert acked(ledger.landed(KEY, last=False)) == [(f"tcp://{A}", A, 1)]


def test_two_stuck_chunks_are_both_settled_by_the_fence() -> None:
    """Kills a failure or poison that assigns the stuck count instead of
    adding to it: the fence would settle one of two stuck chunks and the
    room would never be acked (decode quarantines it for nothing)."""
    ledger = RoomLedger(rank=0)
    writing(ledger, chunks=1)
    ledger.failed(KEY, settled=False, reason="handle error")
    ledger.poison(KEY, "a hook raised")
    assert (ledger.outstanding(KEY), ledger.in_flight(KEY)) == (2, 0)
    assert send_abort(ledger, A) == []
    assert acked(ledger.fenced()) == [(f"tcp://{A}", A, 1)]
    assert ledger.outstanding(KEY) == 0 and ledger.poisoned() == frozenset()


def test_a_settled_failure_uncounts_one_chunk_only() -> None:
    """Kills a settled failure that clears the count: its sibling, still
    being written, keeps the room unacked."""
    ledger = RoomLedger(rank=0)
    writing(ledger, chunks=2)
    assert send_abort(ledger, A) == []
    assert acked(ledger.failed(KEY, settled=True, reason="handle error")) == []
    assert acked(ledger.landed(KEY, last=False)) == [(f"tcp://{A}", A, 1)]


def test_a_skipped_chunk_uncounts_one_chunk_only() -> None:
    ledger = RoomLedger(rank=0)
    writing(ledger)
    ledger.abort(Abort(ROOM, 1, A, f"tcp://{A}"), now=0.0)
    assert ledger.dequeue(KEY) is False  # counted, then skipped
    assert acked(ledger.skipped(KEY)) == []  # the first chunk can still land
    assert acked(ledger.landed(KEY, last=False)) == [(f"tcp://{A}", A, 1)]


# -- invariant F: abort() alone marks the room Failed -------------------------


def test_abort_alone_stops_the_next_chunk_before_its_try() -> None:
    """The runtime takes its lock twice for an ABORT: abort(), a hook, then
    try_ack(). A worker's dequeue can run in between; it must already find the
    room Failed and skip. Kills an abort() that registers the target and
    leaves marking Failed to try_ack()."""
    ledger = RoomLedger(rank=0)
    writing(ledger)
    ledger.abort(Abort(ROOM, 1, A, f"tcp://{A}"), now=0.0)
    assert ledger.status(KEY) is KVPoll.FAILED
    assert ledger.dequeue(KEY) is False  # not written into the aborted room
    assert acked(ledger.skipped(KEY)) == []
    assert acked(ledger.try_ack(KEY)) == []  # the first chunk is still in flight
    assert acked(ledger.landed(KEY, last=True)) == [(f"tcp://{A}", A, 1)]
    assert ledger.status(KEY) is KVPoll.FAILED  # a last chunk landing after the abort is no success


def test_abort_of_an_unknown_room_fails_it_before_the_request_comes() -> None:
    ledger = RoomLedger(rank=0)
    ledger.abort(Abort(ROOM, 1, A, f"tcp://{A}"), now=0.0)
    assert ledger.status(KEY) is KVPoll.FAILED
    ledger.request(RoomKey(A, ROOM))
    assert ledger.dequeue(KEY) is False
