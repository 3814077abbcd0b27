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
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import pytest
import zmq

from kvconn.conformance import guard
from kvconn.conformance.checking import MiB, generous, no_late_bytes, open_cluster, settled_before
from kvconn.conformance.engine_memory import EngineMemoryChecks
from kvconn.conformance.harness import ACK_PROOFS, Cluster, ConformanceFailure, Settings, wait_for
from kvconn.conformance.plugin import require_capability
from kvconn.conformance.rank_checks import RankChecks
from kvconn.conformance.stakes import at_stake
from kvconn.conformance.transport_checks import TransportChecks
from kvconn.conformance.writer_faults import WriterFaultChecks
from kvconn.protocol.hold import Proof
from kvconn.protocol.messages import AbortAck
from kvconn.runtime.control import Outbox

#: Where an ABORT meets a chunk (the second chunk of a three-chunk room).
RACE_POINTS = ("dequeue", "before_post", "after_post", "before_barrier", "after_barrier")
RACE_ROOMS = {point: 0x5EED_0000 + i for i, point in enumerate(RACE_POINTS)}
FANOUT_ROOM = 0xFA_0001
FORGED_ROOM = 0xF06_0001
#: Rooms aborted right behind their request (the racing rank reports them).
TOMBSTONE_ROOMS = tuple(0x70B_0000 + i for i in range(5))


