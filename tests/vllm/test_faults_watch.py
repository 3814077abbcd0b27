"""kvconn_vllm.faults.watch: the block watch a fault run puts in each engine
(torch tensors standing for vLLM's KV cache; no engine)."""

from __future__ import annotations

import pytest

from conftest import NEEDS_VLLM

torch = pytest.importorskip("torch", reason=NEEDS_VLLM)

from kvconn_vllm.faults.watch import CANARY, BlockWatch, block_views  # noqa: E402

NUM_BLOCKS = 8


def make_watch() -> tuple[BlockWatch, list[torch.Tensor]]:
    # Two layers in two of vLLM's layouts: blocks first (CPU), and [2, blocks, ...] (GPU backends).
    layers = [torch.rand(NUM_BLOCKS, 2, 4, 8), torch.rand(2, NUM_BLOCKS, 4, 2, 8)]
    now = iter(float(t) for t in range(1000))
    watch = BlockWatch(block_views(layers, NUM_BLOCKS), clock=lambda: next(now))
    watch.enabled = True
    return watch, layers


def test_views_put_the_block_dimension_first_without_copying() -> None:
    _, layers = make_watch()
    views = block_views(layers, NUM_BLOCKS)
    assert [v.shape[0] for v in views] == [NUM_BLOCKS, NUM_BLOCKS]
    views[1][3].fill_(7.0)
    assert bool((layers[1][:, 3] == 7.0).all())
    with pytest.raises(ValueError, match="no 8-block dim"):
        block_views([torch.zeros(3, 4)], NUM_BLOCKS)


def test_a_write_into_a_freed_block_is_seen_by_the_next_check() -> None:
    watch, layers = make_watch()
    watch.note_owners({"req-a": [2, 3]})
    watch.on_freed([2, 3])
    assert bool((layers[0][2] == CANARY).all()) and bool((layers[1][:, 3] == CANARY).all())
    watch.check()
    assert watch.late_writes == []
    layers[1][1, 3, 0, 0, 0] = 0.5  # one value of the V part of block 3 lands late
    watch.check()
    (late,) = watch.late_writes
    assert (late.block, late.owner, late.when) == (3, "req-a", "free")
    watch.check()  # re-armed: the same write is not counted twice
    assert len(watch.late_writes) == 1


def test_a_write_before_reallocation_is_seen_when_the_pool_hands_the_block_out() -> None:
    watch, layers = make_watch()
    watch.note_owners({"req-a": [5]})
    watch.on_freed([5])
    layers[0][5, 1, 1, 1] = -1.0
    watch.on_allocated([5, 6])
    assert [(w.block, w.when) for w in watch.late_writes] == [(5, "realloc")]
    assert 5 not in watch.watched  # its new owner may write it now
    layers[0][5].fill_(1.0)
    watch.check()
    assert len(watch.late_writes) == 1


def test_a_request_is_released_when_its_last_block_is_back() -> None:
    watch, _ = make_watch()
    watch.note_owners({"req-a": [1, 2], "req-b": [4]})
    watch.on_freed([2])
    assert "req-a" not in watch.released
    watch.on_freed([1])
    assert watch.released == {"req-a": 1.0}


def test_off_it_touches_nothing() -> None:
    watch, layers = make_watch()
    watch.enabled = False
    before = layers[0][2].clone()
    watch.note_owners({"req-a": [2]})
    watch.on_freed([2])
    assert torch.equal(layers[0][2], before) and watch.watched == {}


def test_digests_differ_by_content_and_cover_every_layer() -> None:
    watch, layers = make_watch()
    first = watch.digests([0, 1])
    assert first[0] != first[1]
    layers[1][1, 0, 3, 1, 7] += 1.0  # block 0's V part, second layer only
    second = watch.digests([0, 1])
    assert second[0] != first[0] and second[1] == first[1]
