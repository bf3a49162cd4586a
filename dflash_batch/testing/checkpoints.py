"""Tiny random checkpoints in Hugging Face layout (config.json + model.safetensors), written with
safetensors alone: a Qwen3 target and a DFlash v1/v2 drafter for it. Tests, benchmarks and the
GPU check load them through the real loader; nothing here needs transformers.

`peaked`: the target's head is near rank one (logits ~ (h.u) * c + noise), so its argmax keeps
to a few tokens at the ends of c, and a random drafter, which borrows that head, proposes from
the same few: rounds accept 0..B-1 drafts instead of always none.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _save(directory: str | Path, config: dict, shapes: dict[str, tuple[int, ...]], seed: int) -> Path:
    """Unit-scale random weights (norms near 1), so no bug hides behind a tolerance."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        tensors[name] = 1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / math.sqrt(shape[-1])
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config, indent=1))
    return d


def _layer(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> dict:
    a, m = prefix + "self_attn.", prefix + "mlp."
    return {a + "q_proj.weight": (heads * head_dim, hidden), a + "k_proj.weight": (kv_heads * head_dim, hidden),
            a + "v_proj.weight": (kv_heads * head_dim, hidden), a + "o_proj.weight": (hidden, heads * head_dim),
            a + "q_norm.weight": (head_dim,), a + "k_norm.weight": (head_dim,),
            m + "gate_proj.weight": (inter, hidden), m + "up_proj.weight": (inter, hidden),
            m + "down_proj.weight": (hidden, inter),
            prefix + "input_layernorm.weight": (hidden,), prefix + "post_attention_layernorm.weight": (hidden,)}


def qwen3_checkpoint(directory: str | Path, *, vocab: int = 64, hidden: int = 64, layers: int = 4,
                     heads: int = 4, kv_heads: int = 2, head_dim: int = 16, inter: int = 128,
                     peaked: bool = True, seed: int = 0) -> Path:
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
                  intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu")
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        shapes |= _layer(f"model.layers.{i}.", hidden, heads, kv_heads, head_dim, inter)
    d = _save(directory, config, shapes, seed)
    if peaked:
        tensors = load_file(d / "model.safetensors")
        gen = torch.Generator().manual_seed(seed + 99)
        u = torch.randn(hidden, generator=gen) / hidden ** 0.5
        tensors["lm_head.weight"] = (3 * torch.outer(torch.linspace(-1, 1, vocab), u)
                                     + 0.05 * torch.randn(vocab, hidden, generator=gen))
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def dflash_checkpoint(directory: str | Path, *, version: int = 1, vocab: int = 64, hidden: int = 64,
                      layers: int = 1, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, inter: int = 128,
                      block_size: int = 8, target_layer_ids: tuple[int, ...] = (1, 2), num_target_layers: int = 4,
                      sliding_window: int | None = None, seed: int = 1) -> Path:
    """A DFlash drafter (z-lab layout) for a target of `hidden` width and `vocab` tokens; the mask
    token is the last id. `sliding_window`: every layer but the last slides."""
    dflash = dict(block_size=block_size, mask_token_id=vocab - 1, target_layer_ids=list(target_layer_ids))
    taps = len(target_layer_ids)
    shapes = {"fc.weight": (hidden, taps * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= _layer(f"layers.{i}.", hidden, heads, kv_heads, head_dim, inter)
    if version == 2:
        kernel, group, rank = 2, 16, 8
        dflash.update(conv_kernel_size=kernel, conv_group_size=group, selector_rank=rank, selector_top_k=4)
        for i in range(layers):
            for conv in ("attention_conv", "mlp_conv"):
                shapes |= {f"layers.{i}.{conv}.base_kernel": (2, kernel, hidden),
                           f"layers.{i}.{conv}.kernel_projection.weight": (2 * kernel * hidden // group, hidden)}
        shapes |= {"candidate_selector.predecessor_codebook": (vocab, rank),
                   "candidate_selector.successor_codebook": (vocab, rank),
                   "candidate_selector.hidden_projection.weight": (rank, hidden)}
    layer_types = (["sliding_attention"] * (layers - 1) + ["full_attention"]) if sliding_window else None
    config = dict(architectures=["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"], model_type="qwen3",
                  vocab_size=vocab,
                  hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=4096, hidden_act="silu", num_target_layers=num_target_layers,
                  dflash_config=dflash, is_causal=False, sliding_window=sliding_window, layer_types=layer_types)
    return _save(directory, config, shapes, seed)
