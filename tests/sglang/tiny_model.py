"""A tiny random-weight Llama made at test time (no download), for real
SGLang servers on CPU: 2 layers, 2 KV heads, float32, no tokenizer (the
servers run with --skip-tokenizer-init: requests carry token ids).

``python tests/sglang/tiny_model.py FOLDER`` makes it in FOLDER (the first
line of docs/sglang.md's CPU recipe), in a venv with torch and transformers."""

from __future__ import annotations

import sys
from pathlib import Path

TINY_LLAMA = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}


def make_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Random weights (seeded), saved in float32 as a Hugging Face folder."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_LLAMA, torch_dtype="float32")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/sglang/tiny_model.py FOLDER")
    print(make_tiny_llama(Path(sys.argv[1])))
