"""A SIGKILLed prefill, over each kvconn transport: SGLang's own decode
transfer queue (from the installed wheel) with the kvconn backend, against
a prefill process (prefill_child.py: SGLang's prefill queues driving the
senders) that is killed mid-transfer. Decode's pages come back only with
kvconn's proof of the writer's exit (same host: its pid is gone), never on
SGLang's deadline; the chunk never sent saw no write."""

from __future__ import annotations

from typing import Any

import pytest
from test_sglang_lifecycle import ROOM_SEQ, Released, decode_rank, decode_request, receiver, transfer_queue

from conftest import Zygote
from kvconn.plugins import BackendError, get_backend
from kvconn.testing.waiting import wait_for


@pytest.mark.parametrize("transport", ["loopback", "nixl", "mooncake"])
def test_a_sigkilled_prefill_gives_decodes_pages_back_by_its_exit(
    transport: str, sglang_with_kvconn: Any, gloo_group: Any, zygote: Zygote, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        get_backend(transport)
    except (BackendError, ImportError) as exc:
        pytest.skip(f"kvconn transport {transport} is not installed here: {exc}")
    utils = sglang_with_kvconn
    monkeypatch.setenv("KVCONN_SGLANG_TRANSPORT", transport)  # the decode manager reads it
    manager, pool = decode_rank(utils, 1, 0)
    prefill = zygote.prefill(1, [0], transport=transport)  # its own: it is killed
    released = Released()
    try:
        assert manager.backend.name == transport
        queue = transfer_queue(monkeypatch, gloo_group, released)
        prefill.wait_ready()
        room, dst = next(ROOM_SEQ), [9, 10, 11, 12]
        rx = receiver(utils, manager, prefill, room, dst)
        prefill.call(op="begin", room=room, num_pages=4, wait_s=20)
        prefill.call(op="send", room=room, pages=[0, 1])  # the first of two chunks
        wait_for(
            lambda: pool.page_matches(9, 0) and pool.page_matches(10, 1), 20, "the first chunk at decode"
        )
        dreq = decode_request(rx, room, slot=7)
        queue.add(dreq)

        prefill.kill()
        # SGLang's queue sees Failed (kvconn: the rank is gone) and holds the
        # room (ensure_abort_notified); kvconn releases it by the exit proof.
        wait_for(lambda: queue.pop_transferred() == [] and rx.abort_notified, 30, "decode told Failed")
        assert dreq.req.finished_reason is not None
        # The instance's ranks are gone: the next request reads them at its
        # bootstrap server again (a restarted instance registers new ones).
        assert (prefill.bootstrap, 0) not in manager._prefill_ranks
        wait_for(lambda: manager.is_abort_release_safe(room, 1), 30, "kvconn's release of the room")
        queue.resolve_deferred_releases()
        assert released.reqs == [dreq.req] and queue.freed_slots == [7]
        metrics = manager.endpoint.metrics
        assert metrics.value("kvconn_releases_total", proof="writer_exit") == 1
        assert metrics.value("kvconn_releases_total", proof="unsafe_timeout") == 0
        assert pool.page_untouched(11) and pool.page_untouched(12)  # never sent
    finally:
        manager.close()
        prefill.close()
