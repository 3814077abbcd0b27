"""SGLang's routing through its bootstrap server, across hosts
(kvconn.testing.hosts: network, PID and mount namespaces of their own).

The prefill (prefill_child.py: SGLang's prefill queues and the kvconn
plugin's bootstrap server and rank) runs on host ``prefill0``; its
bootstrap server and kvconn rank listen on that host's address, and the
rank registers that address there. Decode (SGLang's decode transfer queue
and the plugin's manager, in this process) runs in host ``decode``'s
network: it learns where the rank is only from the bootstrap server the
request names, over the link. Transport: Mooncake over tcp bound to each
host's address (decode runs in this process, where NIXL's UCX would need
the host's ``/sys``; the NIXL path across hosts is covered by the suite and
the vLLM test). Shown: a room routed and landed byte-exact, and an abort of
a room whose prefill host is cut off mid-transfer held past SGLang's own
deadline until kvconn's proof after the heal.

Slow (the prefill process imports SGLang: about 65 s of the 150 s on the
shared 2-core VM). Needs root, and kvconn_mooncake in the SGLang venv
(``pip install ./kvconn_mooncake``); it says so and skips otherwise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kvpool import NUM_PAGES
from test_sglang_lifecycle import ROOM_SEQ, Released, decode_rank, decode_request, receiver, transfer_queue

from conftest import HERE, KVCONN_ENV, PrefillChild
from kvconn.testing import hosts
from kvconn.testing.libraries import why_unavailable
from kvconn.testing.waiting import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(hosts.unavailable()), reason=hosts.unavailable() or "n/a"),
]

#: Mooncake's engine gives up on a write after this (its floor): kvconn's
#: abort deadline (KVCONN_ENV: 60 s) must exceed it, and it does.
MOONCAKE_ENV = {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_STATUS_TIMEOUT_SEC": "5", "MC_LOG_LEVEL": "ERROR"}


class HostPrefill(PrefillChild):
    """prefill_child.py on ``host``: bootstrap server and rank on its address."""

    def __init__(self, host: hosts.Host) -> None:
        env = {
            **os.environ,
            **KVCONN_ENV,
            **MOONCAKE_ENV,
            "PYTHONUNBUFFERED": "1",
            "KVCONN_SGLANG_TRANSPORT": "mooncake",
            "KVCONN_SGLANG_HOST": host.ip,
            "KVCONN_SGLANG_BACKEND_OPTIONS": f"host={host.ip}",
        }
        spec = json.dumps({"tp_size": 1, "ranks": [0], "host": host.ip})
        self.proc = host.popen(
            [sys.executable, str(HERE / "prefill_child.py"), spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = host.main_pid(self.proc)  # the process itself, not its wrappers
        self._init_io(self.proc.stdout, self.proc.stdin)


@pytest.fixture
def fabric() -> Iterator[hosts.Fabric]:
    with hosts.hosts(("decode", "prefill0")) as made:
        yield made


def test_a_room_routed_through_the_bootstrap_server_lands_and_an_abort_waits_for_proof(
    sglang_with_kvconn: Any, gloo_group: Any, fabric: hosts.Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    if why_unavailable("mooncake"):
        pytest.skip(f"mooncake: {why_unavailable('mooncake')}")
    utils = sglang_with_kvconn
    from sglang.srt.disaggregation import decode

    dec, pre = fabric["decode"], fabric["prefill0"]
    for name, value in {
        **MOONCAKE_ENV,
        "KVCONN_SGLANG_TRANSPORT": "mooncake",
        "KVCONN_SGLANG_HOST": dec.ip,
        "KVCONN_SGLANG_BACKEND_OPTIONS": f"host={dec.ip}",
    }.items():
        monkeypatch.setenv(name, value)  # decode's manager reads them
    started = time.monotonic()
    prefill = HostPrefill(pre)
    manager = None
    try:
        prefill.wait_ready()
        assert prefill.bootstrap.startswith(f"{pre.ip}:")
        assert prefill.addresses == [a for a in prefill.addresses if a.startswith(f"tcp://{pre.ip}:")]
        # Decode's endpoint, its threads and its engine live in the decode host's network.
        with dec.entered():
            manager, pool = decode_rank(utils, 1, 0)
        released = Released()
        queue = transfer_queue(monkeypatch, gloo_group, released)

        # 1. Routed: the rank's address comes from the bootstrap server, over the link.
        room, src, dst = next(ROOM_SEQ), [3, 5, 7, 9], [12, 2, 6, 14]
        with dec.entered():
            rx = receiver(utils, manager, prefill, room, dst)
        assert manager.prefill_info_table[prefill.bootstrap].attn_tp_size == 1
        prefill.call(op="begin", room=room, num_pages=len(dst), wait_s=20)
        prefill.call(op="send", room=room, pages=src)
        wait_for(lambda: rx.poll() == utils.KVPoll.Success, 30, "the room lands across hosts")
        for s, d in zip(src, dst, strict=True):
            assert pool.page_matches(d, s), f"decode page {d} is not prefill page {s}"
        assert all(pool.page_untouched(p) for p in set(range(NUM_PAGES)) - set(dst))
        landed_s = time.monotonic() - started

        # 2. The prefill host is cut off mid-transfer; decode aborts the room.
        room, dst = next(ROOM_SEQ), [0, 1, 4, 8]
        with dec.entered():
            rx = receiver(utils, manager, prefill, room, dst)
        prefill.call(op="begin", room=room, num_pages=4, wait_s=20)
        prefill.call(op="send", room=room, pages=[0, 1])  # the first of two chunks
        wait_for(lambda: pool.page_matches(0, 0) and pool.page_matches(1, 1), 20, "the first chunk at decode")
        pre.cut()
        try:
            dreq = decode_request(rx, room, slot=5)
            queue.add(dreq)
            rx.abort()  # SGLang's AbortReq on a request in the transfer queue
            assert queue.pop_transferred() == [] and queue.num_pending_deferred_releases() == 1
            # SGLang's own deadline passes (its clock, an hour on): still held.
            real = time.monotonic
            monkeypatch.setattr(decode, "time", SimpleNamespace(monotonic=lambda: real() + 3600))
            held_until = time.monotonic() + 2.0
            while time.monotonic() < held_until:  # and so it stays while the host is gone
                queue.resolve_deferred_releases()
                assert released.reqs == [] and not manager.is_abort_release_safe(room, 1)
                time.sleep(0.1)
            assert queue._deferred_releases[0][2] == math.inf
        finally:
            pre.heal()
        healed = time.monotonic()
        # The rank's ack of decode's re-sent ABORT crosses the healed link: kvconn releases.
        wait_for(lambda: manager.is_abort_release_safe(room, 1), 30, "kvconn's release after the heal")
        back_s = time.monotonic() - healed
        queue.resolve_deferred_releases()
        assert released.reqs == [dreq.req] and queue.freed_slots == [5]
        metrics = manager.endpoint.metrics
        assert metrics.value("kvconn_releases_total", proof="unsafe_timeout") == 0
        assert pool.page_untouched(4) and pool.page_untouched(8)  # the second chunk was never sent
        print(
            f"\n[sglang across hosts] routed room landed {landed_s:.1f} s after the prefill started; "
            f"the cut-off room came back {back_s:.2f} s after the heal"
        )
    finally:
        if manager is not None:
            manager.close()
        prefill.close()
