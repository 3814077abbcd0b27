"""Prefill rank processes sending from per-layer numpy buffers into a decode
endpoint's own per-layer numpy buffers (loopback, process_vm_writev), through
KVLayouts: heterogeneous TP both ways and MLA, byte for byte."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvconn.config import Config
from kvconn.errors import ArgumentError
from kvconn.plugins import get_backend
from kvconn.protocol.hold import Proof, Release
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import BootstrapError, DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.cluster import Rank
from kvconn.testing.kvpattern import EngineShape, dirty_bytes, fill_canary, page_matches
from kvconn.testing.waiting import wait_for

SHAPE = EngineShape(layers=3, pages=16, tokens=4, heads=4, head_bytes=32)


@contextmanager
def ranks(shape: EngineShape, tp: int, **extra: object) -> Iterator[list[str]]:
    procs = []
    try:
        for r in range(tp):
            args = {
                "backend": "loopback",
                "rank": r,
                "num_ranks": tp,
                "engine": shape.to_args(),
                "chunk_pages": 3,
                "write_timeout_s": 2.0,
                "abort_timeout_s": 6.0,
                "backend_options": {"piece_bytes": "4096"},
                **extra,
            }
            procs.append(Rank(args))
        yield [p.ready() for p in procs]
    finally:
        for p in procs:
            p.close()


def _decode(shape: EngineShape, addresses: list[str], tp: int, rank: int, releases: list[Release]):  # type: ignore[no-untyped-def]
    arrays = shape.buffers(tp)
    layout = shape.layout(tp, rank)
    fill_canary(layout, arrays, range(shape.pages))
    config = Config(write_timeout_s=2.0, abort_timeout_s=6.0, bootstrap_timeout_s=20.0)
    endpoint = DecodeEndpoint(
        get_backend("loopback"),
        prefill=addresses,
        config=config,
        on_release=releases.append,
        buffers=arrays,
        layout=layout,
    )
    return endpoint, arrays, layout


def _transfer(shape: EngineShape, dec: DecodeEndpoint, arrays, layout, room: int, pages: list[int]) -> None:  # type: ignore[no-untyped-def]
    rx = dec.receiver(room, pages)
    wait_for(lambda: rx.poll() in (KVPoll.SUCCESS, KVPoll.FAILED), 30, f"room {room}")
    assert rx.poll() is KVPoll.SUCCESS, rx.failure()
    assert rx.finish() == tuple(pages)
    for index, page in enumerate(pages):
        assert page_matches(shape, layout, arrays, room, index, page), f"room {room} page {page} wrong"


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_two_prefill_ranks_fill_one_decode_page_each_with_its_heads(order: str) -> None:
    shape = EngineShape(layers=3, pages=16, tokens=4, heads=4, head_bytes=32, order=order)
    releases: list[Release] = []
    with ranks(shape, 2) as addresses:
        dec, arrays, layout = _decode(shape, addresses, 1, 0, releases)
        try:
            _transfer(shape, dec, arrays, layout, 1, [3, 4, 5, 9, 0])
            _transfer(shape, dec, arrays, layout, 2, [10, 11, 12, 13, 14, 15, 1])
            untouched = [2, 6, 7, 8]
            assert all(not page_matches(shape, layout, arrays, 1, 0, p) for p in untouched)
            assert int(arrays[0][2 * layout.buffers[0].page_bytes]) == 0xA5  # canary left alone
        finally:
            dec.close()


def test_one_prefill_rank_fills_two_decode_ranks_with_their_heads() -> None:
    releases: list[Release] = []
    with ranks(SHAPE, 1) as addresses:
        d0, a0, l0 = _decode(SHAPE, addresses, 2, 0, releases)
        d1, a1, l1 = _decode(SHAPE, addresses, 2, 1, releases)
        try:
            _transfer(SHAPE, d0, a0, l0, 5, [0, 1, 2, 3])
            _transfer(SHAPE, d1, a1, l1, 6, [7, 8, 9, 10])
        finally:
            d0.close()
            d1.close()


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_one_prefill_rank_writes_one_room_id_into_two_decode_ranks_at_once(order: str) -> None:
    """Prefill TP 1, decode TP 2: both decode ranks ask the one prefill rank
    for the same room id (as the router names it), each into its own pages;
    the rank writes each its head slice (one sender per request)."""
    shape = EngineShape(layers=3, pages=16, tokens=4, heads=4, head_bytes=32, order=order)
    releases: list[Release] = []
    with ranks(shape, 1) as addresses:
        d0, a0, l0 = _decode(shape, addresses, 2, 0, releases)
        d1, a1, l1 = _decode(shape, addresses, 2, 1, releases)
        try:
            rx0, rx1 = d0.receiver(5, [0, 1, 2, 3]), d1.receiver(5, [9, 4, 7, 10])
            for rx in (rx0, rx1):
                wait_for(lambda rx=rx: rx.poll() in (KVPoll.SUCCESS, KVPoll.FAILED), 30, "room 5")  # type: ignore[misc]
                assert rx.poll() is KVPoll.SUCCESS, rx.failure()
            assert rx0.finish() == (0, 1, 2, 3) and rx1.finish() == (9, 4, 7, 10)
            for index, page in enumerate([0, 1, 2, 3]):
                assert page_matches(shape, l0, a0, 5, index, page), f"decode rank 0 page {page} wrong"
            for index, page in enumerate([9, 4, 7, 10]):
                assert page_matches(shape, l1, a1, 5, index, page), f"decode rank 1 page {page} wrong"
            assert not page_matches(shape, l1, a1, 5, 0, 0)  # rank 1's page 0 was not written
        finally:
            d0.close()
            d1.close()


def test_mla_one_rank_writes_and_the_other_takes_part() -> None:
    shape = EngineShape(layers=2, pages=8, tokens=4, heads=2, head_bytes=32, replicated=True)
    releases: list[Release] = []
    with ranks(shape, 2) as addresses:
        dec, arrays, layout = _decode(shape, addresses, 1, 0, releases)
        try:
            _transfer(shape, dec, arrays, layout, 3, [6, 2, 4])
        finally:
            dec.close()


def test_a_decode_layout_the_rank_cannot_serve_is_refused_at_bootstrap() -> None:
    releases: list[Release] = []
    with ranks(SHAPE, 1) as addresses:
        other = EngineShape(layers=3, pages=16, tokens=8, heads=4, head_bytes=32)
        with pytest.raises(BootstrapError, match="tokens"):
            _decode(other, addresses, 1, 0, releases)


def test_a_rooms_extras_land_in_the_slot_decode_named_written_once() -> None:
    shape = EngineShape(layers=2, pages=16, tokens=4, heads=4, head_bytes=32, extras_bytes=96, extras_slots=8)
    releases: list[Release] = []
    with ranks(shape, 2) as addresses:
        dec, arrays, layout = _decode(shape, addresses, 1, 0, releases)
        try:
            arrays[-1][:] = 0xA5
            rx = dec.receiver(7, [2, 3, 4], extras_slot=5)
            wait_for(lambda: rx.poll() in (KVPoll.SUCCESS, KVPoll.FAILED), 30, "room 7")
            assert rx.poll() is KVPoll.SUCCESS, rx.failure()
            assert shape.extras_match(arrays, 7, 5)
            others = np.delete(arrays[-1].reshape(8, 96), 5, axis=0)
            assert (others == 0xA5).all()
            for index, page in enumerate([2, 3, 4]):
                assert page_matches(shape, layout, arrays, 7, index, page)
            with pytest.raises(ValueError, match="extras slot 8 outside"):
                dec.receiver(8, [9], extras_slot=8)
        finally:
            dec.close()


def test_aborts_mid_transfer_into_engine_buffers_release_only_with_proof_and_leave_no_late_byte() -> None:
    shape = EngineShape(layers=3, pages=256, tokens=4, heads=4, head_bytes=32, order="NHD")
    rng = random.Random(11)
    releases: list[Release] = []
    slow = {"backend_options": {"piece_bytes": "2048", "piece_delay_s": "0.002"}}
    with ranks(shape, 2, **slow) as addresses:
        dec, arrays, layout = _decode(shape, addresses, 1, 0, releases)
        free = set(range(shape.pages))
        lock = threading.Lock()

        def on_release(release: Release) -> None:  # the engine's allocator: canary, then free
            releases.append(release)
            with lock:
                fill_canary(layout, arrays, release.pages)
                free.update(release.pages)

        dec.on_release = on_release
        try:
            rooms = {}
            for room in range(100, 130):
                with lock:
                    pages = rng.sample(sorted(free), 6)
                    free.difference_update(pages)
                rooms[room] = (dec.receiver(room, pages), pages)
                if rng.random() < 0.3:
                    time.sleep(rng.uniform(0.0, 0.03))  # abort at a random point of its transfer
                    rooms[room][0].abort()
            done = (KVPoll.SUCCESS, KVPoll.FAILED)
            wait_for(lambda: all(rx.poll() in done for rx, _ in rooms.values()), 60, "every room concludes")
            aborted = [r for r, (rx, _) in rooms.items() if rx.poll() is KVPoll.FAILED]
            assert aborted, "no room was aborted"
            wait_for(lambda: {rel.room for rel in releases} >= set(aborted), 30, "aborted rooms released")
            for rel in releases:
                assert rel.proof in (Proof.ACKS, Proof.COMPLETED), rel
            for room, (rx, pages) in rooms.items():
                if room not in aborted:
                    for index, page in enumerate(pages):
                        assert page_matches(shape, layout, arrays, room, index, page), (
                            f"room {room} page {page}"
                        )
                    with lock:
                        fill_canary(layout, arrays, rx.finish())
                        free.update(pages)
            time.sleep(0.2)  # a hundred piece delays: a writer still going would land more
            with lock:
                assert dirty_bytes(layout, arrays, sorted(free)) == 0, (
                    "a byte landed after its page was released"
                )
                assert len(free) == shape.pages
        finally:
            dec.close()


def test_a_rank_names_the_tp_of_the_decode_asking_for_a_room() -> None:
    """requesting_tp: an engine whose decode ranks each ask every prefill rank
    learns from the first request how many to wait for (decodes=), and a
    request a sender took no longer counts."""
    from kvconn.runtime.prefill import PrefillRank

    backend = get_backend("loopback")
    config = Config(write_timeout_s=2.0, abort_timeout_s=6.0, bootstrap_timeout_s=20.0)
    source = SHAPE.buffers(1)
    rank = PrefillRank(backend, 0, config=config, buffers=source, layout=SHAPE.layout(1, 0))
    releases: list[Release] = []
    d0, _, _ = _decode(SHAPE, [rank.address], 2, 0, releases)
    d1, _, _ = _decode(SHAPE, [rank.address], 2, 1, releases)
    try:
        assert rank.requesting_tp(7) is None  # nobody asked yet
        d0.receiver(7, [0, 1])
        wait_for(lambda: rank.requesting_tp(7) is not None, 10, "decode rank 0's request")
        assert rank.requesting_tp(7) == 2
        tx = rank.sender(7, decodes=2)
        d1.receiver(7, [2, 3])
        wait_for(lambda: tx.poll() is KVPoll.WAITING_FOR_INPUT, 10, "both decode ranks' requests")
        assert rank.requesting_tp(7) is None  # both requests are the sender's
        assert rank.requesting_tp(8) is None
    finally:
        d0.close()
        d1.close()
        rank.close()


def test_a_prefill_rank_given_inconsistent_sources_raises_an_argument_error() -> None:
    """Checked before anything is opened: no socket, no writer."""
    backend = get_backend("loopback")
    arrays, layout = SHAPE.buffers(2), SHAPE.layout(2, 1)
    for kwargs, why in [
        ({"buffers": arrays}, "go together"),
        ({"source_bytes": 4096, "buffers": arrays, "layout": layout}, "either source_bytes"),
        ({}, "either source_bytes"),
        ({"buffers": arrays, "layout": layout}, "rank 0 with a layout for tp_rank 1"),
    ]:
        with pytest.raises(ArgumentError, match=why):
            PrefillRank(backend, 0, **kwargs)  # type: ignore[arg-type]
