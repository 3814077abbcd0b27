"""The checks of unhealthy writers: a rank killed or frozen with its write in
flight, a frozen page owner, a partition healed late, hooks that raise. Each
one holds decode's pages until a proof came, and watches them after."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvconn.conformance import guard
from kvconn.conformance.checking import (
    MiB,
    kill_rank,
    no_late_bytes,
    open_cluster,
    settled_before,
)
from kvconn.conformance.harness import (
    ACK_PROOFS,
    Cluster,
    ConformanceFailure,
    OwnerProc,
    RankProc,
    Settings,
    wait_for,
)
from kvconn.conformance.plugin import NEEDS_HOSTS, require_capability
from kvconn.conformance.stakes import at_stake
from kvconn.protocol.hold import HoldState, Proof
from kvconn.protocol.messages import TcpConnection
from kvconn.runtime.sockets import TcpTable
from kvconn.testing.hosts import tcp_ends_of
from kvconn.transport import Settlement

log = logging.getLogger(__name__)

#: Hooks that raise, and the room each one raises for.
RAISE_POINTS = ("dequeue", "skip", "before_post", "after_post", "before_barrier", "after_barrier", "abort")
RAISE_ROOMS = {point: 0x0BAD_0000 + i for i, point in enumerate(RAISE_POINTS)}
FROZEN_ROOM = 0xF0_0001
KILLED_ROOM = 0xDEAD_0001
OWNER_ROOM = 0x0F0_0001
PARTITION_ROOM = 0xC07_0001


def _connections_with(ends: set[tuple[str, int]]) -> dict[TcpConnection, int]:
    """This host's TCP connections (decode's, in cross-host mode) whose other
    end is one of ``ends``, and their /proc/net/tcp state."""
    return {r.conn: r.state for r in TcpTable().rows if (r.conn.remote_host, r.conn.remote_port) in ends}


#: /proc/net/tcp: ESTABLISHED (the remote end has not closed).
_ESTABLISHED = 0x01


def _killed_across_hosts(cluster: Cluster, victim: RankProc, room: int, pages: list[int]) -> None:
    """A writer killed on another host. Decode cannot see its pid; what it
    sees is the remote kernel closing the writer's connections. That close
    alone proves no exit (a live process closes connections too, and may
    open new ones with the metadata it holds), so the room stays held: it
    may be released only by a proof that came after the close, never at a
    deadline."""
    assert victim.host is not None
    settings = cluster.settings
    # The suite sees every host: the victim's own ends tell its connections
    # from those of the other processes on its host.
    before = {c for c, state in _connections_with(tcp_ends_of(victim.pid)).items() if state == _ESTABLISHED}
    if not before:
        raise ConformanceFailure("killed writer across hosts: decode holds no connection from the writer")
    kill_rank(victim, "killed writer", [cluster.owner_pid])
    killed = time.monotonic()
    ends = {(c.remote_host, c.remote_port) for c in before}

    def still_open() -> set[TcpConnection]:
        now = _connections_with(ends)
        return {c for c in before if now.get(c) == _ESTABLISHED}

    try:
        wait_for(lambda: not still_open(), 5.0, "killed writer across hosts: the remote kernel closes them")
    except ConformanceFailure as exc:
        left = sorted(f"{c.local_port}->{c.remote_host}:{c.remote_port}" for c in still_open())
        raise ConformanceFailure(f"{exc}; still established: {left} of {len(before)}") from None
    closed = time.monotonic()
    log.info(
        "killed writer across hosts: %d connections closed by the remote kernel %.0f ms after the kill",
        len(before),
        1000 * (closed - killed),
    )
    deadline = time.monotonic() + settings.effective_abort_timeout() + settings.late_write_watch_s
    while time.monotonic() < deadline:
        found = cluster.release_of(room)
        if found is not None:
            release, released_at = found
            if release.proof is not Proof.WRITER_EXIT or released_at < closed:
                raise ConformanceFailure(
                    f"killed writer across hosts: released by {release.proof.value} "
                    f"{released_at - closed:+.3f} s after its connections closed: no proof of that exit"
                )
            no_late_bytes(cluster, room, pages, settings.late_write_watch_s)
            return
        time.sleep(0.05)
    if cluster.state(room) is not HoldState.QUARANTINED:
        raise ConformanceFailure(
            f"killed writer across hosts: room {room} is {cluster.state(room)} past decode's deadline, "
            "not quarantined"
        )


def _resume_across_hosts(settings: Settings, owner: OwnerProc, pages: list[int], rank: RankProc) -> None:
    """The frozen owner resumes after its writer on another host was killed:
    no proof of that exit can come, so the room is not released (a release
    would have to name a proof, and no timeout is one), unless the writer
    fenced before the kill came (on a loaded machine its deadline may pass
    first): its fenced ack, waiting in the frozen owner's socket, is one."""
    _queued_to(owner)
    owner.signal(signal.SIGCONT)
    try:
        release = owner.expect(
            settings.effective_abort_timeout() + settings.late_write_watch_s,
            "frozen owner across hosts",
            event="released",
        )
    except ConformanceFailure:
        return  # held: quarantined, visible, until an owner-side fence
    fenced = any(e.get("event") == "fenced" and e.get("result") for e in rank.history())
    if release["proof"] != Proof.WRITER_EXIT.value and not (
        fenced and release["proof"] == Proof.WRITER_FENCE.value
    ):
        raise ConformanceFailure(
            f"frozen owner across hosts: released by {release['proof']} after its writer was killed "
            f"on another host{'' if fenced else ' (it had not fenced)'}: no proof of that exit"
        )
    _watch_released(settings, owner, pages, release, "the writer's exit")


