"""Bad input across hosts (kvconn.testing.hosts): decode on one host, prefill
on another. An unreachable rank address, a partitioned rank and mismatched
HMAC keys and ranks of an older wire version each fail the bootstrap with a
clear BootstrapError, leave no endpoint thread running, and a later
bootstrap with the fault gone works. An interface that exists but cannot
reach the other host (nixl's net_devices=lo on a writer) fails the bootstrap
naming the interface and the cure.
(An interface or address a host does not have is refused by name before
any engine exists: tests/nixl, tests/mooncake.)"""

from __future__ import annotations

import secrets
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from kvconn.config import Config
from kvconn.errors import BootstrapError
from kvconn.plugins import get_backend
from kvconn.protocol import wire
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.testing import hosts
from kvconn.testing.child import Child
from kvconn.testing.cluster import Cluster
from kvconn.testing.hosts import Fabric
from kvconn.testing.libraries import why_unavailable
from kvconn.testing.waiting import wait_for

pytestmark = pytest.mark.skipif(bool(hosts.unavailable()), reason=hosts.unavailable() or "n/a")


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    with hosts.hosts(("decode", "prefill0")) as made:
        yield made


def _threads() -> set[threading.Thread]:
    time.sleep(0.2)  # an endpoint's threads end shortly after close
    return set(threading.enumerate())


def test_an_unreachable_rank_address_fails_the_bootstrap(fabric: Fabric) -> None:
    decode = fabric["decode"]
    nobody = f"tcp://{fabric.subnet}.250:5555"  # on the network, no host there
    before = _threads()
    started = time.monotonic()
    with (
        decode.entered(),
        pytest.raises(BootstrapError, match=r"0 of 1 prefill ranks answered within 1\.0 s"),
    ):
        DecodeEndpoint(
            get_backend("loopback"),
            8,
            4096,
            [nobody],
            Config(host=decode.ip, bootstrap_timeout_s=1.0, write_timeout_s=0.3, abort_timeout_s=1.0),
        )
    assert time.monotonic() - started < 5
    assert _threads() <= before  # nothing of the failed endpoint runs on


def test_a_partitioned_rank_fails_the_bootstrap_and_a_healed_one_passes(fabric: Fabric) -> None:
    decode, rank_host = fabric["decode"], fabric["prefill0"]
    with decode.entered():
        c = Cluster(
            decode_host=decode.ip,
            rank_host=rank_host.ip,
            netns=rank_host.netns,
            bootstrap_timeout_s=1.0,
            start_decode=False,
        )
    try:
        rank_host.cut()
        before = _threads()
        with decode.entered(), pytest.raises(BootstrapError, match="0 of 2 prefill ranks answered"):
            c.start_decode()
        assert _threads() <= before
        rank_host.heal()
        with decode.entered():
            c.start_decode()
        rx = c.open(7001, 4)[0]
        wait_for(lambda: rx.poll().name == "SUCCESS", 10, "a room lands after the bootstrap", poll=0.01)
    finally:
        c.close()


def test_mismatched_keys_across_hosts_fail_the_bootstrap(fabric: Fabric) -> None:
    decode, rank_host = fabric["decode"], fabric["prefill0"]
    with decode.entered():
        c = Cluster(
            key=secrets.token_bytes(32),
            rank_key=secrets.token_bytes(32),
            decode_host=decode.ip,
            rank_host=rank_host.ip,
            netns=rank_host.netns,
            bootstrap_timeout_s=1.0,
            start_decode=False,
        )
    try:
        before = _threads()
        with decode.entered(), pytest.raises(BootstrapError, match="0 of 2 prefill ranks answered"):
            c.start_decode()
        assert _threads() <= before
        # The ranks saw decode's Hellos and dropped every one, counted, unanswered.
        for rank in c.ranks:
            assert rank.value("kvconn_dropped_messages_total", reason="bad_mac") >= 1
            assert rank.value("kvconn_messages_total", type="Hello") == 0  # none taken
    finally:
        c.close()


