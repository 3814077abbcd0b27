"""Prefill ranks killed or frozen mid-transfer, decode restarted: real
processes over the loopback transport (shared memory, control over ZMQ on
127.0.0.1). Every test ends with the canary check: 0 bytes land in pages
after decode handed them back."""

from __future__ import annotations

import signal
import subprocess
import time

import attrs
import pytest

from kvconn.protocol.hold import HoldState
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.procs import pid_namespace, wait_until_stopped
from kvconn.testing.cluster import LOOPBACK_SLOW, PROOFS, Cluster, total
from kvconn.testing.waiting import wait_for

ROOM_PAGES = 16


def _mid_transfer(c: Cluster, pages: list[int], timeout: float = 10) -> None:
    wait_for(lambda: c.landed_bytes(pages) > 0, timeout, "first bytes to land")


def _releases(c: Cluster) -> float:
    return total(c.metric, "kvconn_releases_total", "proof", PROOFS)


def test_sigkill_mid_transfer_releases_by_proven_exit() -> None:
    c = Cluster(write_timeout_s=0.5, abort_timeout_s=3.0)
    try:
        # The last room is still unwritten when the first one shows bytes (each
        # rank writes its rooms in order, ~0.13 s each): rank 0 dies mid-work.
        rooms = {1000 + i: c.open(1000 + i, ROOM_PAGES) for i in range(8)}
        _mid_transfer(c, rooms[1000][1])
        c.ranks[0].signal(signal.SIGKILL)
        assert not c.correct(1007, rooms[1007][1], ranks=[0]), "rank 0 finished every room before the kill"
        for rx, _ in rooms.values():
            rx.abort()
        wait_for(lambda: all(c.released(r) for r in rooms), 5, "releases")
        # rank 1 acked, rank 0's process is proven gone: released before the
        # deadline (no quarantine), whatever the wall clock said under load
        proofs = {c.released(r).proof.value for r in rooms}  # type: ignore[union-attr]
        assert "writer_exit" in proofs and proofs <= {"writer_exit", "completed", "acks"}
        assert c.metric("kvconn_quarantines_total") == 0
        assert _releases(c) == len(rooms)
        assert (
            # "acks": rank 0 had reported the room complete before it was
            # killed, so rank 1's ack was the only proof still owed.
            total(c.metric, "kvconn_released_pages_total", "proof", ("writer_exit", "completed", "acks"))
            == len(rooms) * ROOM_PAGES
        )
        assert c.metric("kvconn_rooms_held") == 0 and c.metric("kvconn_pages_held") == 0
        # the survivor and decode's listener keep working
        rx, pages = c.open(2000, ROOM_PAGES, frozenset({1}))
        wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 10, "room on the surviving rank")
        assert c.correct(2000, pages, ranks=[1])
        c.finish(rx)
        assert c.ranks[1].value("kvconn_plugin_errors_total", hook="on_post") == 0
        assert c.late_bytes() == 0
    finally:
        c.close()


#: A pid namespace of its own, with its own /proc, as a container that shares
#: the host's network (and hostname) has.
UNSHARE_PID = ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc")


