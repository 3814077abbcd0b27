"""A prefill instance restarted at the same bootstrap address (issue 40,
finding 3): the first request after the restart completes. SGLang's decode
keeps an instance's kvconn rank addresses by its bootstrap address; the
restarted instance registers its ranks again, at new ports (the default)
or the same ones (``KVCONN_SGLANG_PORT_BASE``). Before, decode asked the
ranks it knew, found their process gone and failed the request (SGLang's
HTTP 500), and its prefill half waited in SGLang's bootstrap queue.

Now kvconn says the ranks it knew cannot serve (their control link is lost)
and decode reads them at the bootstrap server again; at the same addresses,
kvconn asks who answers there before sending the request, and sends it to
the restarted process."""

from __future__ import annotations

from typing import Any

import pytest
from test_sglang_lifecycle import ROOM_SEQ, decode_rank, receiver

from conftest import ForkedPrefill, Zygote
from kvconn.testing.cluster import free_port
from kvconn.testing.waiting import wait_for


def _transfer(
    utils: Any, manager: Any, pool: Any, prefill: ForkedPrefill, src: list[int], dst: list[int]
) -> None:
    """One request through SGLang's decode receiver and prefill queues: it completes byte for byte."""
    room = next(ROOM_SEQ)
    rx = receiver(utils, manager, prefill, room, dst)
    states = prefill.call(op="begin", room=room, num_pages=len(src), wait_s=60, timeout_s=90)["states"]
    assert states == {"0": int(utils.KVPoll.WaitingForInput)}, (states, rx.poll())
    prefill.call(op="send", room=room, pages=src)
    wait_for(lambda: rx.poll() != utils.KVPoll.Transferring, 30, "the request's end at decode")
    assert rx.poll() == utils.KVPoll.Success, rx.failure_exception()
    assert all(pool.page_matches(d, s) for d, s in zip(dst, src, strict=True))


# "new": SGLang's default (a rank listens where the OS says); "same" (a fixed
# KVCONN_SGLANG_PORT_BASE) takes the core's path, which tests/core/test_routing.py
# covers in CI: it is slow here (another prefill start).
@pytest.mark.parametrize("rank_port", ["new", pytest.param("same", marks=pytest.mark.slow)])
def test_the_first_request_after_a_prefill_restart_at_its_bootstrap_address_completes(
    rank_port: str, sglang_with_kvconn: Any, gloo_group: Any, zygote: Zygote
) -> None:
    utils = sglang_with_kvconn
    manager, pool = decode_rank(utils, 1, 0)
    bootstrap_port = free_port()
    env = {"KVCONN_SGLANG_PORT_BASE": str(free_port())} if rank_port == "same" else {}
    first = zygote.prefill(1, [0], env=env, bootstrap_port=bootstrap_port)
    second: ForkedPrefill | None = None
    try:
        first.wait_ready()
        _transfer(utils, manager, pool, first, [0, 1], [4, 5])
        first.kill()
        second = zygote.prefill(1, [0], env=env, bootstrap_port=bootstrap_port)
        second.wait_ready()
        assert second.bootstrap == first.bootstrap
        assert (second.addresses == first.addresses) is (rank_port == "same")
        _transfer(utils, manager, pool, second, [2, 3], [6, 7])  # the first request after the restart
        metrics = manager.endpoint.metrics
        assert metrics.value("kvconn_rank_restarts_total") == (1.0 if rank_port == "same" else 0.0)
        _transfer(utils, manager, pool, second, [1, 2], [8, 9])
    finally:
        manager.close()
        first.close()
        if second is not None:
            second.close()
