"""RankState, a prefill rank's requests, senders and verdicts, driven by
plain stimuli: no threads, no sockets, the time passed in."""

from __future__ import annotations

import pytest

from kvconn.errors import IncompleteRoomError, PageError, RoomStateError
from kvconn.protocol.drops import DropReason
from kvconn.protocol.ledger import KVPoll, NotifyDecode, RoomKey, RoomLedger, SendAck
from kvconn.protocol.messages import Abort, Hello, RoomOutcome, TransferRequest
from kvconn.protocol.rank import (
    AbortHook,
    Action,
    Bootstrap,
    Drop,
    Fence,
    GaveUp,
    Pairing,
    RankState,
    Requested,
    SenderState,
    WriterTerms,
)

SESSION = 77
TTL = 60.0
A, B = "decode-a", "decode-b"


#: The writer of these tests: its fence is proven.
TERMS = WriterTerms("null", 1.0, writer_fence=True)


def _state(timeout: float | None = None) -> RankState[str]:
    state: RankState[str] = RankState(RoomLedger(0, TTL, SESSION), timeout, writer=TERMS)
    state.add_peer(A, "tcp://a", Pairing("layout-a", source_pages=64))
    state.add_peer(B, "tcp://b", Pairing("layout-b", tp_size=2, source_pages=64))
    return state


class _Seq:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _request(
    state: RankState[str], seq: _Seq, decode: str, room: int, pages: tuple[int, ...], now: float = 0.0
) -> list[Action]:
    return state.handle(TransferRequest(room, decode, pages, SESSION, seq()), now)


def _abort(
    state: RankState[str], decode: str, room: int, now: float = 0.0, generation: int = 1
) -> list[Action]:
    msg = Abort(room, generation, decode, f"tcp://{decode}")
    (hook,) = state.handle(msg, now)
    assert isinstance(hook, AbortHook)
    return state.abort_hooked(msg, raised=False)


def _send(state: RankState[str], s: SenderState, npages: int, last: bool, now: float = 0.0) -> None:
    polled, _ = state.poll(s, now)
    plan = state.plan_send(s, range(npages), last, polled)
    state.commit_send(s, plan)
    for leg in plan.legs:
        assert state.ledger.dequeue(leg.key, leg.incarnation)


def _failed_to(actions: list[Action], decode: str) -> bool:
    return any(
        isinstance(a, NotifyDecode) and a.decode == decode and a.status.outcome is RoomOutcome.FAILED
        for a in actions
    )


def test_messages_are_dispatched_by_type_in_one_place() -> None:
    state, seq = _state(), _Seq()
    assert state.handle("not a message", 0.0) == [Drop(DropReason.UNEXPECTED_TYPE)]
    hello = Hello(A, "tcp://a", "null", 4096, 1, 30_000, b"")
    assert state.handle(hello, 0.0) == [Bootstrap(hello)]
    stranger = TransferRequest(1, "stranger", (0,), SESSION, 1)
    assert state.handle(stranger, 0.0) == [Drop(DropReason.UNKNOWN_DECODE)]
    assert _request(state, seq, A, 1, (0, 1)) == [Requested(1, 2)]
    replay = TransferRequest(1, A, (0, 1), SESSION, seq.n)
    other_process = TransferRequest(2, A, (0, 1), SESSION + 1, seq.n + 5)
    assert state.handle(replay, 0.0) == [Drop(DropReason.STALE_REQUEST)]
    assert state.handle(other_process, 0.0) == [Drop(DropReason.STALE_REQUEST)]


def test_an_abort_to_an_unreachable_address_is_dropped_whole() -> None:
    state: RankState[str] = RankState(RoomLedger(0, TTL, SESSION), reachable=lambda address: False)
    assert state.handle(Abort(1, 1, A, "nowhere"), 0.0) == [Drop(DropReason.BAD_REPLY_TO)]
    assert state.ledger.status(RoomKey(A, 1)) is None


def test_a_raising_abort_hook_poisons_the_room_and_fences() -> None:
    state, seq = _state(), _Seq()
    _request(state, seq, A, 1, (0,))
    msg = Abort(1, 1, A, "tcp://a")
    state.handle(msg, 0.0)
    actions = state.abort_hooked(msg, raised=True)
    assert Fence() in actions and not any(isinstance(a, SendAck) for a in actions)
    assert [a for a in state.ledger.fenced() if isinstance(a, SendAck)]  # the fence proves it


