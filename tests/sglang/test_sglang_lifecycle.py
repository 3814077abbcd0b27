"""SGLang's decode transfer queue and poll reduction, from the installed
sglang wheel, driven with the kvconn backend against prefill rank processes
on loopback.

What SGLang expects of a backend with deferred decode KV release (its own
unit tests: deferred decode KV release, decode queue cleanup): a failed or
aborted transfer is held (``_defer_release``) and freed by
``resolve_deferred_releases`` once ``kv_mgr.is_abort_release_safe`` says the
prefill drained, or at its deadline. With kvconn the deadline must not free
a held room: only kvconn's ``on_release`` does.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any

import pytest
from kvpool import NUM_PAGES, Pool

from kvconn.testing.waiting import wait_for

ROOM_SEQ = iter(range(1000, 1_000_000))


class Released:
    """SGLang's release_kv_cache, recorded."""

    def __init__(self) -> None:
        self.reqs: list[Any] = []

    def __call__(self, req: Any, tree_cache: Any, **_: Any) -> None:
        self.reqs.append(req)


def decode_rank(utils: Any, tp_size: int, tp_rank: int, metadata: Any = None) -> tuple[Any, Pool]:
    """A decode scheduler rank's kvconn manager, built as SGLang builds it."""
    backend = utils.TransferBackend("kvconn")
    manager_class = utils.get_kv_class(backend, utils.KVClassType.MANAGER)
    pool = Pool(tp_size, tp_rank, fill=False)
    if metadata is None:
        import torch

        metadata = utils.MetadataBuffers(8, 16, torch.float32, 0)  # SGLang's aux rows, always there
    pool.metadata = metadata  # registered with kvconn: kept alive with the pool
    args = pool.kv_args(utils.get_kv_class(backend, utils.KVClassType.KVARGS), metadata)
    server_args = SimpleNamespace(tp_size=tp_size, enable_dp_attention=False)
    return manager_class(args, utils.DisaggregationMode.DECODE, server_args), pool


def receiver(utils: Any, manager: Any, prefill: Any, room: int, pages: list[int], aux_slot: int = 0) -> Any:
    """SGLang's prealloc queue: the prefill's topology from the bootstrap
    server the request names, a receiver, init(dp rank), send_metadata(pages)."""
    assert manager.try_ensure_parallel_info(prefill.bootstrap)
    assert manager.prefill_info_table[prefill.bootstrap].attn_tp_size == len(prefill.addresses)
    receiver_class = utils.get_kv_class(utils.TransferBackend("kvconn"), utils.KVClassType.RECEIVER)
    rx = receiver_class(manager, prefill.bootstrap, room)
    assert rx.poll() == utils.KVPoll.Bootstrapping
    rx.init(0)
    assert rx.poll() == utils.KVPoll.WaitingForInput, rx.failure_exception()
    rx.send_metadata(pages, aux_index=aux_slot)
    return rx


def transfer_queue(monkeypatch: pytest.MonkeyPatch, gloo: Any, released: Released) -> Any:
    """SGLang's DecodeTransferQueue (real __init__), with a scheduler stand-in."""
    from sglang.srt.disaggregation import decode

    monkeypatch.setattr(
        decode,
        "get_parallel",
        lambda: SimpleNamespace(attn_tp_group=SimpleNamespace(cpu_group=gloo), tp_rank=0),
    )
    monkeypatch.setattr(
        decode,
        "get_disagg",
        lambda: SimpleNamespace(
            disaggregation_transfer_backend="kvconn", disaggregation_decode_host_receive_threshold=1.0
        ),
    )
    monkeypatch.setattr(decode, "release_kv_cache", released)
    monkeypatch.delenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", raising=False)
    streamed: list[Any] = []
    scheduler = SimpleNamespace(
        spec_algorithm=None,
        enable_decode_hicache=False,
        enable_hisparse=False,
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        output_streamer=SimpleNamespace(stream_output=lambda reqs, *_: streamed.extend(reqs)),
        disagg_decode_prealloc_queue=None,
    )
    freed_slots: list[int] = []
    allocator = SimpleNamespace(free=freed_slots.append)
    metadata = SimpleNamespace(clear_slot=lambda idx: None)
    tree_cache = SimpleNamespace(unlock=lambda lock: None)  # no HiCache restore lock here
    queue = decode.DecodeTransferQueue(allocator, metadata, scheduler, tree_cache=tree_cache)
    queue.freed_slots = freed_slots
    queue.streamed = streamed
    return queue


