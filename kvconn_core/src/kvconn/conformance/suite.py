"""The conformance checks, as a pytest class a plugin's tests subclass::

    from kvconn.conformance import ConformanceSuite

    class TestMyTransport(ConformanceSuite):
        backend_name = "mytransport"

(or leave ``backend_name`` unset and pass ``--kvconn-backend NAME``). Every
check runs real processes: decode's endpoint lives in the test process, each
prefill rank or bare writer is a child process using the plugin's transport.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import attrs
import pytest
import zmq

from kvconn.conformance.engine_memory import EngineMemoryChecks
from kvconn.conformance.harness import (
    ACK_PROOFS,
    Child,
    Cluster,
    ConformanceFailure,
    OwnerProc,
    RankProc,
    Settings,
    wait_for,
)
from kvconn.conformance.plugin import require_capability
from kvconn.conformance.transport_checks import TransportChecks
from kvconn.protocol.hold import HoldState, Proof
from kvconn.protocol.messages import AbortAck, TcpConnection
from kvconn.runtime.control import Outbox
from kvconn.runtime.sockets import TcpTable
from kvconn.testing.hosts import tcp_ends_of
from kvconn.transport import Settlement

MiB = 1 << 20
log = logging.getLogger(__name__)

#: Where an ABORT meets a chunk (the second chunk of a three-chunk room).
RACE_POINTS = ("dequeue", "before_post", "after_post", "before_barrier", "after_barrier")
RACE_ROOMS = {point: 0x5EED_0000 + i for i, point in enumerate(RACE_POINTS)}
#: Hooks that raise, and the room each one raises for.
RAISE_POINTS = ("dequeue", "skip", "before_post", "after_post", "before_barrier", "after_barrier", "abort")
RAISE_ROOMS = {point: 0x0BAD_0000 + i for i, point in enumerate(RAISE_POINTS)}
FANOUT_ROOM = 0xFA_0001
FROZEN_ROOM = 0xF0_0001
KILLED_ROOM = 0xDEAD_0001
FORGED_ROOM = 0xF06_0001
OWNER_ROOM = 0x0F0_0001
PARTITION_ROOM = 0xC07_0001


def _generous(settings: Settings) -> Settings:
    """For checks of where bytes land, not how fast: deadlines a healthy
    write meets on a loaded host (a first write may set up a connection)."""
    return attrs.evolve(
        settings,
        write_timeout_s=max(settings.write_timeout_s, 5.0),
        abort_timeout_s=max(settings.abort_timeout_s, 10.0),
    )


@contextmanager
def _cluster(request: pytest.FixtureRequest, settings: Settings, **kwargs: Any) -> Iterator[Cluster]:
    cluster = Cluster(settings, **kwargs)
    try:
        yield cluster
    finally:
        cluster.close()


def _settled_before(cluster: Cluster, room: int, released_at: float) -> None:
    """S1 seen from outside: every chunk of ``room`` that any rank posted had
    settled (its DONE barrier returned) before decode got the room back."""
    for rank in cluster.ranks:

        def seen(rank: Any = rank) -> tuple[set[int], dict[int, dict[str, Any]]]:
            events = [e for e in rank.history() if e.get("room") == room]
            posted = {e["index"] for e in events if e["event"] == "before_post"}
            return posted, {e["index"]: e for e in events if e["event"] == "after_barrier"}

        # The child reports before it acks, but its pipe may lag decode's socket.
        deadline = time.monotonic() + 1.0
        posted, settled = seen()
        while not posted <= settled.keys() and time.monotonic() < deadline:
            time.sleep(0.01)
            posted, settled = seen()
        for index in sorted(posted):
            done = settled.get(index)
            if done is None or done["t"] > released_at:
                when = "never" if done is None else f"{done['t'] - released_at:+.4f} s after the release"
                raise ConformanceFailure(
                    f"S1 violated: room {room} was released while chunk {index} of rank "
                    f"{rank.address} could still land (its DONE barrier settled {when})"
                )


def _no_late_bytes(cluster: Cluster, room: int | str, pages: list[int], settle_s: float) -> None:
    """The released pages of ``room`` keep their canary for ``settle_s``
    (checked along the way, so a late write fails the check at once)."""
    deadline = time.monotonic() + settle_s
    while True:
        bad = cluster.changed_after_release(pages)
        if bad:
            raise ConformanceFailure(
                f"late write after release: {len(bad)} pages of aborted room {room} changed after "
                f"decode released them (pages {bad[:8]})"
            )
        if time.monotonic() >= deadline:
            return
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


#: How long a process the rank started may linger after the rank died (the
#: interpreter's own helpers, e.g. multiprocessing's resource tracker, exit
#: within milliseconds of their parent).
SURVIVOR_GRACE_S = 1.0


def _kill_rank(rank: Child, what: str) -> None:
    """Kill a rank and check that nothing it started outlives it: the core
    takes the rank's exit as proof that none of its writes can land, which
    a helper process (an offload engine, a daemon) still writing makes false."""
    rank.kill()
    try:
        wait_for(lambda: not rank.survivors(), SURVIVOR_GRACE_S, what, poll=0.05)
    except ConformanceFailure:
        left = rank.survivors()
        if left:
            rank.reap_survivors()
            raise ConformanceFailure(
                f"{what}: processes the rank started outlived it ({'; '.join(left[:3])}): whatever they "
                "can write still lands after the rank's exit, which then proves nothing"
            ) from None


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
    _kill_rank(victim, "killed writer")
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
            _no_late_bytes(cluster, room, pages, settings.late_write_watch_s)
            return
        time.sleep(0.05)
    if cluster.state(room) is not HoldState.QUARANTINED:
        raise ConformanceFailure(
            f"killed writer across hosts: room {room} is {cluster.state(room)} past decode's deadline, "
            "not quarantined"
        )


def _resume_across_hosts(settings: Settings, owner: OwnerProc, pages: list[int]) -> None:
    """The frozen owner resumes after its writer on another host was killed:
    no proof of that exit can come, so the room is not released (a release
    would have to name a proof, and no timeout is one)."""
    owner.signal(signal.SIGCONT)
    try:
        release = owner.expect(
            settings.effective_abort_timeout() + settings.late_write_watch_s,
            "frozen owner across hosts",
            event="released",
        )
    except ConformanceFailure:
        return  # held: quarantined, visible, until an owner-side fence
    if release["proof"] != Proof.WRITER_EXIT.value:
        raise ConformanceFailure(
            f"frozen owner across hosts: released by {release['proof']} after its writer was killed "
            "on another host: no proof of that exit"
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
    finally:
        if owner is not None:
            owner.close()
        rank.close()


def _resume_and_check(settings: Settings, owner: OwnerProc, pages: list[int], proof: str) -> None:
    """Resume the owner; once it released the room (and wrote fresh canaries
    into its pages), no byte of the old write may change them."""
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
            return
        time.sleep(0.25)


@pytest.mark.kvconn_conformance
class ConformanceSuite(TransportChecks, EngineMemoryChecks):
    """Subclass it (named ``Test...``) in a plugin's tests."""

    #: The backend under test; ``None``: the ``--kvconn-backend`` option.
    backend_name: ClassVar[str | None] = None
    #: Backend options (``Config.backend_options``) for every endpoint.
    backend_options: ClassVar[dict[str, str]] = {}

    # -- shared clusters --------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def healthy(cls, request: pytest.FixtureRequest, kvconn_settings: Settings) -> Iterator[Cluster]:
        generous = _generous(kvconn_settings)
        with _cluster(request, generous, num_ranks=2, num_pages=1024, chunk_pages=2) as cluster:
            yield cluster

    @pytest.fixture(scope="class")
    @classmethod
    def wide(cls, request: pytest.FixtureRequest, kvconn_settings: Settings) -> Iterator[Cluster]:
        stop = {FANOUT_ROOM: {"stop": "after_post"}}
        with _cluster(
            request, kvconn_settings, num_ranks=3, page_bytes=3 * (16 << 10), rank_faults={2: stop}
        ) as cluster:
            yield cluster

    @pytest.fixture(scope="class")
    @classmethod
    def racing(cls, request: pytest.FixtureRequest, kvconn_settings: Settings) -> Iterator[Cluster]:
        faults = {room: {"pause": p, "index": 1, "pause_s": 0.15} for p, room in RACE_ROOMS.items()}
        with _cluster(request, kvconn_settings, num_ranks=1, chunk_pages=2, faults=faults) as cluster:
            yield cluster

    # -- data integrity -----------------------------------------------------
    @pytest.mark.parametrize("shape", ["one_page", "scattered", "many_rooms"])
    def test_integrity(self, healthy: Cluster, shape: str) -> None:
        """Chunked writes by two ranks land byte-exact (shapes of page lists)."""
        plans = {
            "one_page": [(1, False)],
            "scattered": [(40, True)],
            "many_rooms": [(n, n % 2 == 0) for n in (3, 8, 17, 24, 5, 12, 31, 2)],
        }[shape]
        self._integrity(healthy, plans)

    def test_integrity_large_pages(self, request: pytest.FixtureRequest, kvconn_settings: Settings) -> None:
        """1 MiB pages, 4 MiB chunks."""
        settings = _generous(kvconn_settings)
        with _cluster(request, settings, page_bytes=MiB, num_pages=48, source_pages=48) as cluster:
            self._integrity(cluster, [(16, False), (20, True)])

    def test_integrity_several_ranks(self, wide: Cluster) -> None:
        """Three ranks write their shards of every page."""
        self._integrity(wide, [(6, False), (13, True), (1, False)])

    def test_integrity_wide_chunks(self, request: pytest.FixtureRequest, kvconn_settings: Settings) -> None:
        """Two ranks, odd-sized shards (4099 bytes), chunks of 2048 pages with a
        guard page between each two: 2048 segments per rank in one chunk, as
        real chunks carry thousands (layers x K/V x pages)."""
        chunk = 8192 if kvconn_settings.thorough else 2048
        with _cluster(
            request,
            _generous(kvconn_settings),
            num_ranks=2,
            page_bytes=2 * 4099,
            num_pages=4 * chunk,
            chunk_pages=chunk,
            source_pages=chunk + chunk // 2,
        ) as cluster:
            self._integrity(cluster, [(chunk, "strided"), (chunk // 2 - 1, "strided")])

    def test_two_decodes_share_a_rank(
        self, request: pytest.FixtureRequest, kvconn_settings: Settings
    ) -> None:
        """Two decodes read from the same two ranks (two workers each) at once,
        then one decode restarts (a new endpoint and region): every room lands
        in its own decode's pages and nowhere else."""
        kwargs: dict[str, Any] = {"num_ranks": 2, "num_pages": 256, "chunk_pages": 3, "workers": 2}
        plans = [(7, True), (2, False), (30, True), (11, True), (64, False), (5, True)]
        settings = _generous(kvconn_settings)
        with _cluster(request, settings, **kwargs) as first:
            second = Cluster(settings, ranks_of=first, seed=0xDEC2, **kwargs)
            try:
                self._integrity_of([first, second], plans)
            finally:
                second.close()
            restarted = Cluster(settings, ranks_of=first, seed=0xDEC3, **kwargs)
            try:
                self._integrity_of([restarted, first], plans)
            finally:
                restarted.close()

    def _integrity(self, cluster: Cluster, plans: Sequence[tuple[int, bool | str]]) -> None:
        self._integrity_of([cluster], plans)

    def _integrity_of(self, clusters: list[Cluster], plans: Sequence[tuple[int, bool | str]]) -> None:
        """Rooms of ``plans`` opened on every cluster's decode in turn, all in
        flight together, then checked page by page."""
        rooms = []
        for n, scattered in plans:
            for cluster in clusters:
                pages = (
                    cluster.alloc_strided(n) if scattered == "strided" else cluster.alloc(n, bool(scattered))
                )
                room = cluster.new_room()
                rooms.append((cluster, room, pages, cluster.receiver(room, pages)))
        for cluster, room, pages, rx in rooms:
            state = cluster.wait_done(rx, 30, f"integrity: room of {len(pages)} pages completes")
            if state != "SUCCESS":
                raise ConformanceFailure(f"integrity: room {room} ended {state}: {rx.failure()}")
            bad = cluster.bad_pattern_pages(room, pages)
            if bad:
                which = (
                    f" of decode {clusters.index(cluster) + 1} of {len(clusters)}"
                    if len(clusters) > 1
                    else ""
                )
                raise ConformanceFailure(
                    f"integrity: {len(bad)} of {len(pages)} pages of room {room}{which} hold wrong bytes "
                    f"after SUCCESS (pages {bad[:8]})"
                )
            cluster.finish(rx)
        for i, cluster in enumerate(clusters):
            bad = cluster.changed_free_pages()
            if bad:
                which = f" of decode {i + 1} of {len(clusters)}" if len(clusters) > 1 else ""
                raise ConformanceFailure(
                    f"integrity: {len(bad)} pages{which} that no room held changed (pages {bad[:8]}): "
                    "a write landed outside the pages of its room"
                )

    # -- aborts: S1 at every point of a chunk's life -------------------------
    @pytest.mark.parametrize("point", RACE_POINTS)
    def test_abort_races_chunk(self, racing: Cluster, kvconn_settings: Settings, point: str) -> None:
        """An ABORT arriving while the second chunk is at ``point``: the ack comes
        only after every posted chunk settled, and nothing lands after release."""
        room = RACE_ROOMS[point]
        pages = racing.alloc(6)
        rx = racing.receiver(room, pages)
        racing.ranks[0].expect(10, f"abort race at {point}: chunk reaches it", event="paused", room=room)
        rx.abort()
        release, released_at = racing.wait_released(
            room, kvconn_settings.write_timeout_s + 2.0, f"L1 at {point}: healthy writer acks"
        )
        if release.proof not in ACK_PROOFS:
            raise ConformanceFailure(
                f"abort race at {point}: healthy writer, released by {release.proof.value}"
            )
        _settled_before(racing, room, released_at)
        _no_late_bytes(racing, room, pages, 2 * kvconn_settings.write_timeout_s)

    def test_abort_before_request_arrives(self, racing: Cluster) -> None:
        """An ABORT right behind the transfer request: tombstone, nothing written."""
        for _ in range(5):
            room = racing.new_room()
            pages = racing.alloc(4)
            rx = racing.receiver(room, pages)
            rx.abort()
            _, released_at = racing.wait_released(room, 3.0, "abort before request: acked")
            _settled_before(racing, room, released_at)

    def test_random_aborts_leave_no_late_write(self, healthy: Cluster, kvconn_settings: Settings) -> None:
        """Many rooms aborted at random points: every one leaves hold by acks
        within the deadline, and no byte of its pages changes after release."""
        rng = healthy.rng
        watched: list[tuple[int, list[int]]] = []
        deadline = healthy.settings.effective_abort_timeout()
        for _wave in range(4):
            wave = []
            for _ in range(10):
                pages = healthy.alloc(rng.randrange(4, 24), scattered=rng.random() < 0.5)
                room = healthy.new_room()
                wave.append(
                    (room, pages, healthy.receiver(room, pages), time.monotonic() + rng.uniform(0, 0.03))
                )
            for room, pages, rx, at in sorted(wave, key=lambda w: w[3]):
                time.sleep(max(0.0, at - time.monotonic()))
                rx.abort()
                watched.append((room, pages))
            for room, _, _, _ in wave:
                release, released_at = healthy.wait_released(
                    room, deadline + 2.0, "L2: aborted room leaves hold"
                )
                if release.proof not in ACK_PROOFS | {Proof.WRITER_FENCE}:
                    raise ConformanceFailure(
                        f"healthy writers, room {room} released by {release.proof.value}"
                    )
                if release.quarantined_for > 0:
                    raise ConformanceFailure(f"L1: healthy writers, room {room} was quarantined")
                _settled_before(healthy, room, released_at)
        time.sleep(2 * kvconn_settings.write_timeout_s)
        for room, pages in watched:
            _no_late_bytes(healthy, room, pages, 0)

    # -- unhealthy writers ------------------------------------------------------
    def test_killed_writer_proves_exit(
        self, request: pytest.FixtureRequest, kvconn_settings: Settings
    ) -> None:
        """A rank killed with a write in flight: held until its exit is proven, then released."""
        faults = {1: {KILLED_ROOM: {"stop": "after_post"}}}
        with _cluster(request, kvconn_settings, num_ranks=2, chunk_pages=8, rank_faults=faults) as cluster:
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
            if kvconn_settings.cross_host:
                _killed_across_hosts(cluster, victim, KILLED_ROOM, pages)
                return
            _kill_rank(victim, "killed writer")
            release, _ = cluster.wait_released(KILLED_ROOM, 3.0, "writer exit: killed rank proven gone")
            if release.proof is not Proof.WRITER_EXIT:
                raise ConformanceFailure(
                    f"killed writer: released by {release.proof.value}, expected writer_exit"
                )
            _no_late_bytes(cluster, KILLED_ROOM, pages, kvconn_settings.late_write_watch_s)

    def test_frozen_writer_quarantine_then_proof(
        self, request: pytest.FixtureRequest, kvconn_settings: Settings
    ) -> None:
        """A writer frozen mid-chunk past decode's deadline: quarantined, never
        released on the timeout; once it resumes, a proof (fence or late ack) frees it."""
        faults = {FROZEN_ROOM: {"stop": "after_post"}}
        with _cluster(
            request, kvconn_settings, page_bytes=256 << 10, num_pages=96, chunk_pages=16, faults=faults
        ) as cluster:
            pages = cluster.alloc(64)
            rx = cluster.receiver(FROZEN_ROOM, pages)
            writer = cluster.ranks[0]
            writer.expect(10, "frozen writer: posts", event="stopping")
            wait_for(writer.stopped, 5, "frozen writer: froze")
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
                _kill_rank(writer, "frozen writer")  # no fence declared: only its exit proves it
                release, released_at = cluster.wait_released(FROZEN_ROOM, 3.0, "L2: writer exit")
            if released_at < resumed:
                raise ConformanceFailure("S2 violated: released before the frozen writer resumed")
            if release.proof not in {Proof.WRITER_FENCE, Proof.LATE_ACKS, Proof.WRITER_EXIT}:
                raise ConformanceFailure(f"quarantined room released by {release.proof.value}")
            _settled_before(cluster, FROZEN_ROOM, released_at)
            watch = max(kvconn_settings.late_write_watch_s, 2 * kvconn_settings.write_timeout_s)
            _no_late_bytes(cluster, FROZEN_ROOM, pages, watch)

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

    def test_frozen_owner_killed_writer_gets_pages_back_only_after_drain(
        self, kvconn_settings: Settings
    ) -> None:
        """A frozen page owner, and the writer killed with its write in flight:
        the dead writer's kernel still delivers what it had sent. The writer's
        exit proves nothing until the owner's ends of its connections drained."""
        with _frozen_owner(kvconn_settings) as (rank, owner, pages):
            rank.expect(10, "frozen owner: the writer posts", event="after_post")
            time.sleep(0.2)  # the transport fills the socket buffers towards the frozen owner
            _kill_rank(rank, "frozen owner, killed writer")
            if kvconn_settings.cross_host:
                _resume_across_hosts(kvconn_settings, owner, pages)
                return
            _resume_and_check(kvconn_settings, owner, pages, "the writer's exit")

    def test_partition_healed_after_the_deadline_lands_nothing_late(
        self, request: pytest.FixtureRequest, kvconn_settings: Settings
    ) -> None:
        """The writer's host is cut off as it posts (cross-host mode): decode's
        ABORT cannot reach it, the deadline passes, the room is quarantined,
        never released on that timeout. The link heals after the deadline; what
        was in flight may land then, in pages still held: the room is released
        only by a proof after the heal, and nothing lands after that."""
        require_capability(
            kvconn_settings.cross_host, "a partition needs hosts to cut apart (--kvconn-cross-host)"
        )
        faults = {PARTITION_ROOM: {"pause": "before_post", "pause_s": 0.5}}
        with _cluster(
            request, kvconn_settings, page_bytes=MiB, num_pages=96, chunk_pages=16, faults=faults
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
            finally:
                writer.host.heal()
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
            _settled_before(cluster, PARTITION_ROOM, released_at)
            watch = max(kvconn_settings.late_write_watch_s, 2 * kvconn_settings.write_timeout_s)
            _no_late_bytes(cluster, PARTITION_ROOM, pages, watch)
            log.info(
                "partition: released by %s %.2f s after the heal", release.proof.value, released_at - healed
            )

    def test_fanout_needs_every_rank(self, wide: Cluster, kvconn_settings: Settings) -> None:
        """A room written by three ranks is released only after all three acked."""
        pages = wide.alloc(12)
        rx = wide.receiver(FANOUT_ROOM, pages)
        straggler = wide.ranks[2]
        straggler.expect(10, "fan-out: rank 2 posts", event="stopping")
        wait_for(straggler.stopped, 5, "fan-out: rank 2 froze")
        rx.abort()
        time.sleep(min(0.5, wide.settings.effective_abort_timeout() / 3))
        if wide.release_of(FANOUT_ROOM) is not None:
            raise ConformanceFailure("fan-out: released before rank 2 acked (2 of 3 ranks)")
        resumed = time.monotonic()
        straggler.signal(signal.SIGCONT)
        release, released_at = wide.wait_released(
            FANOUT_ROOM, wide.settings.effective_abort_timeout() + 3.0, "fan-out: all three ranks ack"
        )
        if released_at < resumed:
            raise ConformanceFailure("fan-out: released before the third rank resumed")
        if release.proof not in ACK_PROOFS | {Proof.WRITER_FENCE}:
            raise ConformanceFailure(f"fan-out: released by {release.proof.value}")
        _settled_before(wide, FANOUT_ROOM, released_at)
        _no_late_bytes(wide, FANOUT_ROOM, pages, 2 * kvconn_settings.write_timeout_s)

    # -- acks that prove nothing ------------------------------------------------
    def test_forged_late_duplicate_acks_release_nothing(
        self, request: pytest.FixtureRequest, kvconn_settings: Settings
    ) -> None:
        """S3: late, duplicate, wrong-generation, stranger and malformed acks
        never release a room, nor stop the listener."""
        faults = {0: {FORGED_ROOM: {}}, 1: {FORGED_ROOM: {"stop": "after_post"}}}
        with _cluster(request, kvconn_settings, num_ranks=2, rank_faults=faults) as cluster:
            early = cluster.new_room()
            rx = cluster.receiver(early, cluster.alloc(4))
            cluster.wait_done(rx, 10, "S3: first room completes")
            rx.abort()  # completed: released at once, no ABORT sent
            pages = cluster.alloc(8)
            rx_held = cluster.receiver(FORGED_ROOM, pages)
            writer = cluster.ranks[1]
            writer.expect(10, "S3: rank 1 posts", event="stopping")
            wait_for(writer.stopped, 5, "S3: rank 1 froze")
            rx_held.abort()  # the first ABORT of this endpoint: generation 1
            # Rank 0 acks now (or already reported the room complete).
            outbox = Outbox(cluster.endpoint.config.auth_key)
            raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
            raw.setsockopt(zmq.LINGER, 0)
            address = cluster.endpoint.address
            raw.connect(address)
            try:
                time.sleep(0.2)
                me = cluster.endpoint.name
                s0, s1 = cluster.endpoint.session_of(0), cluster.endpoint.session_of(1)
                forged = [AbortAck(FORGED_ROOM, 0, gen, False, me, s0) for gen in range(0, 6)]  # duplicates
                forged += [
                    AbortAck(FORGED_ROOM, 1, 10**9, False, me, s1),  # a generation never sent
                    AbortAck(FORGED_ROOM, 1, 0, True, me, s1),
                    AbortAck(FORGED_ROOM, 7, 1, False, me, s1),  # a rank that does not write the room
                    AbortAck(early, 1, 1, False, me, s1),  # a room no longer held
                    AbortAck(FORGED_ROOM + 1, 1, 1, False, me, s1),  # a room never held
                    AbortAck(FORGED_ROOM, 1, 1, False, me, s1 ^ 1),  # another process at rank 1's address
                    AbortAck(FORGED_ROOM, 1, 1, False, "decode-elsewhere", s1),  # for another decode
                ]
                for ack in forged:
                    outbox.send(address, ack)
                for frame in (b"", b"\x00", b"\xff" * 64, bytes(range(256))):
                    raw.send(frame)
                time.sleep(0.3)
                found = cluster.release_of(FORGED_ROOM)
                if found is not None:
                    raise ConformanceFailure(
                        "S3 violated: a duplicate, stranger or wrong-generation ack released a room "
                        f"whose rank 1 never acked ({found[0]})"
                    )
                resumed = time.monotonic()
                writer.signal(signal.SIGCONT)
                _, released_at = cluster.wait_released(
                    FORGED_ROOM,
                    cluster.settings.effective_abort_timeout() + 3.0,
                    "S3: the real ack still releases",
                )
                if released_at < resumed:
                    raise ConformanceFailure("S3 violated: released before rank 1 resumed and acked")
                for gen in range(0, 6):  # late acks of a released room
                    outbox.send(address, AbortAck(FORGED_ROOM, 1, gen, False, me, s1))
                # The listener still works: a fresh room completes and its abort releases it.
                last = cluster.new_room()
                rx = cluster.receiver(last, cluster.alloc(2))
                cluster.wait_done(rx, 10, "S3: the listener survives forged frames")
                rx.abort()
                cluster.wait_released(last, 3.0, "S3: a completed room is released after forged frames")
            finally:
                outbox.close()
                raw.close()

    # -- plugins that raise -------------------------------------------------------
    def test_raising_hooks_fail_safe(self, request: pytest.FixtureRequest, kvconn_settings: Settings) -> None:
        """A hook that raises leaves the pages held: released only by the
        writer's fence or its exit, never by a plain ack."""
        faults: dict[int, dict[str, Any]] = {room: {"raise": p} for p, room in RAISE_ROOMS.items()}
        faults[RAISE_ROOMS["skip"]] = {"pause": "before_post", "index": 0, "raise": "skip", "raise_index": 1}
        faults[RAISE_ROOMS["abort"]] = {"pause": "before_post", "index": 0, "raise": "abort"}
        deadline = kvconn_settings.effective_abort_timeout()
        with _cluster(request, kvconn_settings, chunk_pages=2, faults=faults) as cluster:
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
            _kill_rank(writer, "raising hooks")
            raised_at = {e["room"]: e["t"] for e in writer.history() if e["event"] == "raising"}
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
                    _settled_before(cluster, room, released_at)
                _no_late_bytes(cluster, room, pages[point], 0)
            every = [page for point, room in RAISE_ROOMS.items() if room not in held for page in pages[point]]
            _no_late_bytes(cluster, "(any with a raising hook)", every, kvconn_settings.late_write_watch_s)
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
