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


# The same dimensions by name: a caller may override some (benchmarks/kimi_gpu_check.py: one TP8
# rank's share of the published drafter).
TINY_DIMS = dict(hidden=HIDDEN, heads=H, q_lora=QL, kv_lora=KL, nope=DN, rope=DR, v=DV, inter=INTER, layers=LAYERS,
                 conv_taps=CONV_TAPS, conv_group=CONV_GROUP, rank=RANK)


def mla_drafter_tensors(seed: int, vocab: int, num_taps: int, dims: dict | None = None) -> dict[str, torch.Tensor]:
    """Unit-scale random weights, named and shaped as a DFlash2-MLA checkpoint holds them (§1.2),
    so that nothing hides behind a test's tolerance. `dims`: TINY_DIMS's keys to override."""
    d = TINY_DIMS | (dims or {})
    hidden, heads, kl, taps = d["hidden"], d["heads"], d["kv_lora"], d["conv_taps"]
    groups = hidden // d["conv_group"]
    shapes = {"fc.weight": (hidden, num_taps * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,),
              "candidate_selector.predecessor_codebook": (vocab, d["rank"]),
              "candidate_selector.successor_codebook": (vocab, d["rank"]),
              "candidate_selector.hidden_projection.weight": (d["rank"], hidden)}
    for i in range(d["layers"]):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   a + "q_a_proj.weight": (d["q_lora"], hidden), a + "q_a_layernorm.weight": (d["q_lora"],),
                   a + "q_b_proj.weight": (heads * (d["nope"] + d["rope"]), d["q_lora"]),
                   a + "kv_a_proj_with_mqa.weight": (kl + d["rope"], hidden),
                   a + "kv_a_layernorm.weight": (kl,), a + "kv_b_proj.weight": (heads * (d["nope"] + d["v"]), kl),
                   a + "o_proj.weight": (hidden, heads * d["v"]),
                   p + "mlp.gate_proj.weight": (d["inter"], hidden), p + "mlp.up_proj.weight": (d["inter"], hidden),
                   p + "mlp.down_proj.weight": (hidden, d["inter"])}
        for conv in ("attention_conv", "mlp_conv"):
            shapes |= {p + f"{conv}.base_kernel": (2, taps, hidden),
                       p + f"{conv}.kernel_projection.weight": (2 * taps * groups, hidden)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        out[name] = 1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / math.sqrt(shape[-1])
    return out