def prefill_done(prefill: Any, room: int) -> dict[str, tuple[bool, bool, bool]]:
    """Per prefill rank, after a pass of SGLang's inflight queue: (concluded,
    failed, source KV freed). Once concluded, later passes no longer see it."""
    seen = prefill.seen = getattr(prefill, "seen", {})
    for rank, state in prefill.call(op="inflight", room=room)["ranks"].items():
        if state["done"] or (rank, room) not in seen:
            seen[(rank, room)] = (state["done"], state["failed"], state["released"])
    return {rank: state for (rank, r), state in seen.items() if r == room}


def decode_request(rx: Any, room: int, slot: int) -> Any:
    from sglang.srt.disaggregation.decode import DecodeRequest

    req = SimpleNamespace(
        rid=f"req-{room}",
        bootstrap_room=room,
        bootstrap_host="127.0.0.1",
        return_logprob=False,
        finished_reason=None,
    )
    return DecodeRequest(req=req, kv_receiver=rx, metadata_buffer_index=slot)


def test_abort_mid_transfer_is_held_past_sglangs_deadline_until_kvconn_releases(
    sglang_with_kvconn: Any, gloo_group: Any, prefill_children: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    utils = sglang_with_kvconn
    from sglang.srt.disaggregation import decode

    prefill = prefill_children[1]
    manager, pool = decode_rank(utils, 1, 0)
    released = Released()
    try:
        queue = transfer_queue(monkeypatch, gloo_group, released)
        # The plugin turns deferred release on: without it SGLang frees a failed room at once.
        assert queue.enable_deferred_kv_release
        room, dst = next(ROOM_SEQ), [9, 10, 11, 12]
        rx = receiver(utils, manager, prefill, room, dst)
        assert prefill.call(op="begin", room=room, num_pages=4, wait_s=20)["states"] == {
            "0": int(utils.KVPoll.WaitingForInput)
        }
        prefill.call(op="send", room=room, pages=[0, 1])  # the first of two chunks
        wait_for(
            lambda: pool.page_matches(9, 0) and pool.page_matches(10, 1), 20, "the first chunk at decode"
        )
        assert rx.poll() == utils.KVPoll.Transferring

        # The prefill goes silent mid-transfer: nothing can prove its writes are over.
        prefill.stop()
        dreq = decode_request(rx, room, slot=7)
        queue.add(dreq)
        rx.abort()  # SGLang's AbortReq on a request in the transfer queue
        assert queue.pop_transferred() == []
        assert queue.num_pending_deferred_releases() == 1
        assert queue.streamed == [dreq.req]  # the client was told at once
        assert released.reqs == []  # ... but the pages are held

        # SGLang's own deadline passes (its clock, moved an hour on): still held.
        real_monotonic = time.monotonic
        monkeypatch.setattr(decode, "time", SimpleNamespace(monotonic=lambda: real_monotonic() + 3600))
        queue.resolve_deferred_releases()
        assert released.reqs == [] and queue.num_pending_deferred_releases() == 1
        assert not manager.is_abort_release_safe(room, 1)
        assert queue._deferred_releases[0][2] == math.inf

        # The prefill comes back, acks the abort: kvconn releases, then SGLang frees once.
        prefill.resume()
        wait_for(lambda: manager.is_abort_release_safe(room, 1), 30, "kvconn's release of the room")
        queue.resolve_deferred_releases()
        assert released.reqs == [dreq.req]
        assert queue.freed_slots == [7]
        assert queue.num_pending_deferred_releases() == 0
        assert dreq.kv_receiver is None
        # The second chunk was never sent: those pages saw no write.
        assert pool.page_untouched(11) and pool.page_untouched(12)
        # SGLang's prefill inflight queue sees Failed and frees the request's source KV.
        wait_for(
            lambda: prefill_done(prefill, room) == {"0": (True, True, True)}, 30, "prefill concluded Failed"
        )
    finally:
        manager.close()


def test_sglangs_deadline_frees_a_held_room_without_the_plugins_hook(
    sglang_with_kvconn: Any, gloo_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hole the plugin closes: SGLang's unhooked _defer_release arms a
    deadline, and resolve_deferred_releases frees at it with no ack."""
    from sglang.srt.disaggregation import decode

    released = Released()
    queue = transfer_queue(monkeypatch, gloo_group, released)
    held = SimpleNamespace(
        is_abort_release_safe=lambda room, acks: False, clear_deferred_abort_state=lambda room: None
    )
    rx = SimpleNamespace(kv_mgr=held, abort_notified=True, bootstrap_infos=[{"rank": 0}], clear=lambda: None)
    dreq = decode_request(rx, 77, slot=3)
    unhooked = decode.DecodeTransferQueue._defer_release.__wrapped__
    unhooked(queue, dreq)
    assert queue._deferred_releases[0][2] < math.inf
    real_monotonic = time.monotonic
    monkeypatch.setattr(decode, "time", SimpleNamespace(monotonic=lambda: real_monotonic() + 3600))
    queue.resolve_deferred_releases()
    assert released.reqs == [dreq.req]


def test_prefill_two_ranks_fill_one_decode_rank_byte_exact_with_sglangs_aux_row(
    sglang_with_kvconn: Any, gloo_group: Any, prefill_children: Any
) -> None:
    """Heterogeneous TP 2 -> 1: each prefill rank writes its heads of every
    page, rank 0 SGLang's aux row with the last chunk; SGLang's poll
    reduction with its metadata gate (Success only once the aux row's room id
    landed) says Success, and every byte is where it belongs."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    utils = sglang_with_kvconn
    prefill = prefill_children[2]
    metadata = MetadataBuffers(8, 16, torch.float32, 0)
    manager, pool = decode_rank(utils, 1, 0, metadata)
    try:
        room, src, dst, slot, token = next(ROOM_SEQ), [2, 3, 4, 5, 6], [15, 1, 8, 0, 13], 5, 4242
        rx = receiver(utils, manager, prefill, room, dst, aux_slot=slot)
        dreq = decode_request(rx, room, slot)
        states = prefill.call(op="begin", room=room, num_pages=len(dst), wait_s=20, first_token=token)
        assert set(states["states"].values()) == {int(utils.KVPoll.WaitingForInput)}
        prefill.call(op="send", room=room, pages=src[:2])
        assert utils.poll_and_all_reduce([rx], gloo_group, [dreq], metadata) != [int(utils.KVPoll.Success)]
        prefill.call(op="send", room=room, pages=src[2:])  # completes the room: the last chunk
        wait_for(
            lambda: (
                utils.poll_and_all_reduce([rx], gloo_group, [dreq], metadata) == [int(utils.KVPoll.Success)]
            ),
            30,
            "Success past SGLang's metadata gate",
        )
        assert int(metadata.bootstrap_room[slot, 0]) == room
        assert int(metadata.output_ids[slot, 0]) == token
        assert all(int(metadata.bootstrap_room[s, 0]) == 0 for s in range(8) if s != slot)
        for s, d in zip(src, dst, strict=True):
            assert pool.page_matches(d, s), f"decode page {d} is not prefill page {s}"
        untouched = set(range(NUM_PAGES)) - set(dst)
        assert all(pool.page_untouched(p) for p in untouched)
        # Both ranks' SGLang inflight queues: Success, and only then the source KV is freed.
        wait_for(
            lambda: prefill_done(prefill, room) == {"0": (True, False, True), "1": (True, False, True)},
            30,
            "prefill ranks concluded Success",
        )
        # SGLang cleared the senders; a later poll still says Success.
        later = prefill.call(op="inflight", room=room)["ranks"]
        assert {r: v["poll"] for r, v in later.items()} == {
            "0": int(utils.KVPoll.Success),
            "1": int(utils.KVPoll.Success),
        }
    finally:
        manager.close()


def test_a_prefill_abort_mid_transfer_fails_decode_and_frees_after_kvconns_release(
    sglang_with_kvconn: Any, gloo_group: Any, prefill_children: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure decode did not initiate: SGLang's queue sees Failed, arms
    ensure_abort_notified(force_arm=True), holds, and frees after kvconn's release."""
    utils = sglang_with_kvconn
    prefill = prefill_children[1]
    manager, pool = decode_rank(utils, 1, 0)
    released = Released()
    try:
        queue = transfer_queue(monkeypatch, gloo_group, released)
        room, dst = next(ROOM_SEQ), [3, 4, 5]
        rx = receiver(utils, manager, prefill, room, dst)
        prefill.call(op="begin", room=room, num_pages=3, wait_s=20)
        prefill.call(op="send", room=room, pages=[7])
        wait_for(lambda: pool.page_matches(3, 7), 20, "the first chunk at decode")
        dreq = decode_request(rx, room, slot=2)
        queue.add(dreq)
        prefill.call(op="abort", room=room)
        wait_for(lambda: rx.poll() == utils.KVPoll.Failed, 20, "decode told Failed")
        assert queue.pop_transferred() == []
        assert rx.abort_notified  # SGLang armed the hold through ensure_abort_notified
        assert dreq.req.finished_reason is not None
        wait_for(lambda: manager.is_abort_release_safe(room, 1), 30, "kvconn's release of the room")
        queue.resolve_deferred_releases()
        assert released.reqs == [dreq.req] and queue.freed_slots == [2]
        # SGLang's prefill inflight queue: Failed (said once no chunk reads the source), source freed.
        wait_for(
            lambda: prefill_done(prefill, room) == {"0": (True, True, True)}, 30, "prefill concluded Failed"
        )
    finally:
        manager.close()


def test_a_zero_page_last_chunk_still_carries_the_aux_row(
    sglang_with_kvconn: Any, gloo_group: Any, prefill_children: Any
) -> None:
    """SGLang sends a last chunk with no page (everything cached at decode, or
    a one-token prompt): the room must still conclude, with its aux row."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    utils = sglang_with_kvconn
    prefill = prefill_children[1]
    metadata = MetadataBuffers(8, 16, torch.float32, 0)
    manager, _ = decode_rank(utils, 1, 0, metadata)
    try:
        room, slot, token = next(ROOM_SEQ), 6, 77
        rx = receiver(utils, manager, prefill, room, [], aux_slot=slot)
        dreq = decode_request(rx, room, slot)
        prefill.call(op="begin", room=room, num_pages=0, wait_s=20, first_token=token)
        prefill.call(op="send", room=room, pages=[])
        wait_for(
            lambda: (
                utils.poll_and_all_reduce([rx], gloo_group, [dreq], metadata) == [int(utils.KVPoll.Success)]
            ),
            30,
            "Success past SGLang's metadata gate",
        )
        assert int(metadata.bootstrap_room[slot, 0]) == room and int(metadata.output_ids[slot, 0]) == token
    finally:
        manager.close()


def test_one_prefill_rank_fills_two_decode_ranks(
    sglang_with_kvconn: Any, gloo_group: Any, prefill_children: Any
) -> None:
    """Heterogeneous TP 1 -> 2: both decode ranks ask the one prefill rank for
    the same room id, each into its own pages; SGLang's single KVSender at
    the prefill rank (init, one send per chunk) writes each its head slice of
    every page and its aux row, and says Success only once both have it."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    utils = sglang_with_kvconn
    prefill = prefill_children[1]
    metadata = [MetadataBuffers(8, 16, torch.float32, 0) for _ in range(2)]
    (m0, p0), (m1, p1) = (decode_rank(utils, 2, r, metadata[r]) for r in (0, 1))
    try:
        room, src, slot, token = next(ROOM_SEQ), [1, 2, 9], 3, 515
        dsts = [[5, 6, 14], [11, 0, 7]]  # each decode rank allocates its own pages
        receivers = [
            receiver(utils, m, prefill, room, d, aux_slot=slot) for m, d in zip((m0, m1), dsts, strict=True)
        ]
        dreqs = [decode_request(rx, room, slot) for rx in receivers]
        states = prefill.call(op="begin", room=room, num_pages=len(src), wait_s=20, first_token=token)
        assert states["states"] == {"0": int(utils.KVPoll.WaitingForInput)}
        prefill.call(op="send", room=room, pages=src[:1])
        prefill.call(op="send", room=room, pages=src[1:])  # the last chunk
        for rx, dreq, meta in zip(receivers, dreqs, metadata, strict=True):
            wait_for(
                lambda rx=rx, dreq=dreq, meta=meta: (  # type: ignore[misc]
                    utils.poll_and_all_reduce([rx], gloo_group, [dreq], meta) == [int(utils.KVPoll.Success)]
                ),
                30,
                "Success past SGLang's metadata gate on each decode rank",
            )
        for pool, dst, meta in zip((p0, p1), dsts, metadata, strict=True):
            for s, d in zip(src, dst, strict=True):
                assert pool.page_matches(d, s), f"decode rank {pool.tp_rank} page {d} is not prefill page {s}"
            assert all(pool.page_untouched(p) for p in set(range(NUM_PAGES)) - set(dst))
            assert int(meta.bootstrap_room[slot, 0]) == room and int(meta.output_ids[slot, 0]) == token
        wait_for(
            lambda: prefill_done(prefill, room) == {"0": (True, False, True)}, 30, "prefill concluded Success"
        )
    finally:
        m0.close()
        m1.close()


def test_a_decode_rank_aborting_fails_the_prefill_rank_that_fills_both(
    sglang_with_kvconn: Any, gloo_group: Any, prefill_children: Any
) -> None:
    """TP 1 -> 2, one decode rank aborts mid-transfer: SGLang's prefill sees
    Failed for the request (only once nothing reads its source pages), the
    aborted rank gets its pages back through kvconn's release, and the other
    decode rank is told Failed (prefill fails the whole request)."""
    utils = sglang_with_kvconn
    prefill = prefill_children[1]
    (m0, p0), (m1, _) = (decode_rank(utils, 2, r) for r in (0, 1))
    try:
        room = next(ROOM_SEQ)
        rx0, rx1 = receiver(utils, m0, prefill, room, [1, 2]), receiver(utils, m1, prefill, room, [3, 4])
        prefill.call(op="begin", room=room, num_pages=2, wait_s=20)
        prefill.call(op="send", room=room, pages=[8])
        wait_for(lambda: p0.page_matches(1, 8), 20, "the first chunk at decode rank 0")
        rx0.abort()
        wait_for(lambda: m0.is_abort_release_safe(room, 1), 30, "kvconn's release at decode rank 0")
        wait_for(
            lambda: prefill_done(prefill, room) == {"0": (True, True, True)}, 30, "prefill concluded Failed"
        )
        assert p0.page_untouched(2)  # the second chunk was never sent
        # SGLang's prefill gave the request up: the other decode rank must not wait for chunks.
        wait_for(lambda: rx1.poll() == utils.KVPoll.Failed, 30, "decode rank 1 told Failed")
    finally:
        m0.close()
        m1.close()


def test_one_decode_rank_is_routed_per_request_to_two_prefill_instances(
    sglang_with_kvconn: Any, gloo_group: Any, prefill_children: Any
) -> None:
    """Per-request routing: each request names its prefill instance's SGLang
    bootstrap server; the decode rank reads that instance's kvconn ranks there
    and asks them (TP 1 for one request, TP 2 for the other), through one
    kvconn endpoint, each byte-exact."""
    utils = sglang_with_kvconn
    manager, pool = decode_rank(utils, 1, 0)
    try:
        jobs = [(prefill_children[1], [1, 2], [0, 3]), (prefill_children[2], [4, 5, 6], [8, 9, 10])]
        receivers = []
        for prefill, src, dst in jobs:
            room = next(ROOM_SEQ)
            rx = receiver(utils, manager, prefill, room, dst)
            prefill.call(op="begin", room=room, num_pages=len(src), wait_s=20)
            prefill.call(op="send", room=room, pages=src)
            receivers.append(rx)
        wait_for(
            lambda: utils.poll_and_all_reduce(receivers, gloo_group) == [int(utils.KVPoll.Success)] * 2,
            30,
            "Success from both prefill instances",
        )
        assert len(manager.endpoint.instances()) == 2
        for _, src, dst in jobs:
            assert all(pool.page_matches(d, s) for s, d in zip(src, dst, strict=True))
    finally:
        manager.close()


def test_a_request_prefill_gave_up_before_decode_asked_fails_at_once(
    sglang_with_kvconn: Any, gloo_group: Any, prefill_children: Any
) -> None:
    """SGLang's prefill aborts a request still waiting for decode's ask (its
    KVSender has not bound kvconn's sender: no decode TP is known yet). Every
    decode rank asking afterwards is told Failed at once, writes nothing, and
    its pages come back through kvconn's release."""
    utils = sglang_with_kvconn
    prefill = prefill_children[1]
    (m0, p0), (m1, p1) = (decode_rank(utils, 2, r) for r in (0, 1))
    try:
        room = next(ROOM_SEQ)
        states = prefill.call(op="begin", room=room, num_pages=2, wait_s=0.05)
        assert states["states"] == {"0": int(utils.KVPoll.Bootstrapping)}
        prefill.call(op="abort", room=room)
        for manager, pool, dst in ((m0, p0, [2, 3]), (m1, p1, [4, 5])):
            rx = receiver(utils, manager, prefill, room, dst)
            wait_for(lambda rx=rx: rx.poll() == utils.KVPoll.Failed, 20, "decode told Failed")  # type: ignore[misc]
            rx.ensure_abort_notified(force_arm=True)  # what SGLang's decode queue does on Failed
            wait_for(lambda m=manager: m.is_abort_release_safe(room, 1), 30, "kvconn's release")  # type: ignore[misc]
            assert all(pool.page_untouched(p) for p in dst)
    finally:
        m0.close()
        m1.close()
