"""The torch reference attention over a long context: past SCORES_LIMIT it attends to the keys a
block at a time, merging the blocks by their log-sum-exp (memory in the block, not in the
context). Blocked == one-shot SDPA on paged caches (GQA heads, absorbed MLA latents, causal,
sliding windows both ways (read as a window-long span of keys), padding rows, scattered pages),
through ATen's fused CPU kernel and through plain ops (the path other devices take), in float64
to 1e-12; and a tiny Kimi-K3's chunked prefill of a 600-token prompt gives the same logits
through blocks as through one SDPA."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_batch.backends import torch_attention
from dflash_batch.backends.torch_attention import TORCH
from dflash_batch.engine.cache import SeqRows, build_meta
from dflash_batch.models.loader import load_model
from tests.numerics import assert_close
from dflash_batch.testing.kimi import make_kimi_checkpoint

PAGE = 4


def metas(seed: int):
    pages = list(range(64))
    random.Random(seed).shuffle(pages)
    # No sequence's queries start before position 12: a causal forward's blocks of keys before it
    # take no mask.
    rows = [SeqRows(pages[:20], 30, 9, 39), SeqRows(pages[20:40], 12, 17, 29), SeqRows(pages[40:64], 60, 1, 61)]
    return lambda: build_meta(rows, PAGE, None, "cpu", None, False)


@pytest.mark.parametrize("causal, window", [(True, None), (True, 5), (False, 6), (False, None)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_blocked_equals_one_shot(monkeypatch, causal, window, heads, kv_heads, fused):
    monkeypatch.setattr(torch_attention, "FUSED_CPU_BLOCKS", fused)
    meta = metas(heads * 10 + kv_heads)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(27, heads, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(64 * PAGE + 1, kv_heads, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(64 * PAGE + 1, kv_heads, 8, generator=gen, dtype=torch.float64)
    want = TORCH.attend(q, k, v, meta(), 0.3, causal, window)
    want_latent = TORCH.attend_latent(q, k, 8, meta(), 0.3, causal, window)
    for block in (4, 12, 40):  # the limit sets the block: a page, a few, most of the context
        monkeypatch.setattr(torch_attention, "SCORES_LIMIT", block * heads * 17 * 3)
        assert_close(TORCH.attend(q, k, v, meta(), 0.3, causal, window), want, rel=1e-12)
        assert_close(TORCH.attend_latent(q, k, 8, meta(), 0.3, causal, window), want_latent, rel=1e-12)


def test_a_long_prefill_through_blocks_gives_the_same_logits(tmp_path, monkeypatch):
    model = load_model(make_kimi_checkpoint(tmp_path / "kimi"), torch.float64)
    ids = torch.randint(0, model.vocab_size, (600,), generator=torch.Generator().manual_seed(1))
    pages = list(range(160))

    def prefill() -> torch.Tensor:
        model.allocate_cache(len(pages) * 4, torch.float64, "cpu")
        model.allocate_state(1, 1, 8, "cpu")
        out = []
        for start in range(0, len(ids), 256):  # chunked, as the engine prefills
            chunk = ids[start:start + 256]
            meta = build_meta([SeqRows(pages, start, len(chunk), start + len(chunk))], 4, None, "cpu", [0], False)
            out.append(model(chunk, meta)[0])
        return torch.cat(out)

    want = prefill()
    monkeypatch.setattr(torch_attention, "SCORES_LIMIT", 256 * 64 * 8)  # blocks of 128 keys (4 heads)
    calls = []
    blocked = torch_attention._blocked
    monkeypatch.setattr(torch_attention, "_blocked", lambda *a: calls.append(a[-2]) or blocked(*a))
    assert_close(prefill(), want, rel=1e-10)
    assert 128 in calls  # the last, shorter chunk takes larger blocks