@contextmanager
def _frozen_owner(settings: Settings) -> Iterator[tuple[RankProc, OwnerProc, list[int]]]:
    """One rank writing a 64 MiB chunk into a decode process that aborted the
    room and was then frozen (SIGSTOP) just before the writer posted."""
    page_bytes, npages = MiB, 64  # one chunk of 64 MiB
    warm = OWNER_ROOM + 1
    faults = {OWNER_ROOM: {"pause": "before_post", "pause_s": 0.3}, warm: {}}
    rank = RankProc(settings, 0, 1, page_bytes, npages, npages, faults)
    owner: OwnerProc | None = None
    try:
        owner = OwnerProc(settings, [rank.ready()], npages + 1, page_bytes)
        owner.expect(60, "frozen owner: decode start", event="ready")
        # Connect first: a transport's handshake with a frozen peer may wait a minute.
        owner.command(10, "frozen owner: open a first room", "open", room=warm, pages=[npages])
        rank.expect(30, "frozen owner: the first room lands", event="after_barrier", room=warm)
        pages = list(range(npages))
        owner.command(10, "frozen owner: open", "open", room=OWNER_ROOM, pages=pages)
        rank.expect(10, "frozen owner: the writer is about to post", event="paused")
        owner.command(5, "frozen owner: abort", "abort", room=OWNER_ROOM)
        rank.expect(5, "frozen owner: the ABORT reached the writer", event="abort")
        owner.signal(signal.SIGSTOP)  # the writer posts 64 MiB into a frozen owner
        wait_for(owner.stopped, 5, "frozen owner: decode froze")
        yield rank, owner, pages
        at_stake(
            sum(1 for e in rank.history() if e.get("event") == "after_post" and e.get("room") == OWNER_ROOM),
            1,
            f"a 64 MiB chunk posted into the frozen page owner, {_queued_to(owner) / MiB:.1f} MiB waiting in "
            "its sockets (the most seen while it was frozen)",
            "a write posted while the owner was frozen",
        )
    finally:
        if owner is not None and not owner.guarded:
            owner.close()
        rank.close()


