"""Tiny random Hugging Face checkpoints for oracle tests (fp32, seconds to build)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import transformers

TINY_QWEN3 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Unit-scale random weights: HF's init (std 0.02, norms at 1) gives near-uniform logits
    that would hide bugs behind any tolerance."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name:
            p.copy_(0.3 * noise)  # also the head when tied: keeps logits O(1), like a real LM
        else:
            p.copy_(noise / math.sqrt(p.shape[-1]))


def make_qwen3_checkpoint(directory: str | Path, seed: int = 0, max_shard_size: str | None = None,
                          **overrides) -> Path:
    """Save a random transformers Qwen3ForCausalLM (TINY_QWEN3 updated by overrides) to directory."""
    config = transformers.Qwen3Config(**{**TINY_QWEN3, **overrides})
    model = transformers.Qwen3ForCausalLM(config)
    randomize_(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return Path(directory)


def load_hf_model(directory: str | Path) -> transformers.PreTrainedModel:
    """The transformers reference model for a checkpoint, fp32 eager attention."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()