def _unshare_works() -> bool:
    try:
        return subprocess.run([*UNSHARE_PID, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="no unprivileged pid namespaces here")
def test_a_writer_in_its_own_pid_namespace_is_never_proven_gone() -> None:
    c = Cluster(wrap=UNSHARE_PID, write_timeout_s=0.5, abort_timeout_s=3.0)
    try:
        here = pid_namespace()
        for writer in c.dec._state.writers.values():
            assert writer.pid_namespace != here
            assert not writer.proven_gone(here)
            # What a hostname check let through: its pid means another process
            # here (pid 1 is our init), so the pid check alone says "gone".
            assert attrs.evolve(writer, pid_namespace=here).proven_gone(here)
        rooms = {4000 + i: c.open(4000 + i, ROOM_PAGES) for i in range(4)}
        _mid_transfer(c, rooms[4000][1])
        for rx, _ in rooms.values():
            rx.abort()
        wait_for(lambda: all(c.released(r) for r in rooms), 5, "releases")
        proofs = {c.released(r).proof.value for r in rooms}  # type: ignore[union-attr]
        assert proofs <= {"acks", "completed"}, proofs
        assert c.late_bytes() == 0
    finally:
        c.close()


def test_sigstop_past_deadline_quarantine_then_late_ack() -> None:
    # Rank 0 stops itself half way through its first chunk of the room
    # (loopback's freeze_chunks). A SIGSTOP sent from here once landed, under
    # load, where rank 0 had no chunk in flight (before its first, between two
    # or after its last), and then nothing was unsettled.
    options = {**LOOPBACK_SLOW, "freeze_chunks": "0:3000:0"}
    c = Cluster(write_timeout_s=0.4, abort_timeout_s=1.2, backend_options=options)
    try:
        rx, pages = c.open(3000, ROOM_PAGES)
        wait_until_stopped(c.ranks[0].proc.pid, timeout=20)
        assert c.landed_bytes(pages) > 0 and not c.correct(3000, pages, ranks=[0])  # frozen mid-write
        t0 = time.monotonic()
        rx.abort()
        wait_for(lambda: rx.state() is HoldState.QUARANTINED, 5, "quarantine")
        at_quarantine = time.monotonic() - t0
        assert at_quarantine >= c.config.abort_timeout_s - 0.05
        assert c.metric("kvconn_pages_quarantined") == ROOM_PAGES
        assert c.metric("kvconn_quarantines_total") == 1
        assert c.released(3000) is None
        time.sleep(0.5)  # frozen well past both deadlines
        assert c.released(3000) is None
        assert c.metric("kvconn_quarantine_oldest_seconds") >= 0.4
        c.ranks[0].signal(signal.SIGCONT)
        wait_for(lambda: c.released(3000) is not None, 10, "late ack after SIGCONT")
        rel = c.released(3000)
        assert rel is not None
        assert rel.proof.value in ("writer_fence", "late_acks")
        assert rel.quarantined_for > 0.4
        assert c.metric("kvconn_pages_quarantined") == 0
        assert c.metric("kvconn_quarantine_oldest_seconds") == 0
        assert c.metric("kvconn_quarantine_seconds_total") == pytest.approx(rel.quarantined_for)
        # the writer hit its own deadline and fenced itself
        m0 = c.ranks[0]
        assert m0.value("kvconn_chunks_total", outcome="unsettled") == 1, {
            k: v for k, v in m0.metrics().items() if "chunk" in k[0] or "fence" in k[0]
        }
        assert m0.value("kvconn_fences_total", result="ok") >= 1
        assert m0.value("kvconn_poisoned_rooms") == 0
        # and still serves new rooms
        rx2, pages2 = c.open(3001, ROOM_PAGES)
        wait_for(lambda: rx2.poll() is KVPoll.SUCCESS, 10, "room after resume")
        assert c.correct(3001, pages2)
        c.finish(rx2)
        assert c.late_bytes() == 0
    finally:
        c.close()


def test_sigstop_then_sigkill_quarantine_then_exit() -> None:
    c = Cluster(write_timeout_s=0.4, abort_timeout_s=1.0)
    try:
        rx, pages = c.open(3100, ROOM_PAGES)
        _mid_transfer(c, pages)
        c.ranks[0].signal(signal.SIGSTOP)
        rx.abort()
        wait_for(lambda: rx.state() is HoldState.QUARANTINED, 5, "quarantine")
        c.ranks[0].signal(signal.SIGKILL)
        wait_for(lambda: c.released(3100) is not None, 5, "release by writer exit")
        rel = c.released(3100)
        assert rel is not None and rel.proof.value == "writer_exit" and rel.quarantined_for > 0
        assert c.metric("kvconn_pages_quarantined") == 0
        assert c.late_bytes() == 0
    finally:
        c.close()


def test_decode_restart_while_prefill_holds_targets() -> None:
    c = Cluster(write_timeout_s=0.5, abort_timeout_s=1.5)
    try:
        rooms = {4000 + i: c.open(4000 + i, ROOM_PAGES) for i in range(3)}
        _mid_transfer(c, rooms[4000][1])
        for rx, _ in rooms.values():
            rx.abort()
        c.dec.close()  # decode dies with ack targets registered at prefill
        old_address = c.dec.address
        c.start_decode()
        assert c.dec.address != old_address
        rooms2 = {4100 + i: c.open(4100 + i, ROOM_PAGES) for i in range(3)}
        wait_for(lambda: all(rx.poll() is KVPoll.SUCCESS for rx, _ in rooms2.values()), 15, "new decode")
        for room, (rx, pages) in rooms2.items():
            assert c.correct(room, pages)
            c.finish(rx)
        for rank in c.ranks:
            assert rank.value("kvconn_poisoned_rooms") == 0
        assert c.late_bytes() == 0
        assert c.metric("kvconn_dropped_messages_total", reason="not_held") == 0
    finally:
        c.close()
