"""Shared by the vLLM tests: a tiny random-weight Llama made on the spot, and
a real vLLM Scheduler with KvconnConnector loaded the way users load it."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
TINY_LLAMA = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,  # CPU attention refuses 16
    "max_position_embeddings": 512,
}


def make_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Random weights, saved in float32; no tokenizer (prompts are token ids)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_LLAMA, torch_dtype="float32")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def add_word_tokenizer(path: Path) -> Path:
    """A tokenizer for the tiny model, made here (no download): one word per
    token id, ``w3`` ... ``w511``, so that ``vllm serve`` can take text."""
    if (path / "tokenizer.json").exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS} | {f"w{i}": i for i in range(3, TINY_LLAMA["vocab_size"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return path


def kv_transfer_config(role: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KvconnConnector",
        "kv_connector_module_path": "kvconn_vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"backend": "loopback", **extra},
    }


def make_scheduler(
    model: Path, role: str, num_blocks: int = 64, load_failure_policy: str = "recompute"
) -> Any:
    """vLLM's own Scheduler, its connector built by vLLM's factory from the
    user-facing config (no worker: the tests play its part)."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=str(model), dtype="float32", skip_tokenizer_init=True, max_model_len=512)
    transfer = KVTransferConfig(**kv_transfer_config(role), kv_load_failure_policy=load_failure_policy)
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=512,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32),
            )
        ],
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


_ids = itertools.count(1)


def make_request(
    num_tokens: int,
    max_tokens: int = 4,
    params: dict[str, Any] | None = None,
    prompt: list[int] | None = None,
) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    n = next(_ids)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    sampling.update_from_generation_config({}, EOS)
    request = Request(
        request_id=f"req-{n}",
        prompt_token_ids=prompt if prompt is not None else [(n * 7 + i) % 500 + 1 for i in range(num_tokens)],
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    request.kv_transfer_params = params
    return request


EOS = 2


def model_output(requests: list[Any], token: int = 7, **connector: Any) -> Any:
    """A worker's output for one step: ``token`` for each request, and the
    connector's reports (finished_sending, finished_recving, failed_recving)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = [r.request_id for r in requests]
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(**connector) if connector else None,
    )


def free_blocks(scheduler: Any) -> int:
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def request_blocks(scheduler: Any, req_id: str) -> list[int]:
    (ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
    return list(ids)
