"""Tiny Qwen3 target + DFlash drafter pairs for engine tests, and ways to run the engine."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash.model import DFlash2DraftModel, DFlashDraftModel
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Completion, Logprobs, Request, SamplingParams
from dflash_batch.engine.pair import attach_drafter
from dflash_batch.models.loader import load_model
from dflash_batch.plan.buckets import Bucket
from tests.tiny_models import make_qwen3_checkpoint, randomize_

# A small vocabulary makes the random target and drafter agree now and then, so rounds accept
# 0..B-1 drafts instead of always 0.
VOCAB = 8
MASK = VOCAB - 1
TAPS = [1, 2]


def make_target(directory: Path, seed: int = 0, vocab: int = VOCAB, peaked: bool = True,
                active: int | None = None, **overrides) -> Path:
    """A random Qwen3 target. `peaked`: its head is near rank one (logits ~ (h.u) * c + noise), so
    the argmax is mostly one of a few tokens at the ends of c; the drafter borrows that head and
    proposes from the same few tokens, and rounds accept 0..B-1 drafts. `active`: only the first
    `active` tokens get head rows (the rest score 0), for a large vocabulary that decodes like a
    small one."""
    make_qwen3_checkpoint(directory, seed=seed, vocab_size=vocab, **overrides)
    if peaked:
        path = directory / "model.safetensors"
        weights = load_file(path)
        gen = torch.Generator().manual_seed(seed + 99)
        hidden = weights["lm_head.weight"].shape[1]
        u = torch.randn(hidden, generator=gen) / hidden ** 0.5
        n = active or vocab
        head = torch.zeros(vocab, hidden)
        head[:n] = 3 * torch.outer(torch.linspace(-1, 1, n), u) + 0.05 * torch.randn(n, hidden, generator=gen)
        weights["lm_head.weight"] = head
        save_file(weights, path, metadata={"format": "pt"})
    return directory


def make_drafter(directory: Path, version: int, block_size: int = 8, sliding: bool = False,
                 is_causal: bool | None = False, seed: int = 1, vocab: int = VOCAB, window: int = 6,
                 layers: int = 2):
    """A random z-lab reference drafter saved to directory; returns the reference model."""
    dflash = dict(block_size=block_size, mask_token_id=vocab - 1, target_layer_ids=TAPS)
    if version == 2:
        dflash.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    extra = {} if is_causal is None else {"is_causal": is_causal}
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        use_sliding_window=sliding, sliding_window=window if sliding else None,
        layer_types=(["sliding_attention"] * (layers - 1) + ["full_attention"]) if sliding else None,
        num_target_layers=4, dflash_config=dflash,
        architectures=["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"], **extra)
    ref = (DFlash2DraftModel if version == 2 else DFlashDraftModel)(config)
    randomize_(ref, seed)
    ref.save_pretrained(directory)
    return ref.eval()


F64 = torch.float64  # invariance tests run the engine in float64: no near-tie resolves two ways


def load_pair(target_dir: Path, drafter_dir: Path | None, dtype: torch.dtype = torch.float32):
    target = load_model(target_dir, dtype)
    drafter = None
    if drafter_dir is not None:
        drafter = load_model(drafter_dir, dtype)
        attach_drafter(target, drafter)
    return target, drafter


def bucket(block_size: int | None = None, max_num_seqs: int = 16, max_tokens: int = 1024,
           speculation: bool | str = True, drafts: int | None = None) -> Bucket:
    return Bucket(0, f"0-{max_tokens}", max_tokens, max_num_seqs, speculation, block_size, drafts)


def run(engine: Engine, prompts: list[list[int]], bucket_: Bucket, **params) -> list[Completion]:
    """Completions in prompt order."""
    reqs = [Request((str(i), 0), p, SamplingParams(**{"seed": 1000 + i, **params})) for i, p in enumerate(prompts)]
    done = {c.key: c for c in engine.generate(reqs, bucket_)}
    return [done[r.key] for r in reqs]


def after_first(lp: Logprobs) -> Logprobs:
    """Prompt logprobs without the first prompt token's (None: nothing predicts it)."""
    return Logprobs(lp.token[1:], lp.top_ids[1:], lp.top[1:])


def random_prompts(lengths: list[int], vocab: int = VOCAB, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in lengths]


def pair_of_each_family(d: Path) -> dict[str, tuple]:
    """A float64 (target, drafter) of each family in directory d: a tiny Qwen3 with a DFlash v2
    drafter, and the tiny Kimi-K3 pair (testing/kimi_pair.py)."""
    from dflash_batch.testing import kimi_pair

    make_drafter(d / "drafter", 2)
    return {"qwen3": load_pair(make_target(d / "target"), d / "drafter", F64),
            "kimi": kimi_pair.load_pair(*kimi_pair.make_kimi_pair(d / "kimi"), F64)}
