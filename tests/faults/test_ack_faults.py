"""ABORT_ACKs dropped, duplicated, delayed, reordered and replayed by a
proxy between the prefill ranks and decode's control socket; room ids reused
right after release; an HMAC key on every frame."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

import pytest

from kvconn.protocol.hold import HoldState
from kvconn.protocol.ledger import KVPoll
from kvconn.protocol.messages import Abort, AbortAck, Message
from kvconn.runtime.control import Outbox
from kvconn.testing.cluster import PROOFS, Cluster, total
from kvconn.testing.faults import only_acks
from kvconn.testing.waiting import wait_for

ROOM_PAGES = 16
NROOMS = 6


def _abort_rooms(c: Cluster, base: int) -> dict[int, list[int]]:
    rooms = {base + i: c.open(base + i, ROOM_PAGES) for i in range(NROOMS)}
    wait_for(lambda: c.landed_bytes(rooms[base][1]) > 0, 10, "first bytes")
    for rx, _ in rooms.values():
        rx.abort()
    return {r: p for r, (_, p) in rooms.items()}


def _drop_first_per_room() -> object:
    seen: set[int] = set()

    def policy(frame: bytes, msg: Message | None) -> Sequence[float]:
        assert isinstance(msg, AbortAck)
        if msg.room in seen:
            return [0.0]
        seen.add(msg.room)
        return []

    return policy


@pytest.mark.parametrize("fault", ["drop", "duplicate", "delay", "delay_past_deadline", "reorder"])
def test_ack_faults(fault: str) -> None:
    key = secrets.token_bytes(32)
    c = Cluster(write_timeout_s=0.3, abort_timeout_s=1.0, key=key, proxy=True)
    try:
        proxy = c.proxy
        assert proxy is not None
        if fault == "drop":  # every rank's first ack of each room is lost
            dropped: set[tuple[int, int]] = set()

            def drop(frame: bytes, msg: Message | None) -> Sequence[float]:
                assert isinstance(msg, AbortAck)
                if (msg.room, msg.rank) in dropped:
                    return [0.0]
                dropped.add((msg.room, msg.rank))
                return []

            proxy.set_policy(only_acks(drop))
        elif fault == "duplicate":
            proxy.set_policy(only_acks(lambda f, m: [0.0, 0.0, 0.05]))
        elif fault == "delay":
            proxy.set_policy(only_acks(lambda f, m: [0.4]))
        elif fault == "delay_past_deadline":
            proxy.set_policy(only_acks(lambda f, m: [1.5]))
        elif fault == "reorder":
            proxy.set_policy(only_acks(lambda f, m: None))  # hold every ack back
        rooms = _abort_rooms(c, 5000)
        if fault == "reorder":
            wait_for(lambda: proxy.stats.held >= NROOMS * c.num_ranks, 10, "all acks held")
            assert not any(c.released(r) for r in rooms)
            proxy.flush(reverse=True)
        wait_for(lambda: all(c.released(r) for r in rooms), 15, "every room released")
        proofs = {c.released(r).proof.value for r in rooms}  # type: ignore[union-attr]
        quarantines = c.metric("kvconn_quarantines_total")
        if fault in ("drop", "delay_past_deadline"):
            assert proofs == {"late_acks"} and quarantines == NROOMS
        else:
            assert proofs == {"acks"} and quarantines == 0
        assert _total_releases(c) == NROOMS
        assert c.metric("kvconn_acks_received_total") == NROOMS * c.num_ranks
        drops = {
            r: c.metric("kvconn_dropped_messages_total", reason=r)
            for r in ("duplicate", "not_held", "stale_generation", "stranger_rank", "bad_mac")
        }
        if fault == "duplicate":
            dups = 2 * NROOMS * c.num_ranks
            wait_for(lambda: proxy.stats.forwarded == 3 * NROOMS * c.num_ranks, 5, "every copy forwarded")
            wait_for(
                lambda: (
                    c.metric("kvconn_dropped_messages_total", reason="duplicate")
                    + c.metric("kvconn_dropped_messages_total", reason="not_held")
                    == dups
                ),
                5,
                "dup drops",
            )
        elif fault == "drop":
            assert proxy.stats.dropped == NROOMS * c.num_ranks
        else:
            time.sleep(0.1)
            # every forwarded ack beyond the proving ones was dropped and counted, never acted on
            assert proxy.stats.forwarded - NROOMS * c.num_ranks == sum(drops.values())
        assert drops["bad_mac"] == 0 and drops["stranger_rank"] == 0
        assert c.metric("kvconn_pages_held") == 0 and c.metric("kvconn_pages_quarantined") == 0
        # listener alive: a new room completes
        rx, pages = c.open(5999, ROOM_PAGES)
        wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 10, "new room")
        assert c.correct(5999, pages)
        c.finish(rx)
        assert c.late_bytes() == 0
    finally:
        c.close()


def _total_releases(c: Cluster) -> float:
    return total(c.metric, "kvconn_releases_total", "proof", PROOFS)


def test_room_reused_after_abort_release_and_old_acks_replayed() -> None:
    key = secrets.token_bytes(32)
    c = Cluster(write_timeout_s=0.3, abort_timeout_s=1.0, key=key, proxy=True)
    try:
        proxy = c.proxy
        assert proxy is not None
        room = 6000
        rx, pages = c.open(room, ROOM_PAGES)
        wait_for(lambda: c.landed_bytes(pages) > 0, 10, "first bytes")
        rx.abort()
        wait_for(lambda: c.released(room) is not None, 5, "first release")
        old = [f for m, f in proxy.acks() if m.room == room]
        assert len(old) == c.num_ranks
        # reuse the id right away, on other pages
        rx2, _ = c.open(room, ROOM_PAGES)
        for frame in old:
            proxy.replay(frame)  # old acks while the reused room is open
        wait_for(lambda: c.metric("kvconn_dropped_messages_total", reason="not_held") == len(old), 5, "drops")
        assert rx2.state() is HoldState.OPEN
        proxy.set_policy(only_acks(lambda f, m: None))  # hold the new acks
        rx2.abort()
        wait_for(lambda: proxy.stats.held == c.num_ranks, 5, "new acks held")
        for frame in old:
            proxy.replay(frame)  # old generation against the new hold
        wait_for(
            lambda: c.metric("kvconn_dropped_messages_total", reason="stale_generation") == len(old),
            5,
            "stale drops",
        )
        assert rx2.state() is HoldState.HELD
        with c.lock:
            assert len(c.releases) == 1
        proxy.flush()
        wait_for(lambda: len(c.releases) == 2, 5, "second release")
        assert c.releases[1].proof.value == "acks"
        assert c.late_bytes() == 0
    finally:
        c.close()


def test_room_reused_right_after_completion() -> None:
    """Room completes, decode takes and frees its pages, the same id comes
    back at once with other pages: the old pages must see no write."""
    c = Cluster(write_timeout_s=0.3, abort_timeout_s=1.0)
    try:
        room = 6100
        old: list[int] = []
        outcomes = []
        for i in range(4):
            rx, pages = c.open(room, ROOM_PAGES, exclude=old)
            old = pages
            wait_for(lambda rx=rx: rx.poll() in (KVPoll.SUCCESS, KVPoll.FAILED), 10, f"round {i}")
            poll = rx.poll()
            outcomes.append(poll.name)
            if poll is KVPoll.SUCCESS:
                assert c.correct(room, pages)
                c.finish(rx)
            else:
                rx.abort()
                wait_for(lambda: c.released(room) is not None, 5, "release")
                c.releases.clear()
            time.sleep(0.3)
            assert c.late_bytes() == 0, f"round {i} {outcomes}: a write landed in freed pages"
        print("outcomes", outcomes)
    finally:
        c.close()


def test_forged_and_unkeyed_frames_are_dropped_and_counted() -> None:
    key = secrets.token_bytes(32)
    c = Cluster(write_timeout_s=0.3, abort_timeout_s=1.0, key=key, proxy=True)
    try:
        proxy = c.proxy
        assert proxy is not None
        proxy.set_policy(only_acks(lambda f, m: None))  # hold the real acks
        rx, _ = c.open(7000, ROOM_PAGES)
        rx.abort()
        wait_for(lambda: proxy.stats.held == c.num_ranks, 5, "real acks held")
        gens = sorted({m.generation for m, _ in proxy.acks()})
        forged = [AbortAck(7000, r, g, False) for r in range(c.num_ranks) for g in gens]
        for sender_key in (None, secrets.token_bytes(32)):
            out = Outbox(sender_key)
            for msg in forged:
                out.send(c.dec.address, msg)
            out.close()
        n = 2 * len(forged)
        wait_for(
            lambda: (
                c.metric("kvconn_dropped_messages_total", reason="bad_mac")
                + c.metric("kvconn_dropped_messages_total", reason="short")
                >= n
            ),
            5,
            "bad_mac drops",
        )
        assert c.metric("kvconn_dropped_messages_total", reason="bad_mac") == n
        assert c.metric("kvconn_acks_received_total") == 0
        assert rx.state() is HoldState.HELD
        # a key holder claiming a rank decode was never bootstrapped with
        insider = Outbox(key)
        insider.send(c.dec.address, AbortAck(7000, 7, gens[0], False, c.dec.name, c.dec.session_of(0)))
        insider.close()
        wait_for(
            lambda: c.metric("kvconn_dropped_messages_total", reason="other_session") == 1, 5, "stranger"
        )
        assert rx.state() is HoldState.HELD
        # unkeyed and wrong-key ABORTs to a prefill rank are dropped there too
        for sender_key in (None, secrets.token_bytes(32)):
            out = Outbox(sender_key)
            out.send(c.ranks[0].address, Abort(7001, 1, "forged", c.dec.address))
            out.close()
        wait_for(
            lambda: c.ranks[0].value("kvconn_dropped_messages_total", reason="bad_mac") == 2,
            5,
            "prefill drops",
        )
        assert c.ranks[0].value("kvconn_messages_total", type="Abort") == 1  # only the real one
        proxy.flush()
        wait_for(lambda: c.released(7000) is not None, 5, "release by the real acks")
        assert c.released(7000).proof.value == "acks"  # type: ignore[union-attr]
        assert c.metric("kvconn_acks_received_total") == c.num_ranks
        assert c.dec.address.startswith("tcp://127.0.0.1:")
        assert c.late_bytes() == 0
    finally:
        c.close()


def test_prefill_without_the_key_cannot_bootstrap() -> None:
    from kvconn.runtime.decode import BootstrapError

    with pytest.raises(BootstrapError):
        Cluster(key=secrets.token_bytes(32), rank_key=None, bootstrap_timeout_s=1.5)
    with pytest.raises(BootstrapError):
        Cluster(key=secrets.token_bytes(32), rank_key=secrets.token_bytes(32), bootstrap_timeout_s=1.5)


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "", "::"])
def test_wildcard_bind_refused(host: str) -> None:
    from kvconn.config import Config

    with pytest.raises(ValueError, match="explicit"):
        Config(host=host)