def test_a_sender_made_after_decode_aborted_the_request_fails() -> None:
    """Issue 31 (2): it said BOOTSTRAPPING for ever (room_bootstrap_timeout_s is off by default)."""
    state, seq = _state(timeout=None), _Seq()
    _request(state, seq, A, 1, (0, 1))
    _abort(state, A, 1)
    assert state.requesting_tp(1) == 1  # an engine waiting for a request learns of it
    s = state.open_sender(1, 1, 0.0)
    assert state.poll(s, 1e9)[0] is KVPoll.FAILED
    verdict, _ = state.verdict(s, 1e9)
    assert (
        verdict is not None and not verdict.ok and verdict.settled and verdict.reason == "aborted by decode"
    )


def test_a_fan_out_sender_takes_the_aborted_request_of_one_decode_and_fails() -> None:
    state, seq = _state(), _Seq()
    _request(state, seq, A, 1, (0,))
    _abort(state, A, 1)
    _request(state, seq, B, 1, (4,))
    s = state.open_sender(1, 2, 0.0)
    assert state.poll(s, 0.0)[0] is KVPoll.FAILED
    assert state.leg_statuses(s) == {A: KVPoll.FAILED, B: KVPoll.WAITING_FOR_INPUT}


def test_a_concluded_request_another_sender_took_is_not_a_new_senders() -> None:
    """A sender of a reused id must wait for the new request: the earlier
    request's failure (its own sender took it) is not its verdict."""
    state, seq = _state(), _Seq()
    _request(state, seq, A, 1, (0,))
    first = state.open_sender(1, 1, 0.0)
    assert state.poll(first, 0.0)[0] is KVPoll.WAITING_FOR_INPUT
    _abort(state, A, 1)
    assert state.poll(first, 0.0)[0] is KVPoll.FAILED
    second = state.open_sender(1, 1, 0.0)
    assert state.poll(second, 0.0)[0] is KVPoll.BOOTSTRAPPING
    _request(state, seq, A, 1, (3,))  # decode reused the id: a new incarnation
    assert state.poll(second, 0.0)[0] is KVPoll.WAITING_FOR_INPUT


def test_a_last_chunk_one_page_short_is_refused_and_changes_nothing() -> None:
    """Issue 31 (4b): decode would be told Success with a stale page."""
    state, seq = _state(), _Seq()
    _request(state, seq, A, 1, (0, 1, 2))
    s = state.open_sender(1, 1, 0.0)
    with pytest.raises(IncompleteRoomError, match="leaves 1 of the room's 3"):
        state.plan_send(s, range(2), True, state.poll(s, 0.0)[0])
    with pytest.raises(PageError, match="3 pages left, got 4"):
        state.plan_send(s, range(4), False, KVPoll.WAITING_FOR_INPUT)
    assert (s.sent, s.index, s.last_sent) == (0, 0, False)
    plan = state.plan_send(s, range(3), True, KVPoll.WAITING_FOR_INPUT)
    assert [leg.dst_pages for leg in plan.legs] == [(0, 1, 2)]


def test_a_fan_out_sender_is_settled_only_once_every_decode_settled() -> None:
    """Issue 31 (4c): one decode's landed chunk must not let the engine reuse
    source pages the other decode's chunk is still being written from."""
    state, seq = _state(), _Seq()
    _request(state, seq, A, 1, (0,))
    _request(state, seq, B, 1, (4,))
    s = state.open_sender(1, 2, 0.0)
    _send(state, s, 1, True)
    state.ledger.landed(RoomKey(A, 1), True)
    assert state.leg_statuses(s) == {A: KVPoll.SUCCESS, B: KVPoll.TRANSFERRING}
    assert not state.settled(s)
    assert state.verdict(s, 0.0)[0] is None
    state.ledger.landed(RoomKey(B, 1), True)
    assert state.settled(s)
    verdict, _ = state.verdict(s, 0.0)
    assert verdict is not None and verdict.ok and verdict.settled


def test_a_sender_waiting_for_a_decodes_request_is_not_settled() -> None:
    """Found by explore_rank.py: a sender with no request yet said settled()
    (all of no legs), and an engine reusing its source pages then would have
    them read by the chunks it sends once the request comes."""
    state, seq = _state(), _Seq()
    s = state.open_sender(1, 2, 0.0)
    assert not state.settled(s)
    _request(state, seq, A, 1, (0,))
    _abort(state, A, 1)  # one decode's leg concluded, the other decode not asked yet
    assert not state.settled(s)
    assert state.poll(s, 0.0)[0] is KVPoll.FAILED  # the verdict: nothing more is written
    assert state.settled(s)


