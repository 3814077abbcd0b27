"""A network partition between prefill and decode: the prefill ranks run in
their own network namespace, joined to decode's (the test's) namespace by a
veth pair this test creates, with addresses from 10.213.7.0/30 used only
there. The control plane (HELLO, TRANSFER_REQUEST, ABORT, ABORT_ACK, status)
crosses the veth; the loopback transport's data plane is shared memory on
this host, so it does NOT cross the veth and keeps writing during the cut,
which is the worst case for decode: a live, writing prefill it cannot reach.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from kvconn.protocol.hold import HoldState
from kvconn.testing.cluster import PROOFS, Cluster, total, wait_for

DECODE_IP, PREFILL_IP = "10.213.7.1", "10.213.7.2"
ROOM_PAGES = 16
NROOMS = 4


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def netns() -> Iterator[tuple[str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"kvconn-p-{tag}", f"kvd{tag}", f"kvp{tag}"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr!r}")
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{DECODE_IP}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{PREFILL_IP}/30", "dev", ns_if)
        _ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_if
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_partition_mid_transfer(netns: tuple[str, str]) -> None:
    ns, host_if = netns
    c = Cluster(
        write_timeout_s=0.4,
        abort_timeout_s=1.2,
        decode_host=DECODE_IP,
        rank_host=PREFILL_IP,
        netns=ns,
        backend_options={"piece_bytes": "16384", "piece_delay_s": "0.02"},
    )
    try:
        assert c.dec.address.startswith(f"tcp://{DECODE_IP}:")
        assert all(r.address.startswith(f"tcp://{PREFILL_IP}:") for r in c.ranks)
        rooms = {9000 + i: c.open(9000 + i, ROOM_PAGES) for i in range(NROOMS)}
        wait_for(lambda: c.landed_bytes(rooms[9000][1]) > 0, 10, "first bytes")
        _ip("link", "set", host_if, "down")  # the cut
        t_cut = time.monotonic()
        for rx, _ in rooms.values():
            rx.abort()
        wait_for(
            lambda: all(rx.state() is HoldState.QUARANTINED for rx, _ in rooms.values()), 5, "quarantine"
        )
        # partitioned: nothing is released although the deadline passed
        time.sleep(0.5)
        assert not any(c.released(r) for r in rooms)
        assert c.metric("kvconn_pages_quarantined") == NROOMS * ROOM_PAGES
        _ip("link", "set", host_if, "up")  # heal
        cut_s = time.monotonic() - t_cut
        wait_for(lambda: all(c.released(r) for r in rooms), 30, "late acks after the heal")
        rels = [c.released(r) for r in rooms]
        assert all(r is not None and r.proof.value in ("late_acks", "writer_fence") for r in rels), rels
        assert c.metric("kvconn_quarantines_total") == NROOMS
        assert total(c.metric, "kvconn_releases_total", "proof", PROOFS) == NROOMS
        assert c.metric("kvconn_pages_quarantined") == 0 and c.metric("kvconn_pages_held") == 0
        print(
            f"\ncut {cut_s:.2f} s; quarantined for "
            f"{[round(r.quarantined_for, 2) for r in rels if r is not None]} s"
        )
        # both ranks alive and reachable again
        for rank in c.ranks:
            assert rank.value("kvconn_messages_total", type="Abort") >= NROOMS
        assert c.late_bytes() == 0
    finally:
        c.close()
