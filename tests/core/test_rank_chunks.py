"""How a counted chunk's end, the writer's fence and a send's source pages
are decided by RankState: the transfer worker only reports what happened
and carries out the actions. Plain stimuli, no threads."""

from __future__ import annotations

import pytest

from kvconn.errors import ArgumentError, IncompleteRoomError, PageError
from kvconn.protocol.drain import Announce
from kvconn.protocol.ledger import FENCES_REMEMBERED, KVPoll, RoomKey, RoomLedger, SendAck
from kvconn.protocol.messages import Abort, TcpConnection, TransferRequest
from kvconn.protocol.rank import AbortHook, Action, ChunkEnd, Fence, Pairing, RankState, WriterTerms

SESSION = 5
A = "decode-a"
KEY = RoomKey(A, 1)
FENCED = WriterTerms("null", 1.0, writer_fence=True)
UNFENCED = WriterTerms("null", 1.0, writer_fence=False)


def _state(terms: WriterTerms = FENCED, pairing: Pairing[str] | None = None) -> RankState[str]:
    state: RankState[str] = RankState(RoomLedger(0, 60.0, SESSION), writer=terms)
    state.add_peer(A, "tcp://a", pairing or Pairing("layout", source_pages=16))
    state.handle(TransferRequest(1, A, (0, 1), SESSION, 1), 0.0)
    return state


def _dequeued(state: RankState[str]) -> None:
    s = state.open_sender(1, 1, 0.0)
    plan = state.plan_send(s, [0], False, state.poll(s, 0.0)[0])
    state.commit_send(s, plan)
    assert state.ledger.dequeue(KEY, plan.legs[0].incarnation)


def _abort(state: RankState[str], generation: int = 1) -> list[Action]:
    msg = Abort(1, generation, A, "tcp://a")
    (hook,) = state.handle(msg, 0.0)
    assert isinstance(hook, AbortHook)
    return state.abort_hooked(msg, raised=False)


def _acks(actions: object) -> list[SendAck]:
    return [a for a in actions if isinstance(a, SendAck)]  # type: ignore[attr-defined]


def test_a_chunk_that_failed_settled_lets_the_abort_be_acked() -> None:
    state = _state()
    _dequeued(state)
    actions = state.chunk_ended(KEY, ChunkEnd.FAILED_SETTLED)
    assert Fence() not in actions and state.ledger.status(KEY) is KVPoll.FAILED
    assert state.ledger.entry(KEY).reason == "transfer failed_settled"  # type: ignore[union-attr]
    (ack,) = _acks(_abort(state))
    assert not ack.ack.fenced


@pytest.mark.parametrize("end", [ChunkEnd.UNSETTLED, ChunkEnd.PLUGIN_ERROR])
def test_a_chunk_that_may_still_land_poisons_its_room_until_a_fence(end: ChunkEnd) -> None:
    state = _state()
    _dequeued(state)
    actions = state.chunk_ended(
        KEY, end, reason="on_post raised: boom" if end is ChunkEnd.PLUGIN_ERROR else ""
    )
    assert Fence() in actions
    assert state.ledger.poisoned() == {KEY} and state.fence_begins() == {KEY}
    assert _acks(_abort(state)) == []  # a write may land: no ack
    closed = frozenset({TcpConnection("127.0.0.1", 5000, "127.0.0.1", 6000)})
    (ack,) = _acks(state.fence_ended(True, closed))
    assert ack.ack.fenced and ack.ack.closed == tuple(closed)
    assert state.fence_begins() == frozenset()  # a second fence that raced it has nothing to do


def test_a_failed_fence_settles_nothing() -> None:
    state = _state()
    _dequeued(state)
    state.chunk_ended(KEY, ChunkEnd.UNSETTLED)
    _abort(state)
    assert state.fence_ended(False) == []
    assert state.ledger.poisoned() == {KEY} and state.ledger.outstanding(KEY) == 1


def test_without_a_proven_writer_fence_nothing_is_un_poisoned() -> None:
    """A writer whose fence the conformance suite did not prove: its hook's
    True is no proof, and decode takes the pages back on the writer's exit."""
    state = _state(UNFENCED)
    _dequeued(state)
    assert Fence() not in state.chunk_ended(KEY, ChunkEnd.UNSETTLED)
    assert state.fence_begins() == frozenset()
    _abort(state)
    assert state.fence_ended(True, frozenset()) == []
    assert state.ledger.poisoned() == {KEY}
    msg = Abort(1, 2, A, "tcp://a")
    state.handle(msg, 0.0)
    assert Fence() not in state.abort_hooked(msg, raised=True)  # a raising abort hook neither


def test_every_fenced_ack_and_drain_notice_names_the_last_fences_closed_connections() -> None:
    state = _state()
    conns = [TcpConnection("127.0.0.1", 5000 + i, "127.0.0.1", 6000) for i in range(FENCES_REMEMBERED + 1)]
    _dequeued(state)
    state.chunk_ended(KEY, ChunkEnd.UNSETTLED)
    for conn in conns:  # the room is settled by the first; the others find it so
        state.fence_ended(True, frozenset({conn}))
    (ack,) = _acks(_abort(state))  # its ABORT came after every fence
    assert ack.ack.fenced and set(ack.ack.closed) == set(conns[1:])  # the last FENCES_REMEMBERED
    announced = state.begin_drain(0.0, 0.0)
    assert Announce(A, False, ack.ack.closed) in announced


def test_a_send_names_only_source_pages_the_rank_has_and_changes_nothing_else() -> None:
    state = _state(pairing=Pairing("layout", source_pages=4))
    s = state.open_sender(1, 1, 0.0)
    polled = state.poll(s, 0.0)[0]
    for bad in ([4, 0], [-1, 0]):
        with pytest.raises(PageError, match=r"outside 0\.\.3"):
            state.plan_send(s, bad, True, polled)
    assert (s.sent, s.index) == (0, 0)
    state.plan_send(s, [3, 0], True, polled)


@pytest.mark.parametrize(
    ("writes", "slot", "error", "extras"),
    [
        (True, None, IncompleteRoomError, None),  # decode would see SUCCESS with its extras unwritten
        (True, 9, PageError, None),  # a slot this rank does not have
        (True, 1, None, 7),
        (False, None, None, None),  # another prefill rank writes them
        (None, 1, PageError, None),  # pages of equal shards have no extras
    ],
)
def test_a_last_chunk_names_a_slot_of_ours_when_it_writes_decodes_extras(
    writes: bool | None, slot: int | None, error: type[Exception] | None, extras: int | None
) -> None:
    state: RankState[str] = RankState(RoomLedger(0, 60.0, SESSION), writer=FENCED)
    state.add_peer(A, "tcp://a", Pairing("layout", source_pages=4, writes_extras=writes, extras_slots=2))
    state.handle(TransferRequest(1, A, (0,), SESSION, 1, extras_slot=8), 0.0)
    s = state.open_sender(1, 1, 0.0)
    polled = state.poll(s, 0.0)[0]
    if error is not None:
        with pytest.raises(error):
            state.plan_send(s, [0], True, polled, slot)
        return
    plan = state.plan_send(s, [0], True, polled, slot)
    assert plan.legs[0].extras == extras and plan.extras_slot == slot


def test_misuse_raises_kvconn_errors_that_are_value_errors() -> None:
    state = _state()
    with pytest.raises(ArgumentError, match="room 1: a sender writes into at least one decode"):
        state.open_sender(1, 0, 0.0)
    with pytest.raises(ValueError, match="grace period is at least 0 s"):
        state.begin_drain(0.0, -1.0)
    assert issubclass(ArgumentError, ValueError)
