"""The model a fault run uses unless given one: a tiny random-weight Llama
made on the spot (no download; needs torch and transformers, which vLLM
brings), saved in float32 without a tokenizer (prompts are token ids)."""

from __future__ import annotations

from pathlib import Path

#: 2 layers, 2 KV heads of 64 (vLLM's CPU attention refuses head_dim 16):
#: one 32-token block is 64 KiB of KV.
TINY_LLAMA = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}


def make_tiny_llama(path: Path, seed: int = 0) -> Path:
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found]

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_LLAMA, torch_dtype="float32")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path
