"""Rotary position embeddings (rotate-half / NeoX layout, as Qwen3 and DFlash use)."""

from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary positions, computed from inv_freq (no table to size up front)."""

    def __init__(self, head_dim: int, theta: float, attention_scaling: float = 1.0,
                 inv_freq: torch.Tensor | None = None):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta) if inv_freq is None else inv_freq
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def rope_from_config(config: dict, head_dim: int) -> RotaryEmbedding:
    """Default RoPE from an HF config (`rope_parameters` in transformers v5, `rope_theta` in v4)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type != "default":
        raise NotImplementedError(f"rope_type={rope_type!r} is not supported for this model")
    return RotaryEmbedding(head_dim, theta)
