"""A prefill host whose clocks are far off: nothing may depend on clocks
agreeing. The ranks run in their own host's network (kvconn.testing.hosts)
and, for "far_off", in a time namespace of their own whose CLOCK_MONOTONIC
and CLOCK_BOOTTIME read 10^6 s (11.6 days) ahead of decode's. A normal room,
an abort settled by acks, a deadline-driven quarantine ended by late acks
and one ended by the writer's exit must come out the same either way: every
deadline is kept on one process's own clock, and no clock value crosses the
wire. (The /proc start time a HelloAck carries to name the writer's process
is boot-clock based and shown shifted by the reader's time namespace:
kvconn takes that shift back off, or the writer-exit proof would be lost.)

CLOCK_REALTIME cannot be offset by a time namespace; no protocol decision
reads it (``time.time`` appears nowhere in kvconn's sources).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from kvconn.protocol.hold import HoldState
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.procs import wait_until_stopped
from kvconn.testing import hosts
from kvconn.testing.cluster import Cluster
from kvconn.testing.hosts import Fabric
from kvconn.testing.waiting import wait_for

OFFSET_S = 1_000_000
SKEW = ["unshare", "--time", f"--monotonic={OFFSET_S}", f"--boottime={OFFSET_S}"]
ROOM_PAGES = 16
#: Slow enough that an abort lands mid-transfer; rank 0 freezes itself mid-write
#: in room 8002, rank 1 in room 8003.
OPTIONS = {"piece_bytes": "16384", "piece_delay_s": "0.02", "freeze_chunks": "0:8002:0,1:8003:0"}


def _why_not() -> str:
    if why := hosts.unavailable():
        return why
    done = subprocess.run([*SKEW, "true"], capture_output=True, text=True)
    return "" if done.returncode == 0 else f"unshare --time refused: {done.stderr.strip()}"


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "n/a")


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    with hosts.hosts(("decode", "prefill0")) as made:
        yield made


def _offset_of(pid: int) -> int:
    with open(f"/proc/{pid}/timens_offsets") as f:
        return {name: int(secs) for name, secs, _ns in (line.split() for line in f)}["monotonic"]


def _quarantined_then(c: Cluster, room: int, rank: int, end: signal.Signals) -> str:
    """Rank ``rank`` freezes itself mid-write in ``room``; decode aborts, its
    deadline passes, the pages are quarantined and stay so while the writer
    is frozen; ``end`` then settles them. The proof that released them."""
    rx, _pages = c.open(room, ROOM_PAGES)
    wait_until_stopped(c.ranks[rank].proc.pid, timeout=20)
    rx.abort()
    wait_for(lambda: rx.state() is HoldState.QUARANTINED, 5, "quarantine")
    assert c.released(room) is None
    time.sleep(0.3)  # frozen past decode's deadline: still nothing released
    assert c.released(room) is None
    c.ranks[rank].signal(end)
    wait_for(lambda: c.released(room) is not None, 10, f"release after {end.name}")
    rel = c.released(room)
    assert rel is not None
    return rel.proof.value


@pytest.mark.parametrize("clocks", ["agreeing", "far_off"])
def test_rooms_aborts_and_quarantines_do_not_depend_on_clocks_agreeing(fabric: Fabric, clocks: str) -> None:
    decode, rank_host = fabric["decode"], fabric["prefill0"]
    with decode.entered():
        c = Cluster(
            write_timeout_s=0.4,
            abort_timeout_s=1.0,
            decode_host=decode.ip,
            rank_host=rank_host.ip,
            netns=rank_host.netns,
            wrap=SKEW if clocks == "far_off" else (),
            backend_options=OPTIONS,
        )
    try:
        offsets = {_offset_of(r.proc.pid) for r in c.ranks}
        assert offsets == ({OFFSET_S} if clocks == "far_off" else {0})
        proofs: list[str] = []
        # a normal room
        rx, pages = c.open(8000, ROOM_PAGES)
        wait_for(lambda: rx.poll() is KVPoll.SUCCESS, 10, "room 8000")
        assert c.correct(8000, pages)
        c.finish(rx)  # a finished room's pages go straight back: no Release
        assert c.metric("kvconn_pages_held") == 0
        # an abort mid-transfer, settled by both ranks' acks before the deadline
        rx, pages = c.open(8001, ROOM_PAGES)
        wait_for(lambda: c.landed_bytes(pages) > 0, 10, "first bytes of room 8001")
        rx.abort()
        wait_for(lambda: c.released(8001) is not None, 5, "release of room 8001")
        proofs.append(c.released(8001).proof.value)  # type: ignore[union-attr]
        assert c.metric("kvconn_quarantines_total") == 0
        # deadline-driven quarantines: ended by late acks, then by the writer's exit
        proofs.append(_quarantined_then(c, 8002, 0, signal.SIGCONT))
        proofs.append(_quarantined_then(c, 8003, 1, signal.SIGKILL))
        assert proofs[0] == "acks"
        assert proofs[1] in ("late_acks", "writer_fence")
        assert proofs[2] == "writer_exit"  # lost, before the start-time fix, with far-off clocks
        assert c.metric("kvconn_quarantines_total") == 2
        assert c.metric("kvconn_pages_quarantined") == 0 and c.metric("kvconn_pages_held") == 0
        assert c.late_bytes() == 0
    finally:
        c.close()
