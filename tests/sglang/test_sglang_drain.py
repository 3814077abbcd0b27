"""Draining under SGLang: a prefill scheduler rank's kvconn manager drained
(the path SGLang's teardown and, with KVCONN_SGLANG_DRAIN_ON_SIGTERM=1,
SIGTERM take), with SGLang's own prefill queues driving its senders in a
child process and a decode manager in this one."""

from __future__ import annotations

from typing import Any

from conftest import PrefillChild
from test_sglang_lifecycle import ROOM_SEQ, decode_rank, receiver

from kvconn.testing.waiting import wait_for


def test_a_draining_prefill_finishes_what_it_sends_fails_the_rest_and_decode_gets_every_page_back(
    sglang_with_kvconn: Any, gloo_group: Any
) -> None:
    utils = sglang_with_kvconn
    prefill = PrefillChild(1, [0])  # its own: a drained rank serves no later test
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
