"""Seeded initial weights for the target and drafter containers (built empty by their classes).

Choices, by parameter name:
- projections ~ N(0, 1/fan_in); projections that write into the residual stream (o_proj,
  down_proj, experts' w2, the latent up-projection) are scaled down by sqrt(2 * layers), so the
  stream does not grow with depth at the start;
- RMSNorm weights 1; AttnRes projections 0, so every AttnRes mix starts as a plain average of
  its candidates;
- KDA: A_log 0 and dt_bias spread over [-5, 0] (decays from ~0.97 to ~0.08 per token: several
  time scales), a small f_b so the bias decides the first decays, short convs that start near
  "pass the current token";
- router bias 0 (it is balanced by `moe.update_router_bias`, not by gradients);
- DFlash2 conv: base kernel = identity on the current row, kernel projection 0 (a fresh DFlash2
  layer equals a DFlash v1 layer); selector: predecessor codebook N(0, 0.02), successor codebook
  0 (the selector starts as a no-op, the doc's recipe).
"""

from __future__ import annotations

import math

import torch
from torch import nn

OUT_PROJ = ("o_proj.weight", "down_proj.weight", "w2.weight", "routed_expert_up_proj.weight")


def _value(name: str, p: torch.Tensor, gen: torch.Generator, layers: int) -> torch.Tensor:
    shape = p.shape
    randn = torch.randn(shape, generator=gen)
    if name.endswith(("norm.weight",)) and p.dim() == 1:
        return torch.ones(shape)
    if name.endswith("res_proj.weight"):
        return torch.zeros(shape)
    if name.endswith("A_log"):
        return torch.zeros(shape)
    if name.endswith("dt_bias"):
        return torch.rand(shape, generator=gen) * -5.0
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape)
    if name.endswith("conv1d.weight"):  # [C, 1, W]: the last tap multiplies the current token
        w = 0.1 * randn
        w[..., -1] += 1.0
        return w
    if name.endswith("embed_tokens.weight"):
        return randn
    if name.endswith("base_kernel"):  # [2, taps, D]: identity
        w = torch.zeros(shape)
        w[:, 0] = 1.0
        return w
    if name.endswith(("kernel_projection.weight", "successor_codebook")):
        return torch.zeros(shape)
    if name.endswith("predecessor_codebook"):
        return 0.02 * randn
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith("f_b_proj.weight"):
        std *= 0.1
    if name.endswith(OUT_PROJ):
        std /= math.sqrt(2 * layers)
    if name.endswith("lm_head.weight"):
        std *= 0.5
    return std * randn


def init_weights(model: nn.Module, seed: int, layers: int) -> nn.Module:
    """Fill every parameter (named_parameters order, one seeded stream) and make it trainable."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_value(name, p, gen, layers))
            p.requires_grad_(True)
    return model