@pytest.mark.kvconn_conformance
class ConformanceSuite(WriterFaultChecks, TransportChecks, RankChecks, EngineMemoryChecks):
    """Subclass it (named ``Test...``) in a plugin's tests."""

    #: The backend under test; ``None``: the ``--kvconn-backend`` option.
    backend_name: ClassVar[str | None] = None
    #: Backend options (``Config.backend_options``) for every endpoint.
    backend_options: ClassVar[dict[str, str]] = {}

    # -- shared clusters --------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def healthy(cls, request: pytest.FixtureRequest, kvconn_settings: Settings) -> Iterator[Cluster]:
        with open_cluster(generous(kvconn_settings), num_ranks=2, num_pages=1024, chunk_pages=2) as cluster:
            yield cluster

    @pytest.fixture(scope="class")
    @classmethod
    def wide(cls, request: pytest.FixtureRequest, kvconn_settings: Settings) -> Iterator[Cluster]:
        stop = {FANOUT_ROOM: {"stop": "after_post"}}
        with open_cluster(
            kvconn_settings, num_ranks=3, page_bytes=3 * (16 << 10), rank_faults={2: stop}
        ) as cluster:
            yield cluster

    @pytest.fixture(scope="class")
    @classmethod
    def racing(cls, request: pytest.FixtureRequest, kvconn_settings: Settings) -> Iterator[Cluster]:
        faults: dict[int, dict[str, Any]] = {
            room: {"pause": p, "index": 1, "pause_s": 0.15} for p, room in RACE_ROOMS.items()
        }
        faults.update({room: {} for room in TOMBSTONE_ROOMS})  # reported, not disturbed
        with open_cluster(kvconn_settings, num_ranks=1, chunk_pages=2, faults=faults) as cluster:
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
        settings = generous(kvconn_settings)
        with open_cluster(settings, page_bytes=MiB, num_pages=48, source_pages=48) as cluster:
            self._integrity(cluster, [(16, False), (20, True)])

    def test_integrity_several_ranks(self, wide: Cluster) -> None:
        """Three ranks write their shards of every page."""
        self._integrity(wide, [(6, False), (13, True), (1, False)])

    def test_integrity_wide_chunks(self, request: pytest.FixtureRequest, kvconn_settings: Settings) -> None:
        """Two ranks, odd-sized shards (4099 bytes), chunks of 2048 pages with a
        guard page between each two: 2048 segments per rank in one chunk, as
        real chunks carry thousands (layers x K/V x pages)."""
        chunk = 8192 if kvconn_settings.thorough else 2048
        with open_cluster(
            generous(kvconn_settings),
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
        with the same room ids (a room id is unique per decode only), then one
        decode restarts (a new endpoint and region) and uses its room ids
        again: every room lands in its own decode's pages and nowhere else."""
        kwargs: dict[str, Any] = {"num_ranks": 2, "num_pages": 256, "chunk_pages": 3, "workers": 2}
        plans = [(7, True), (2, False), (30, True), (11, True), (64, False), (5, True)]
        settings = generous(kvconn_settings)
        with open_cluster(settings, **kwargs) as first:
            second = Cluster(settings, ranks_of=first, seed=0xDEC2, room_ids_of=first, **kwargs)
            try:
                self._integrity_of([first, second], plans)
            finally:
                second.close()
            restarted = Cluster(settings, ranks_of=first, seed=0xDEC3, room_ids_of=second, **kwargs)
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
        checked = 0
        for cluster, room, pages, rx in rooms:
            state = cluster.wait_done(rx, 60, f"integrity: room of {len(pages)} pages completes")
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
            checked += len(pages)
        page_bytes = clusters[0].page_bytes
        at_stake(
            checked,
            sum(n for n, _ in plans) * len(clusters),
            f"{len(rooms)} rooms of {checked} pages ({checked * page_bytes / MiB:.1f} MiB) written by "
            f"{clusters[0].num_ranks} ranks and compared byte for byte",
            "every room planned written and compared",
        )
        for i, cluster in enumerate(clusters):
            bad = cluster.changed_free_pages()
            if bad:
                which = f" of decode {i + 1} of {len(clusters)}" if len(clusters) > 1 else ""
                raise ConformanceFailure(
                    f"integrity: {len(bad)} pages{which} that no room held changed (pages {bad[:8]}): "
                    "a write landed outside the pages of its room"
                )

    # -- aborts: S1 at every point of a chunk's life -------------------------
    @pytest.mark.kvconn_releases
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
        posted = settled_before(racing, room, released_at)
        at_stake(
            posted,
            1,
            f"{posted} chunks of the room posted before its release (the ABORT met the second at {point})",
            "a chunk posted before the release",
        )
        no_late_bytes(racing, room, pages, 2 * kvconn_settings.write_timeout_s)

    @pytest.mark.kvconn_releases
    def test_abort_before_request_arrives(self, racing: Cluster) -> None:
        """An ABORT right behind the transfer request: tombstone, nothing written."""
        for room in TOMBSTONE_ROOMS:
            pages = racing.alloc(4)
            rx = racing.receiver(room, pages)
            rx.abort()
            _, released_at = racing.wait_released(room, 3.0, "abort before request: acked")
            settled_before(racing, room, released_at)
        rank = racing.ranks[0]

        def reached() -> set[int]:
            """The rooms whose ABORT reached the rank (decode may settle one that
            never left it without a word to the rank)."""
            return {int(e["room"]) for e in rank.history() if e.get("event") == "abort"} & set(
                TOMBSTONE_ROOMS
            )

        with contextlib.suppress(ConformanceFailure):
            wait_for(lambda: reached() == set(TOMBSTONE_ROOMS), 5.0, "abort before request: the ABORTs")
        posted = {e["room"] for e in rank.history() if e.get("event") == "before_post"} & set(TOMBSTONE_ROOMS)
        at_stake(
            len(reached()),
            1,
            f"{len(reached())} of {len(TOMBSTONE_ROOMS)} ABORTs reached the rank right behind their request "
            f"({len(posted)} of those rooms had a chunk posted first)",
            "an ABORT reaching the rank",
        )

    @pytest.mark.kvconn_releases
    def test_random_aborts_leave_no_late_write(self, healthy: Cluster, kvconn_settings: Settings) -> None:
        """Many rooms aborted at random points: every one leaves hold by acks
        within the deadline, and no byte of its pages changes after release."""
        rng = healthy.rng
        watched: list[tuple[int, list[int]]] = []
        unfinished = 0
        deadline = healthy.settings.effective_abort_timeout()
        for _wave in range(4):
            wave: list[tuple[int, list[int], Any, float]] = []
            due: list[tuple[int, list[int], Any, float]] = []

            def abort(room: int, pages: list[int], rx: Any) -> None:
                nonlocal unfinished
                if rx.poll().name != "SUCCESS":
                    unfinished += 1
                rx.abort()
                watched.append((room, pages))

            for _ in range(10):
                pages = healthy.alloc(rng.randrange(4, 24), scattered=rng.random() < 0.5)
                room = healthy.new_room()
                entry = (room, pages, healthy.receiver(room, pages), time.monotonic() + rng.uniform(0, 0.03))
                wave.append(entry)
                due.append(entry)
                # Aborted as soon as due, between the rooms opened after it: on a
                # loaded host, opening all ten first left every room complete.
                for waiting in [w for w in due if w[3] <= time.monotonic()]:
                    due.remove(waiting)
                    abort(*waiting[:3])
            for room, pages, rx, at in sorted(due, key=lambda w: w[3]):
                time.sleep(max(0.0, at - time.monotonic()))
                abort(room, pages, rx)
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
                settled_before(healthy, room, released_at)
        at_stake(
            unfinished,
            1,
            f"{unfinished} of {len(watched)} rooms aborted before they completed",
            "a room aborted while its transfer ran",
        )
        time.sleep(2 * kvconn_settings.write_timeout_s)
        for room, pages in watched:
            no_late_bytes(healthy, room, pages, 0)

    @pytest.mark.kvconn_releases
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
        settled_before(wide, FANOUT_ROOM, released_at)
        unacked = sum(
            1 for e in straggler.history() if e.get("room") == FANOUT_ROOM and e["event"] == "after_post"
        )
        at_stake(
            unacked,
            1,
            f"rank 2 of 3 frozen with {unacked} chunk posted, unacked, while ranks 0 and 1 acked",
            "a rank with a chunk posted and not acked",
        )
        no_late_bytes(wide, FANOUT_ROOM, pages, 2 * kvconn_settings.write_timeout_s)

    # -- acks that prove nothing ------------------------------------------------
    @pytest.mark.kvconn_releases
    def test_forged_late_duplicate_acks_release_nothing(
        self, request: pytest.FixtureRequest, kvconn_settings: Settings
    ) -> None:
        """S3: late, duplicate, wrong-generation, stranger and malformed acks
        never release a room, nor stop the listener."""
        faults = {0: {FORGED_ROOM: {}}, 1: {FORGED_ROOM: {"stop": "after_post"}}}
        with open_cluster(kvconn_settings, num_ranks=2, rank_faults=faults) as cluster:
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
                at_stake(
                    len(forged) + 4,
                    1,
                    f"{len(forged)} forged acks and 4 malformed frames sent while the room was held "
                    f"({cluster.state(FORGED_ROOM)})",
                    "a frame that could release the room",
                )
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

    # -- the run's guard ------------------------------------------------------------
    def test_nothing_landed_late_in_the_whole_run(
        self, kvconn_settings: Settings, record_property: Callable[[str, object], None]
    ) -> None:
        """The suite's last check (whatever ``-k`` selects, it runs after the
        others of its class): every page a check got back (released rooms,
        fenced regions, cancelled writes) still holds what it must, at least
        ``guard_s`` after the last one came back. A write deferred past every
        check's own watch window fails here, naming the check that released
        the pages it landed in."""
        kept = guard.GUARD.kept()
        # A shared cluster that released nothing yet has no "since" (0).
        released = [t for item in kept if (t := item.since()) > 0]
        if not released:
            guard.GUARD.close()
            require_capability(False, "no check of this run released pages or fenced a region to guard")
        oldest, youngest = min(released), max(released)
        window = kvconn_settings.guard_s
        try:
            found = guard.GUARD.watch(window)
            now = time.monotonic()
            at_stake(
                len(released),
                1,
                f"{len(released)} regions released or fenced by {len({i.check for i in kept})} checks, each "
                f"guarded {now - youngest:.0f} s at least (the window: {window:.0f} s) and up to "
                f"{now - oldest:.0f} s",
                "a region a check released",
            )
        finally:
            guard.GUARD.close()  # frees the regions kept, ends the writers kept alive
        if found:
            raise ConformanceFailure(
                f"late write in the whole run: {len(found)} guarded regions changed after the check "
                "that released them ended: " + "; ".join(found[:4])
            )
