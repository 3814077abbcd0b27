"""Decode's hold tracker, one stimulus at a time."""

from __future__ import annotations

from kvconn.protocol.hold import Dropped, HoldState, HoldTracker, Proof, Quarantine, Release, SendAbort
from kvconn.protocol.messages import AbortAck

PAGES = (3, 4, 5)


def tracker(**kw: object) -> HoldTracker:
    t = HoldTracker("decode", "tcp://decode", abort_timeout=10.0, resend_interval=1.0, **kw)  # type: ignore[arg-type]
    t.open(1, PAGES, frozenset({0, 1}))
    return t


def sent(actions: list[object]) -> list[tuple[int, int]]:
    return [(a.rank, a.abort.generation) for a in actions if isinstance(a, SendAbort)]


def test_release_needs_every_rank_of_the_current_hold() -> None:
    t = tracker()
    [(r0, gen), (r1, _)] = sent(t.abort(1, now=0.0))
    assert (r0, r1) == (0, 1)
    assert t.ack(AbortAck(1, 0, gen, False), now=0.001) == []
    assert t.state(1) is HoldState.HELD
    [release] = t.ack(AbortAck(1, 1, gen, False), now=0.002)
    assert isinstance(release, Release) and release.proof is Proof.ACKS and release.pages == PAGES
    assert t.state(1) is None


def test_bogus_acks_are_dropped_with_a_reason() -> None:
    t = tracker()
    [(_, gen), _] = sent(t.abort(1, now=0.0))
    reasons = [
        t.ack(AbortAck(1, 0, gen + 7, False), now=0)[0],  # never issued
        t.ack(AbortAck(1, 5, gen, False), now=0)[0],  # not a rank of this room
        t.ack(AbortAck(2, 0, gen, False), now=0)[0],  # not a held room
    ]
    assert [r.reason for r in reasons if isinstance(r, Dropped)] == [
        "stale_generation",
        "stranger_rank",
        "not_held",
    ]
    t.ack(AbortAck(1, 0, gen, False), now=0)
    [dup] = t.ack(AbortAck(1, 0, gen, False), now=0)
    assert isinstance(dup, Dropped) and dup.reason == "duplicate"
    assert t.state(1) is HoldState.HELD


def test_deadline_quarantines_resends_and_a_late_ack_frees() -> None:
    t = tracker()
    [(_, gen1), _] = sent(t.abort(1, now=0.0))
    assert t.tick(now=9.9) == []
    actions = t.tick(now=10.0)
    assert [type(a) for a in actions] == [Quarantine, SendAbort, SendAbort]
    gen2 = sent(actions)[0][1]
    assert gen2 != gen1 and t.state(1) is HoldState.QUARANTINED
    assert sent(t.tick(now=10.5)) == []  # backs off
    assert len(sent(t.tick(now=11.0))) == 2
    t.ack(AbortAck(1, 0, gen1, False), now=12.0)  # an ack of the first ABORT still proves rank 0
    [release] = t.ack(AbortAck(1, 1, gen2, False), now=12.5)
    assert isinstance(release, Release) and release.proof is Proof.LATE_ACKS
    assert release.quarantined_for == 2.5 and release.held_for == 12.5


def test_fenced_ack_and_writer_exit_are_named_proofs() -> None:
    t = tracker()
    [(_, gen), _] = sent(t.abort(1, now=0.0))
    t.ack(AbortAck(1, 0, gen, True), now=1.0)
    assert t.writer_exited(1, now=2.0)[0].proof is Proof.WRITER_EXIT  # type: ignore[union-attr]
    t.open(2, PAGES, frozenset({0}))
    [(_, gen)] = sent(t.abort(2, now=0.0))
    assert t.ack(AbortAck(2, 0, gen, True), now=1.0)[0].proof is Proof.WRITER_FENCE  # type: ignore[union-attr]


def test_unsafe_legacy_mode_frees_at_the_deadline_and_says_so() -> None:
    t = tracker(unsafe_release_at_deadline=True)
    t.abort(1, now=0.0)
    [release] = t.tick(now=10.0)
    assert isinstance(release, Release) and release.proof is Proof.UNSAFE_TIMEOUT


def test_completed_room_is_released_at_once_on_abort() -> None:
    t = tracker()
    assert t.succeeded(1, 0) is False
    assert t.succeeded(1, 1) is True
    [release] = t.abort(1, now=0.0)
    assert isinstance(release, Release) and release.proof is Proof.COMPLETED


def test_a_reused_room_id_does_not_accept_the_old_holds_acks() -> None:
    t = tracker()
    [(_, old), _] = sent(t.abort(1, now=0.0))
    t.ack(AbortAck(1, 0, old, False), now=0)
    t.ack(AbortAck(1, 1, old, False), now=0)
    t.open(1, PAGES, frozenset({0, 1}))
    t.abort(1, now=1.0)
    [drop] = t.ack(AbortAck(1, 0, old, False), now=1.0)
    assert isinstance(drop, Dropped) and drop.reason == "stale_generation"


def test_next_deadline_tracks_the_earliest_hold() -> None:
    t = tracker()
    assert t.next_deadline() is None
    t.abort(1, now=5.0)
    assert t.next_deadline() == 15.0


def test_a_release_names_the_writer_exit_even_when_an_ack_comes_last() -> None:
    t = tracker()
    [(_, gen), _] = sent(t.abort(1, now=0.0))
    assert t.writer_exited(0, now=0.5) == []  # rank 1 still owes its proof
    [release] = t.ack(AbortAck(1, 1, gen, False), now=1.0)
    assert isinstance(release, Release) and release.proof is Proof.WRITER_EXIT