def test_a_failed_fan_out_room_is_concluded_but_not_settled_while_a_chunk_is_written() -> None:
    state, seq = _state(), _Seq()
    _request(state, seq, A, 1, (0,))
    _request(state, seq, B, 1, (4,))
    s = state.open_sender(1, 2, 0.0)
    _send(state, s, 1, True)
    _abort(state, A, 1)  # A's chunk is still being written: no ack yet
    verdict, _ = state.verdict(s, 0.0)
    assert verdict is not None and not verdict.ok and not verdict.settled
    state.ledger.skipped(RoomKey(A, 1))
    state.ledger.landed(RoomKey(B, 1), True)
    verdict, _ = state.verdict(s, 0.0)
    assert verdict is not None and verdict.settled


def test_chunks_name_their_request_so_a_reused_id_skips_them() -> None:
    state, seq = _state(), _Seq()
    _request(state, seq, A, 1, (0, 1))
    old = state.open_sender(1, 1, 0.0)
    plan = state.plan_send(old, range(1), False, state.poll(old, 0.0)[0])
    state.commit_send(old, plan)
    _abort(state, A, 1)  # nothing dequeued: acked at once, decode reuses the id
    _request(state, seq, A, 1, (5, 6))
    (leg,) = plan.legs
    assert state.ledger.incarnation(leg.key) != leg.incarnation
    assert not state.ledger.dequeue(leg.key, leg.incarnation)  # skipped, not written into (5, 6)


def test_give_up_refuses_later_requests_for_the_ledgers_tombstone_ttl() -> None:
    state, seq = _state(timeout=5.0), _Seq()
    s = state.open_sender(1, 1, 0.0)
    assert state.poll(s, 4.9)[0] is KVPoll.BOOTSTRAPPING
    status, actions = state.poll(s, 5.0)
    assert status is KVPoll.FAILED and actions == [GaveUp(1)]
    assert _failed_to(_request(state, seq, A, 1, (0,), now=6.0), A)  # a request arriving later: told
    state.tick(5.0 + TTL)
    assert not state.given_up(1, 5.0 + TTL)
    assert not _failed_to(_request(state, seq, B, 1, (0,), now=5.0 + TTL), B)


def test_fail_room_fails_every_decode_before_any_asked() -> None:
    """What SGLang's adapter faked with a sender of 65536 decodes."""
    state, seq = _state(), _Seq()
    _request(state, seq, A, 1, (0,))
    actions = state.fail_room(1, "prefill gave the request up", 0.0)
    assert _failed_to(actions, A)
    assert state.ledger.status(RoomKey(A, 1)) is None  # drained and cleared: no handle would
    assert _failed_to(_request(state, seq, B, 1, (4,), now=1.0), B)
    assert _failed_to(_request(state, seq, A, 2, (1,), now=1.0), A) is False  # another room is not


def test_a_cleared_sender_binds_nothing_new() -> None:
    state, seq = _state(), _Seq()
    s = state.open_sender(1, 2, 0.0)
    _request(state, seq, A, 1, (0,))
    state.clear(s, 0.0)
    _request(state, seq, B, 1, (4,))
    state.settled(s)
    assert [leg.key.decode for leg in s.legs] == [A]
    assert state.requesting_tp(1) == 2  # B's request is free for another sender


def test_plan_next_tells_a_give_up_with_the_refused_send() -> None:
    """The one-step send (poll, then plan): a sender past its bootstrap
    deadline gives up, and the caller gets the give-up's actions along with
    the refusal, as the two steps it replaced gave them."""
    state = _state(timeout=5.0)
    s = state.open_sender(1, 1, 0.0)
    refused, actions = state.plan_next(s, range(1), True, 5.0)
    assert isinstance(refused, RoomStateError) and actions == [GaveUp(1)]
    assert s.gave_up and s.sent == 0


def test_plan_next_skips_the_poll_only_of_a_bound_sender_and_says_what_poll_says() -> None:
    state, seq = _state(), _Seq()
    s = state.open_sender(1, 1, 0.0)
    _request(state, seq, A, 1, (0, 1))
    assert state.poll(s, 0.0)[0] is KVPoll.WAITING_FOR_INPUT  # bound to A's request
    plan, actions = state.plan_next(s, range(1), False, 0.0)
    assert not isinstance(plan, Exception) and actions == []
    assert plan.legs[0].dst_pages == (0,)
    state.commit_send(s, plan)
    state.clear(s, 1.0)  # cleared: refused, with the status poll() gives
    refused, _ = state.plan_next(s, range(1), True, 1.0)
    with pytest.raises(RoomStateError) as two_steps:
        state.plan_send(s, range(1), True, state.poll(s, 1.0)[0])
    assert isinstance(refused, RoomStateError) and str(refused) == str(two_steps.value)
