"""Rotary position embeddings: default and YaRN frequencies, applied in either pair layout.

Rotate-half (NeoX) pairs x[i] with x[i + d/2]: Qwen3 and the GQA DFlash drafters. Interleaved
(GPT-J) pairs x[2i] with x[2i+1]: DeepSeek-style MLA, the DFlash2 MLA drafter among them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

YARN_TYPES = ("yarn", "deepseek_yarn")


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature correction for a context stretched `scale` times."""
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_positions: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """DeepSeek's YaRN frequencies: pairs that turn more than beta_fast times over the original
    context keep their frequency, pairs that turn fewer than beta_slow times are slowed down
    `factor` times, and a linear ramp over the pair index blends the two in between."""

    def correction_pair(rotations: float) -> float:  # the pair that turns `rotations` times
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_pair(beta_fast)), 0)
    high = min(math.ceil(correction_pair(beta_slow)), dim - 1)
    span = (high - low) or 0.001  # equal bounds: a step instead of a ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    keep = rope_inv_freq(dim, theta)
    return keep * (1 - ramp) + keep / factor * ramp


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary positions, computed from inv_freq (no table to size up front)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        # Angles in float32 (as transformers computes them), float64 for a float64 model.
        dtype = torch.promote_types(torch.get_default_dtype(), torch.float32)
        self.register_buffer("inv_freq", inv_freq.to(dtype), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] -> cos, sin [T, 1, dim] (broadcast over heads): the dim/2 angles twice over, with
        the first half of sin negated. Rotate-half RoPE is then x*cos + roll(x, dim/2)*sin, and
        the second halves hold each pair's angle once, as the interleaved layout reads them."""
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        return torch.cat([cos, cos], dim=-1)[:, None], torch.cat([-sin, sin], dim=-1)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half layout: x*cos + rotate_half(x)*sin_angles, rotate_half(x) = [-x2, x1] being
    roll(x, dim/2) * [-1, 1]. x: [T, heads, dim]; cos/sin from RotaryEmbedding."""
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved layout: pair i is (x[2i], x[2i+1]). x: [T, heads, dim]; cos/sin from
    RotaryEmbedding (its second halves hold each pair's angle once)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., half:].to(x.dtype), sin[..., half:].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def rope_parameters(config: dict) -> dict:
    """RoPE settings from either config layout: transformers v5 `rope_parameters` (rope_theta
    inside) or v4 `rope_scaling` next to a top-level `rope_theta`. rope_type is always set."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    # v4 configs (DeepSeek-V3's among them) spell the kind `type`.
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_from_config(config: dict, dim: int) -> RotaryEmbedding:
    """The RoPE of an HF config over `dim` rotated features: default or YaRN."""
    params = rope_parameters(config)
    theta, kind = float(params["rope_theta"]), params["rope_type"]
    if kind == "default":
        return RotaryEmbedding(rope_inv_freq(dim, theta))
    if kind not in YARN_TYPES:
        raise NotImplementedError(f"rope_type={kind!r} is not supported")
    if params.get("attention_factor") is not None or params.get("truncate", True) is False:
        raise NotImplementedError("YaRN with attention_factor or truncate=false is not supported")
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise ValueError(f"rope_type={kind!r} needs {key} in the RoPE parameters")
    factor = float(params["factor"])
    inv_freq = yarn_inv_freq(dim, theta, factor, params["original_max_position_embeddings"],
                             params.get("beta_fast") or 32, params.get("beta_slow") or 1)
    # DeepSeek's defaults: mscale 1, mscale_all_dim 0 (no correction in the denominator).
    scaling = yarn_mscale(factor, params.get("mscale", 1.0)) / yarn_mscale(factor, params.get("mscale_all_dim", 0.0))
    return RotaryEmbedding(inv_freq, scaling)


def yarn_softmax_mscale(config: dict) -> float:
    """DeepSeek-style MLA multiplies its softmax scale by the square of this: YaRN's temperature
    correction with mscale_all_dim (1 without YaRN)."""
    params = rope_parameters(config)
    if params["rope_type"] not in YARN_TYPES:
        return 1.0
    return yarn_mscale(float(params["factor"]), params.get("mscale_all_dim", 0.0))
