"""Draining under SGLang: a prefill scheduler rank's kvconn manager drained
(the path SGLang's teardown and, with KVCONN_SGLANG_DRAIN_ON_SIGTERM=1,
SIGTERM take), and SGLang's own ShutdownReq handler, hooked by the plugin,
draining a prefill and a decode rank; with SGLang's own prefill queues
driving the senders in a child process and a decode manager in this one."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from test_sglang_lifecycle import ROOM_SEQ, decode_rank, prefill_done, receiver

from conftest import Zygote
from kvconn.protocol.drain import GRACE_OVER
from kvconn.testing.waiting import wait_for
from kvconn_sglang.conn import KVConnTransferError


def test_a_draining_prefill_finishes_what_it_sends_fails_the_rest_and_decode_gets_every_page_back(
    sglang_with_kvconn: Any, gloo_group: Any, zygote: Zygote
) -> None:
    utils = sglang_with_kvconn
    prefill = zygote.prefill(1, [0])  # its own: a drained rank serves no later test
    manager, pool = decode_rank(utils, 1, 0)
    try:
        prefill.wait_ready()
        done_room, left_room = next(ROOM_SEQ), next(ROOM_SEQ)
        done = receiver(utils, manager, prefill, done_room, [1, 2])
        prefill.call(op="begin", room=done_room, num_pages=2, wait_s=20)
        prefill.call(op="send", room=done_room, pages=[0, 1])
        wait_for(lambda: done.poll() == utils.KVPoll.Success, 20, "the sent room at decode")
        assert pool.page_matches(1, 0) and pool.page_matches(2, 1)
        # A room SGLang's prefill never sends: the grace runs out.
        left = receiver(utils, manager, prefill, left_room, [3, 4])
        prefill.call(op="begin", room=left_room, num_pages=2, wait_s=20)
        answer = prefill.call(op="drain", grace_s=0.3)
        drained, seconds, rooms_left = answer["drained"]["0"]
        print(f"\nSGLang prefill rank drained={drained} in {seconds:.3f} s (grace 0.3 s)")
        assert drained and rooms_left == 0
        wait_for(lambda: left.poll() == utils.KVPoll.Failed, 20, "the unsent room failed at decode")
        left.abort()  # SGLang's _defer_release: held until kvconn's proof
        wait_for(lambda: manager.is_abort_release_safe(left_room, 1), 20, "the failed room's pages back")
        assert pool.page_untouched(3) and pool.page_untouched(4)
        # A new request for the drained instance fails at once: route it elsewhere.
        refused = receiver(utils, manager, prefill, next(ROOM_SEQ), [5])
        assert refused.poll() == utils.KVPoll.Failed
        assert refused._failure is not None and "draining" in refused._failure
        # The next request for this instance reads its ranks at its bootstrap
        # server again: a restarted instance registers new ones there.
        assert (prefill.bootstrap, 0) not in manager._prefill_ranks
        assert manager.endpoint._state.held_pages() == 0
        report = manager.drain(0.0, timeout_s=1.0)
        assert report.drained and report.pages_left == 0
    finally:
        manager.close()
        prefill.close()


def test_sglangs_shutdown_request_drains_a_prefill_while_its_loop_steps_then_ends_the_loop(
    sglang_with_kvconn: Any, gloo_group: Any, zygote: Zygote
) -> None:
    """SGLang's ShutdownReq (how `kill <server pid>` reaches a scheduler)
    through its Scheduler.handle_shutdown, hooked: the loop is not told to
    end until kvconn's drain returned. Meanwhile SGLang still sends a room
    it holds (it completes at decode), and a room decode asked for that
    SGLang's prefill never had fails at the grace's end, by proof; a new
    room is refused at once."""
    utils = sglang_with_kvconn
    # Grace 4 s (KVCONN_SGLANG_DRAIN_GRACE_S; the budget allows 12 - 2 - 1 s).
    prefill = zygote.prefill(1, [0], env={"KVCONN_SGLANG_DRAIN_GRACE_S": "4"})
    manager, pool = decode_rank(utils, 1, 0)
    try:
        prefill.wait_ready()
        sent_room, left_room = next(ROOM_SEQ), next(ROOM_SEQ)
        left = receiver(utils, manager, prefill, left_room, [3, 4])  # the prefill never gets it
        sent = receiver(utils, manager, prefill, sent_room, [1, 2])
        # Bootstrapped: decode's request for it (sent after the other's) is at the rank.
        prefill.call(op="begin", room=sent_room, num_pages=2, wait_s=20)
        t0 = time.monotonic()
        assert prefill.call(op="shutdown")["gracefully_exit"] == {"0": False}
        # Draining: a new room is refused at once, with a reason decode routes by.
        refused = receiver(utils, manager, prefill, next(ROOM_SEQ), [5])
        wait_for(lambda: refused.poll() == utils.KVPoll.Failed, 20, "a new room refused")
        # Refused by decode (the rank's drain notice came first) or by the rank
        # (decode's request came first): either way the reason says draining.
        with pytest.raises(KVConnTransferError, match="draining"):
            refused.failure_exception()
        prefill.call(op="send", room=sent_room, pages=[0, 1])
        wait_for(lambda: sent.poll() == utils.KVPoll.Success, 20, "the room sent during the drain at decode")
        assert pool.page_matches(1, 0) and pool.page_matches(2, 1)
        # SGLang's inflight queue, still stepping, sees it succeed and frees its source KV.
        wait_for(
            lambda: prefill_done(prefill, sent_room) == {"0": (True, False, True)}, 20, "prefill: Success"
        )
        wait_for(lambda: left.poll() == utils.KVPoll.Failed, 20, "the room prefill never had failed")
        assert left._receiver.failure() == GRACE_OVER
        left.abort()  # SGLang's _defer_release: held until kvconn's proof
        wait_for(lambda: manager.is_abort_release_safe(left_room, 1), 20, "its pages back")
        assert pool.page_untouched(3) and pool.page_untouched(4) and pool.page_untouched(5)
        wait_for(lambda: manager.endpoint.held_pages() == 0, 20, "decode holds no page")
        wait_for(
            lambda: prefill.call(op="exiting")["gracefully_exit"] == {"0": True},
            20,
            "SGLang's loop told to end",
        )
        took = time.monotonic() - t0
        print(f"\nSGLang's ShutdownReq: drained and the loop told to end {took:.2f} s after it (grace 4 s)")
        assert took >= 4.0  # not before the grace ended (the left room was live until then)
        assert manager.endpoint.metrics.value("kvconn_releases_total", proof="unsafe_timeout") == 0
    finally:
        manager.close()
        prefill.close()


def test_sglangs_shutdown_request_drains_a_decode_before_ending_its_loop(
    sglang_with_kvconn: Any, gloo_group: Any, zygote: Zygote
) -> None:
    """A decode scheduler's ShutdownReq: kvconn's decode endpoint takes no
    new room, aborts the rooms left, and SGLang's loop is told to end once
    their pages came back by proof."""
    utils = sglang_with_kvconn
    from sglang.srt.managers.io_struct import ShutdownReq
    from sglang.srt.managers.scheduler import Scheduler

    prefill = zygote.prefill(1, [0])
    manager, pool = decode_rank(utils, 1, 0)
    scheduler = SimpleNamespace(
        disagg_decode_prealloc_queue=SimpleNamespace(kv_manager=manager), gracefully_exit=False
    )
    try:
        prefill.wait_ready()
        room = next(ROOM_SEQ)
        open_rx = receiver(utils, manager, prefill, room, [5, 6])
        prefill.call(op="begin", room=room, num_pages=2, wait_s=20)
        prefill.stop()  # no ack can come: the drain cannot be over
        assert Scheduler.handle_shutdown(scheduler, ShutdownReq()) is None
        assert not scheduler.gracefully_exit  # kvconn drains first
        prefill.resume()  # the rank acks the abort: proof
        wait_for(lambda: scheduler.gracefully_exit, 20, "SGLang's loop told to end")
        assert open_rx.poll() == utils.KVPoll.Failed
        assert manager.endpoint.held_pages() == 0
        metrics = manager.endpoint.metrics
        assert metrics.value("kvconn_releases_total", proof="acks") == 1
        assert metrics.value("kvconn_releases_total", proof="unsafe_timeout") == 0
        assert pool.page_untouched(5) and pool.page_untouched(6)
        refused = receiver(utils, manager, prefill, next(ROOM_SEQ), [7])
        assert refused.poll() == utils.KVPoll.Failed and "draining" in str(refused._failure)
    finally:
        manager.close()
        prefill.close()
