"""A tiny DFlash2 drafter in `attention_mode: mla` (the Kimi-K3 drafter's shape, shrunk): its
dimensions and random weights, shared by the MLA drafter tests and the tiny Kimi-K3 pair
(kimi_pair.py).
Imports neither transformers nor dflash, so spawned TP workers may use it."""

from __future__ import annotations

import math

import torch

HIDDEN = 64
# The published drafter's shape, shrunk: H heads, q/kv LoRA ranks, nope/rope/v head dims.
H, QL, KL, DN, DR, DV = 4, 32, 16, 16, 8, 16
INTER, LAYERS = 128, 3
CONV_TAPS, CONV_GROUP, RANK = 2, 16, 8
# TokenSpeed's unit-test fixture for a DFlash2-MLA config (§1.1).
YARN = dict(rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=32768,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def mla_drafter_tensors(seed: int, vocab: int, num_taps: int) -> dict[str, torch.Tensor]:
    """Unit-scale random weights, named and shaped as a DFlash2-MLA checkpoint holds them (§1.2),
    so that nothing hides behind a test's tolerance."""
    groups = HIDDEN // CONV_GROUP
    shapes = {"fc.weight": (HIDDEN, num_taps * HIDDEN), "hidden_norm.weight": (HIDDEN,), "norm.weight": (HIDDEN,),
              "candidate_selector.predecessor_codebook": (vocab, RANK),
              "candidate_selector.successor_codebook": (vocab, RANK),
              "candidate_selector.hidden_projection.weight": (RANK, HIDDEN)}
    for i in range(LAYERS):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                   a + "q_a_proj.weight": (QL, HIDDEN), a + "q_a_layernorm.weight": (QL,),
                   a + "q_b_proj.weight": (H * (DN + DR), QL), a + "kv_a_proj_with_mqa.weight": (KL + DR, HIDDEN),
                   a + "kv_a_layernorm.weight": (KL,), a + "kv_b_proj.weight": (H * (DN + DV), KL),
                   a + "o_proj.weight": (HIDDEN, H * DV),
                   p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTER)}
        for conv in ("attention_conv", "mlp_conv"):
            shapes |= {p + f"{conv}.base_kernel": (2, CONV_TAPS, HIDDEN),
                       p + f"{conv}.kernel_projection.weight": (2 * CONV_TAPS * groups, HIDDEN)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        out[name] = 1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / math.sqrt(shape[-1])
    return out