def test_ranks_of_an_older_wire_version_fail_the_bootstrap_by_name(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks stamp and accept only version N-1: each drops decode's
    version-N Hellos unread (counted bad_version, logged with both versions),
    so decode's error names the unanswered ranks and its own version. Their
    listeners go on: a decode of their version bootstraps and a room lands."""
    decode, rank_host = fabric["decode"], fabric["prefill0"]
    ours, older = wire.VERSION, wire.VERSION - 1
    with decode.entered():
        c = Cluster(
            decode_host=decode.ip,
            rank_host=rank_host.ip,
            netns=rank_host.netns,
            bootstrap_timeout_s=1.0,
            start_decode=False,
            rank_wire_version=older,
        )
    try:
        before = _threads()
        with (
            decode.entered(),
            pytest.raises(BootstrapError, match=rf"0 of 2 prefill ranks answered.*this side's {ours}") as err,
        ):
            c.start_decode()
        assert _threads() <= before
        for rank in c.ranks:
            assert rank.address in str(err.value)
            assert rank.value("kvconn_dropped_messages_total", reason="bad_version") >= 1
            assert rank.value("kvconn_messages_total", type="Hello") == 0  # none taken
        monkeypatch.setattr(wire, "VERSION", older)  # this process now speaks the ranks' version
        with decode.entered():
            c.start_decode()
        rx = c.open(7002, 4)[0]
        wait_for(lambda: rx.poll().name == "SUCCESS", 10, "a room lands after the bootstrap", poll=0.01)
    finally:
        c.close()


def test_a_writer_pinned_to_lo_fails_the_bootstrap_naming_its_interface(fabric: Fabric) -> None:
    """nixl's net_devices=lo on a rank whose decode is on another host: lo
    exists there, so nothing refuses it up front; UCX only logs "Destination
    is unreachable" and NIXL raises NIXL_ERR_BACKEND when the rank loads
    decode's agent. Decode's bootstrap fails at once with the rank's refusal,
    which names the interface and the cure; decode never opens a room, and
    the rank lives on."""
    if why_unavailable("nixl"):
        pytest.skip(f"nixl: {why_unavailable('nixl')}")
    decode, rank_host = fabric["decode"], fabric["prefill0"]
    env = {"NIXL_LOG_LEVEL": "ERROR", "UCX_MODULES": "^ib"}
    stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in finally)
    rank_args = {
        "backend": "nixl",
        "rank": 0,
        "num_ranks": 1,
        "page_bytes": 16384,
        "chunk_pages": 1,
        "source_pages": 16,
        "write_timeout_s": 0.5,
        "abort_timeout_s": 1.5,
        "backend_options": {"net_devices": "lo"},  # exists on every host; reaches none but its own
        "host": rank_host.ip,
    }
    rank = Child("kvconn.testing.faults", rank_args, env=env, host=rank_host, stderr=stderr)
    dec: Child | None = None
    try:
        address = str(rank.next_with("address", 60, "rank start")["address"])
        decode_args = {
            "backend": "nixl",
            "prefill": [address],
            "num_pages": 16,
            "page_bytes": 16384,
            "num_ranks": 1,
            "config": {
                "host": decode.ip,
                "write_timeout_s": 0.5,
                "abort_timeout_s": 1.5,
                "bootstrap_timeout_s": 20.0,
                "backend_options": {"net_devices": decode.iface},
            },
        }
        started = time.monotonic()
        dec = Child("kvconn.testing.host_decode", decode_args, env=env, host=decode, stderr=stderr)
        wait_for(lambda: dec.proc.poll() is not None, 60, "decode's bootstrap fails")
        took = time.monotonic() - started
        assert dec.proc.returncode != 0
        assert not any(e.get("event") == "ready" for e in dec.history())  # no endpoint, no room
        stderr.seek(0)
        said = stderr.read()
        assert "BootstrapError" in said and address in said, said[-2000:]
        assert "this writer (net_devices=lo, ucx_tls=tcp) cannot reach the region's agent" in said
        assert "net_devices=lo reaches this host only" in said
        assert took < 20.0  # the refusal, not the bootstrap timeout
        # The rank took the Hello, refused it, and lives on.
        rank.send_line("metrics")
        samples = rank.next_with("samples", 10, "rank metrics")["samples"]
        hellos = [v for n, lab, v in samples if n == "kvconn_messages_total" and lab == {"type": "Hello"}]
        assert hellos and hellos[0] >= 1
    finally:
        if dec is not None:
            dec.close()
        rank.close()
        stderr.close()
