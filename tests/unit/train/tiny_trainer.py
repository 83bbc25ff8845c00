"""A tiny Qwen3 on disk and its batches, for the single-rank trainer tests (offload, LoRA): loaded
from disk, not built from a seed, so rank 0's weights are broadcast into the shards as a job's are."""

from __future__ import annotations

import torch

from kuberl.common.samples import Sample, TrainBatch

VOCAB = 128


def save_tiny_qwen3(path) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def tiny_batch(step: int) -> TrainBatch:
    """Six samples of a few tokens, the same for the same ``step``."""
    g = torch.Generator().manual_seed(step)
    return TrainBatch([Sample(prompt_ids=torch.randint(4, VOCAB, (3 + i % 3,), generator=g).tolist(),
                              response_ids=torch.randint(4, VOCAB, (4 + i % 5,), generator=g).tolist(),
                              advantage=float(i % 3) - 1.0, group=i // 2) for i in range(6)])
