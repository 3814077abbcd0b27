"""Bad input across hosts (kvconn.testing.hosts): decode on one host, prefill
on another. An unreachable rank address, a partitioned rank and mismatched
HMAC keys and ranks of an older wire version each fail the bootstrap with a
clear BootstrapError, leave no endpoint thread running, and a later
bootstrap with the fault gone works.
(A wrong interface or address for nixl / mooncake is refused by name before
any engine exists: tests/nixl, tests/mooncake.)"""

from __future__ import annotations

import secrets
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
from kvconn.testing.cluster import Cluster
from kvconn.testing.hosts import Fabric
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