def _queued_to(owner: OwnerProc) -> int:
    """Bytes waiting in the receive queues of the (frozen) owner's TCP sockets,
    the most seen so far (an end a reset closed leaves /proc's table with
    its bytes: look before the writer's fence or exit)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{owner.pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{owner.pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    queued = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{owner.pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[9] in inodes:
                    queued += int(fields[4].split(":")[1], 16)
    owner.queued = max(owner.queued, queued)
    return owner.queued


def _resume_and_check(settings: Settings, owner: OwnerProc, pages: list[int], proof: str) -> None:
    """Resume the owner; once it released the room (and wrote fresh canaries
    into its pages), no byte of the old write may change them."""
    _queued_to(owner)
    owner.signal(signal.SIGCONT)
    release = owner.expect(
        settings.effective_abort_timeout() + 10, "frozen owner: released", event="released"
    )
    _watch_released(settings, owner, pages, release, proof)


def _watch_released(
    settings: Settings, owner: OwnerProc, pages: list[int], release: dict[str, Any], proof: str
) -> None:
    deadline = time.monotonic() + max(settings.late_write_watch_s, 2 * settings.write_timeout_s)
    while True:
        changed = owner.command(10, "frozen owner: check pages", "changed", pages=pages)["pages"]
        if changed:
            raise ConformanceFailure(
                f"frozen owner: {len(changed)} of {len(pages)} pages changed after decode released them "
                f"({release['proof']}, after {proof}) and handed them out again: a write of the aborted "
                "room landed after the release"
            )
        if time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    _guard_owner(owner, pages, f"{release['proof']}, after {proof}")


def _guard_owner(owner: OwnerProc, pages: list[int], why: str) -> None:
    """The owner stays alive, its released pages watched, to the end of the run."""

    def late() -> str:
        try:
            changed = owner.command(10, "frozen owner: check pages", "changed", pages=pages)["pages"]
        except ConformanceFailure as exc:
            return f"the page owner's process stopped answering ({exc})"
        return f"{len(changed)} of {len(pages)} pages changed ({why})" if changed else ""

    guard.GUARD.keep("released pages of a frozen page owner", late, owner.close)
    owner.guarded = True


def _unsettled_chunk(
    rank: RankProc, room: int, cluster: Cluster, pages: list[int], how: str, ranks: list[int] | None = None
) -> None:
    """At stake: a chunk of ``room`` that ``rank`` posted and has not settled
    (it stopped right after posting), and how much of the room it had yet
    to write."""
    events = [e for e in rank.history() if e.get("room") == room]
    posted = {e["index"] for e in events if e["event"] == "after_post"}
    settled = {e["index"] for e in events if e["event"] == "after_barrier"}
    unsettled = len(posted - settled)
    pending = len(cluster.bad_pattern_pages(room, pages, ranks))
    at_stake(
        unsettled,
        1,
        f"{unsettled} chunk posted and not settled by the rank {how}; {pending} of {len(pages)} pages "
        "of the room not yet written by it then",
        "a posted chunk the writer had not settled",
    )


class WriterFaultChecks:
    """The unhealthy-writer checks (mixed into :class:`ConformanceSuite`)."""

    @pytest.mark.kvconn_releases
    def test_killed_writer_proves_exit(
        self, request: pytest.FixtureRequest, kvconn_settings: Settings
    ) -> None:
        """A rank killed with a write in flight: held until its exit is proven, then released."""
        faults = {1: {KILLED_ROOM: {"stop": "after_post"}}}
        with open_cluster(kvconn_settings, num_ranks=2, chunk_pages=8, rank_faults=faults) as cluster:
            pages = cluster.alloc(32)
            rx = cluster.receiver(KILLED_ROOM, pages)
            victim = cluster.ranks[1]
            victim.expect(10, "killed writer: rank 1 posts", event="stopping")
            wait_for(victim.stopped, 5, "killed writer: rank 1 froze")
            rx.abort()
            time.sleep(0.3)
            if cluster.release_of(KILLED_ROOM) is not None:
                raise ConformanceFailure(
                    "S2 violated: released while rank 1 (frozen, write in flight) had not acked"
                )
            _unsettled_chunk(victim, KILLED_ROOM, cluster, pages, "killed", ranks=[1])
            if kvconn_settings.cross_host:
                _killed_across_hosts(cluster, victim, KILLED_ROOM, pages)
                return
            kill_rank(victim, "killed writer", [cluster.owner_pid])
            release, _ = cluster.wait_released(KILLED_ROOM, 3.0, "writer exit: killed rank proven gone")
            if release.proof is not Proof.WRITER_EXIT:
                raise ConformanceFailure(
                    f"killed writer: released by {release.proof.value}, expected writer_exit"
                )
            no_late_bytes(cluster, KILLED_ROOM, pages, kvconn_settings.late_write_watch_s)

    @pytest.mark.kvconn_releases
    def test_frozen_writer_quarantine_then_proof(
        self, request: pytest.FixtureRequest, kvconn_settings: Settings
    ) -> None:
        """A writer frozen mid-chunk past decode's deadline: quarantined, never
        released on the timeout; once it resumes, a proof (fence or late ack) frees it."""
        faults = {FROZEN_ROOM: {"stop": "after_post"}}
        with open_cluster(
            kvconn_settings, page_bytes=256 << 10, num_pages=96, chunk_pages=16, faults=faults
        ) as cluster:
            pages = cluster.alloc(64)
            rx = cluster.receiver(FROZEN_ROOM, pages)
            writer = cluster.ranks[0]
            writer.expect(10, "frozen writer: posts", event="stopping")
            wait_for(writer.stopped, 5, "frozen writer: froze")
            _unsettled_chunk(writer, FROZEN_ROOM, cluster, pages, "frozen past decode's deadline")
            rx.abort()
            deadline = cluster.settings.effective_abort_timeout()
            wait_for(
                lambda: cluster.quarantined_or_released(FROZEN_ROOM),
                deadline + 1.0,
                "L2: held room quarantined at the deadline",
            )
            if cluster.release_of(FROZEN_ROOM) is not None:
                raise ConformanceFailure("S2 violated: released while the writer was frozen (timeout alone)")
            time.sleep(0.3)  # a few re-sent ABORTs reach a frozen writer's socket
            resumed = time.monotonic()
            writer.signal(signal.SIGCONT)
            limit = kvconn_settings.capabilities.max_write_timeout_s or 0.0
            try:
                release, released_at = cluster.wait_released(
                    FROZEN_ROOM,
                    kvconn_settings.write_timeout_s + limit + 3.0,
                    "L2: resumed writer proves quiescence",
                )
            except ConformanceFailure:
                if kvconn_settings.capabilities.writer_fence:
                    raise
                kill_rank(
                    writer, "frozen writer", [cluster.owner_pid]
                )  # no fence declared: only its exit proves it
                release, released_at = cluster.wait_released(FROZEN_ROOM, 3.0, "L2: writer exit")
            if released_at < resumed:
                raise ConformanceFailure("S2 violated: released before the frozen writer resumed")
            if release.proof not in {Proof.WRITER_FENCE, Proof.LATE_ACKS, Proof.WRITER_EXIT}:
                raise ConformanceFailure(f"quarantined room released by {release.proof.value}")
            settled_before(cluster, FROZEN_ROOM, released_at)
            watch = max(kvconn_settings.late_write_watch_s, 2 * kvconn_settings.write_timeout_s)
            no_late_bytes(cluster, FROZEN_ROOM, pages, watch)

    @pytest.mark.kvconn_releases
    def test_frozen_owner_gets_pages_back_only_after_drain(self, kvconn_settings: Settings) -> None:
        """A frozen page owner: the writer misses its deadline, fences and acks,
        but bytes it had already sent wait in the owner's socket buffers. Once
        the owner resumes, it must not hand the pages out before they drained."""
        require_capability(kvconn_settings.capabilities.writer_fence, "no writer fence declared")
        with _frozen_owner(kvconn_settings) as (rank, owner, pages):
            settled = rank.expect(
                kvconn_settings.write_timeout_s + 10,
                "frozen owner: the writer settles",
                event="after_barrier",
            )
            _queued_to(owner)  # before the fence: its resets take the owner's ends out of /proc's table
            # FAILED_SETTLED is a true answer too (a chunk of an aborted room
            # settled before a byte was written): it needs no fence, and the
            # watch below holds the transport to it.
            if settled["settlement"] == Settlement.UNSETTLED.value:
                rank.expect(10, "frozen owner: the writer fences", event="fencing")
                # A fence of the writer's own (agent or engine teardown) ends
                # while the owner is frozen, and its ack waits in the owner's
                # socket: the case to check. A fence that needs the owner's
                # answer (tcpdemo's in-band marker) ends after the resume.
                with contextlib.suppress(ConformanceFailure):
                    rank.expect(5, "frozen owner: the fence ends", event="fenced")
            proof = (
                "the writer's fence"
                if settled["settlement"] == Settlement.UNSETTLED.value
                else (f"the writer's {settled['settlement']} answer")
            )
            _resume_and_check(kvconn_settings, owner, pages, proof)

    @pytest.mark.kvconn_releases
    def test_frozen_owner_killed_writer_gets_pages_back_only_after_drain(
        self, kvconn_settings: Settings
    ) -> None:
        """A frozen page owner, and the writer killed with its write in flight:
        the dead writer's kernel still delivers what it had sent. The writer's
        exit proves nothing until the owner's ends of its connections drained."""
        with _frozen_owner(kvconn_settings) as (rank, owner, pages):
            rank.expect(10, "frozen owner: the writer posts", event="after_post")
            time.sleep(0.2)  # the transport fills the socket buffers towards the frozen owner
            _queued_to(owner)  # before the kill resets what the writer had unread
            kill_rank(rank, "frozen owner, killed writer", [owner.pid])
            if kvconn_settings.cross_host:
                _resume_across_hosts(kvconn_settings, owner, pages, rank)
                return
            _resume_and_check(kvconn_settings, owner, pages, "the writer's exit")

    @pytest.mark.kvconn_releases
    def test_partition_healed_after_the_deadline_lands_nothing_late(
        self, request: pytest.FixtureRequest, kvconn_settings: Settings
    ) -> None:
        """The writer's host is cut off as it posts (cross-host mode): decode's
        ABORT cannot reach it, the deadline passes, the room is quarantined,
        never released on that timeout. The link heals after the deadline; what
        was in flight may land then, in pages still held: the room is released
        only by a proof after the heal, and nothing lands after that."""
        require_capability(kvconn_settings.cross_host, NEEDS_HOSTS)
        faults = {PARTITION_ROOM: {"pause": "before_post", "pause_s": 0.5}}
        with open_cluster(
            kvconn_settings, page_bytes=MiB, num_pages=96, chunk_pages=16, faults=faults
        ) as cluster:
            warm = cluster.new_room()  # connections set up before the cut
            rx_warm = cluster.receiver(warm, cluster.alloc(2))
            cluster.wait_done(rx_warm, 30, "partition: a first room completes")
            cluster.finish(rx_warm)
            writer = cluster.ranks[0]
            assert writer.host is not None
            pages = cluster.alloc(64)
            rx = cluster.receiver(PARTITION_ROOM, pages)
            writer.expect(10, "partition: the writer is about to post", event="paused", room=PARTITION_ROOM)
            writer.host.cut()
            try:
                rx.abort()
                deadline = cluster.settings.effective_abort_timeout()
                wait_for(
                    lambda: cluster.quarantined_or_released(PARTITION_ROOM),
                    deadline + 1.0,
                    "partition: quarantined at the deadline",
                )
                time.sleep(0.5)  # healed after decode's deadline
                if cluster.release_of(PARTITION_ROOM) is not None:
                    raise ConformanceFailure(
                        "S2 violated: released while its writer was cut off (timeout alone)"
                    )
                # Nothing crosses the cut link: the pages not written yet are what the heal may still bring.
                pending = len(cluster.bad_pattern_pages(PARTITION_ROOM, pages))
                posted = any(
                    e.get("event") == "after_post" and e.get("room") == PARTITION_ROOM
                    for e in writer.history()
                )
            finally:
                writer.host.heal()
            at_stake(
                pending if posted else 0,
                1,
                f"{pending} of {len(pages)} pages of a chunk posted during the cut still to cross past decode's "
                "deadline" + ("" if posted else " (on_post had not returned)"),
                "a posted chunk with bytes still to cross when the link healed",
            )
            healed = time.monotonic()
            limit = kvconn_settings.capabilities.max_write_timeout_s or 0.0
            release, released_at = cluster.wait_released(
                PARTITION_ROOM,
                kvconn_settings.write_timeout_s + limit + 15.0,
                "partition: a proof after the heal",
            )
            if released_at < healed:
                raise ConformanceFailure("S2 violated: released before the link healed")
            if release.proof not in {Proof.LATE_ACKS, Proof.WRITER_FENCE}:
                raise ConformanceFailure(f"partition: released by {release.proof.value} after the heal")
            settled_before(cluster, PARTITION_ROOM, released_at)
            watch = max(kvconn_settings.late_write_watch_s, 2 * kvconn_settings.write_timeout_s)
            no_late_bytes(cluster, PARTITION_ROOM, pages, watch)
            log.info(
                "partition: released by %s %.2f s after the heal", release.proof.value, released_at - healed
            )

    # -- plugins that raise -------------------------------------------------------
    @pytest.mark.kvconn_releases
    def test_raising_hooks_fail_safe(self, request: pytest.FixtureRequest, kvconn_settings: Settings) -> None:
        """A hook that raises leaves the pages held: released only by the
        writer's fence or its exit, never by a plain ack."""
        faults: dict[int, dict[str, Any]] = {room: {"raise": p} for p, room in RAISE_ROOMS.items()}
        faults[RAISE_ROOMS["skip"]] = {"pause": "before_post", "index": 0, "raise": "skip", "raise_index": 1}
        faults[RAISE_ROOMS["abort"]] = {"pause": "before_post", "index": 0, "raise": "abort"}
        deadline = kvconn_settings.effective_abort_timeout()
        with open_cluster(kvconn_settings, chunk_pages=2, faults=faults) as cluster:
            writer = cluster.ranks[0]
            pages: dict[str, list[int]] = {}
            for point, room in RAISE_ROOMS.items():
                pages[point] = cluster.alloc(6)
                rx = cluster.receiver(room, pages[point])
                if point in ("skip", "abort"):
                    writer.expect(10, f"raising {point}: first chunk paused", event="paused", room=room)
                    rx.abort()
                else:
                    writer.expect(10, f"raising {point}: hook reached", event="raising", room=room)
                    rx.abort()
            wait_for(
                lambda: all(cluster.quarantined_or_released(r) for r in RAISE_ROOMS.values()),
                deadline + 1.5,
                "L2: rooms with a raising hook are released or quarantined by the deadline",
            )
            kill_rank(writer, "raising hooks", [cluster.owner_pid])
            raised_at = {e["room"]: e["t"] for e in writer.history() if e["event"] == "raising"}
            missed = [point for point, room in RAISE_ROOMS.items() if room not in raised_at]
            # A raise that a timing makes moot (the ABORT came after the chunk
            # it was to skip) leaves its room nothing to prove; the others do.
            at_stake(
                len(raised_at),
                1,
                f"hooks raised at {len(raised_at)} of {len(RAISE_POINTS)} points, each with its room aborted"
                + (f" (not at {', '.join(missed)}: the chunk went by first)" if missed else ""),
                "a hook that raised with its room's pages held",
            )
            # Across hosts no proof of the exit comes: the rooms still held stay so.
            held = (
                [r for r in RAISE_ROOMS.values() if cluster.release_of(r) is None]
                if kvconn_settings.cross_host
                else []
            )
            for point, room in RAISE_ROOMS.items():
                if room in held:
                    continue
                release, released_at = cluster.wait_released(room, 3.0, f"raising at {point}: writer exit")
                # An ack that went out before the hook raised (nothing counted then) is
                # sound; a skipped chunk is uncounted until it raises, so its room may be
                # acked before (its raise only has to leave nothing behind).
                late = point != "skip" and released_at > raised_at.get(room, float("inf"))
                if late and release.proof not in {Proof.WRITER_FENCE, Proof.WRITER_EXIT}:
                    raise ConformanceFailure(
                        f"a hook raising at {point} was followed by a release by {release.proof.value}: "
                        "acked without a fence or the writer's exit"
                    )
                if release.proof in ACK_PROOFS:
                    settled_before(cluster, room, released_at)
                no_late_bytes(cluster, room, pages[point], 0)
            every = [page for point, room in RAISE_ROOMS.items() if room not in held for page in pages[point]]
            no_late_bytes(cluster, "(any with a raising hook)", every, kvconn_settings.late_write_watch_s)
            for room in held:
                found = cluster.release_of(room)
                if found is not None and found[0].proof is not Proof.WRITER_EXIT:
                    raise ConformanceFailure(
                        f"raising hooks across hosts: room {room} released by {found[0].proof.value} after "
                        "its writer was killed on another host: no proof of that exit"
                    )
                if found is None and cluster.state(room) is not HoldState.QUARANTINED:
                    raise ConformanceFailure(
                        f"raising hooks across hosts: room {room} is {cluster.state(room)}"
                    )
