"""RMSNorm as every model here defines it: x * rsqrt(mean(x^2) + eps) * w (plain w, not 1 + w)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in float32 (float64 for a float64 model), cast back, then scaled (as
    transformers does in half precision)."""
    if x.dtype in (torch.float32, torch.float64):  # no casts: each costs an op per call on small batches
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight.shard_dim = None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
