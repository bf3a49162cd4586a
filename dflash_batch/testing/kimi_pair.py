"""A tiny Kimi-K3 target and a matching tiny DFlash2 drafter in `attention_mode: mla`, for the
engine tests and the long-context benchmark. Imports neither transformers nor dflash, so spawned
TP workers may use it.

The drafter taps target layers 1 (KDA) and 3 (gated MLA, and an AttnRes block-write layer), so
both kinds of layer state feed the drafter's context. Its two sliding layers have a window shorter
than the test prompts; its last layer attends to the whole context.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_batch.engine.pair import attach_drafter
from dflash_batch.models.loader import load_model
from dflash_batch.testing.mla_drafter import HIDDEN, TINY_DIMS, YARN, mla_drafter_tensors
from dflash_batch.testing.kimi import make_kimi_checkpoint

VOCAB = 96                          # the tiny Kimi-K3's (hidden 64: HIDDEN below)
TAPS = [1, 3]                       # 0-based: layer 1 is KDA, layer 3 MLA (testing/kimi.py's default layout)
MASK = 95                           # the tiny Kimi's pad id: valid, and outside the active tokens
ACTIVE = 8                          # tokens with a (peaked) head row in the target
BLOCK = 8
SEL_TOP_K = 4


def drafter_config(stream: str = "prefix", window: int = 6, dims: dict | None = None, vocab: int = VOCAB,
                   target_layers: int = 8) -> dict:
    """`dims`: mla_drafter.TINY_DIMS's keys to override; `vocab`, `target_layers`: the target's."""
    d = TINY_DIMS | (dims or {})
    dflash = dict(block_size=BLOCK, attention_mode="mla", conv_kernel_size=d["conv_taps"],
                  conv_group_size=d["conv_group"], selector_rank=d["rank"], selector_top_k=SEL_TOP_K,
                  target_layer_ids=TAPS, mask_token_id=MASK)
    if stream != "prefix":  # absent for "prefix": the target's default must apply
        dflash["aux_hidden_stream"] = stream
    return dict(
        architectures=["DFlash2DraftModel"], model_type="qwen3", hidden_act="silu",
        hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], num_key_value_heads=d["heads"], q_lora_rank=d["q_lora"],
        kv_lora_rank=d["kv_lora"], qk_nope_head_dim=d["nope"], qk_rope_head_dim=d["rope"], v_head_dim=d["v"],
        vocab_size=vocab, rms_norm_eps=1e-5, num_target_layers=target_layers,
        layer_types=["sliding_attention"] * (d["layers"] - 1) + ["full_attention"],
        is_causal=False, use_sliding_window=True, sliding_window=window, rope_parameters=dict(YARN),
        dflash_config=dflash)


def drafter_tensors(seed: int, dims: dict | None = None, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    return mla_drafter_tensors(seed, vocab, len(TAPS), dims)


def set_target_head(target_dir: Path, head: torch.Tensor) -> None:
    """Replace language_model.lm_head.weight in whichever safetensors shard holds it."""
    for path in sorted(target_dir.glob("*.safetensors")):
        weights = load_file(path)
        if "language_model.lm_head.weight" in weights:
            weights["language_model.lm_head.weight"] = head.to(weights["language_model.lm_head.weight"].dtype)
            save_file(weights, path, metadata={"format": "pt"})
            return
    raise KeyError(f"no language_model.lm_head.weight in {target_dir}")


def peaked_head(seed: int, scale: float = 3.0, active: int = ACTIVE, vocab: int = VOCAB,
                slices: int = 1, hidden: int = HIDDEN) -> torch.Tensor:
    """Near rank one on the first `active` tokens, logits ~ scale * (h.u) * c + noise: the argmax is
    mostly a token at one end of c, which the drafter (borrowing this head) also tends to propose,
    so rounds accept 0..B-1 drafts. The other tokens get a faint noise row rather than zeros, so no
    two logits tie exactly (a top-k cut through a tie would depend on the sort's tie order).
    `slices` > 1, for tensor-parallel tests: each of the vocabulary's `slices` equal parts (each
    rank's slice) holds active / slices of the tokens, at its start, peaked along a direction of
    their own (the head is rank `slices`), so greedy tokens and the drafter's candidates come from
    every rank's slice, not rank 0's alone. `hidden`: the target's width (the tiny one's by default)."""
    if active % slices or vocab % slices:
        raise ValueError(f"slices={slices} must divide active={active} and vocab={vocab}")
    gen = torch.Generator().manual_seed(seed + 99)
    u = torch.randn(slices, hidden, generator=gen) / hidden ** 0.5
    head = 0.001 * torch.randn(vocab, hidden, generator=gen)
    per_slice = active // slices
    ids = (torch.arange(slices)[:, None] * (vocab // slices) + torch.arange(per_slice)).flatten()
    c = torch.linspace(-1, 1, per_slice)
    head[ids] += scale * (c[None, :, None] * u[:, None, :]).flatten(0, 1)
    head[ids] += 0.05 * torch.randn(active, hidden, generator=gen)
    return head


def make_kimi_pair(directory: str | Path, stream: str = "prefix", window: int = 6, seed: int = 0,
                   peaked: bool = True, head_scale: float = 3.0, active: int = ACTIVE, slices: int = 1,
                   drafter_dims: dict | None = None, **target_overrides) -> tuple[Path, Path]:
    """(target_dir, drafter_dir) under directory. `head_scale` < 3 softens the peaked head (for
    sampling tests that need several likely tokens per step); `slices`: the tensor-parallel ranks
    whose vocabulary slices all hold likely tokens (peaked_head); `drafter_dims` and
    `target_overrides` widen the pair (the peaked head follows the target's width)."""
    directory = Path(directory)
    target = make_kimi_checkpoint(directory / "target", seed=seed, **target_overrides)
    vocab = target_overrides.get("vocab_size", VOCAB)
    if peaked:
        set_target_head(target, peaked_head(seed, head_scale, active, vocab, slices,
                                            target_overrides.get("hidden_size", HIDDEN)))
    layers = target_overrides.get("num_hidden_layers", 8)
    drafter = directory / f"drafter_{stream}"
    drafter.mkdir(parents=True, exist_ok=True)
    (drafter / "config.json").write_text(json.dumps(drafter_config(stream, window, drafter_dims, vocab, layers)))
    save_file(drafter_tensors(seed + 1, drafter_dims, vocab), drafter / "model.safetensors", metadata={"format": "pt"})
    return target, drafter


def load_pair(target_dir: str | Path, drafter_dir: str | Path, dtype: torch.dtype = torch.float32):
    """(target, drafter) paired as build_engine pairs them: the drafter borrows the target's
    embedding and head, and the target taps the drafter's layers on the drafter's stream."""
    target, drafter = load_model(target_dir, dtype), load_model(drafter_dir, dtype)
    attach_drafter(target, drafter)
    return target, drafter
