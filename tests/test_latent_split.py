"""The latent split (backends/latent_split.py) on the torch backend and on the flashinfer backend
(its MLA wrapper emulated: tests/fake_flashinfer.py), against attention over whole caches, in
float64 on 2 and 4 gloo ranks: each rank keeps exactly the rows of its positions, and prefill
chunks, a verify block (causal), a drafter's non-causal sliding block, padded sequences and
attention read block by block all give what one process gives, to rounding (flashinfer's: to its
float32 log-sum-exps). On flashinfer, eagerly (a causal chunk's queries in chains `ways` apart)
and as a captured round plans it (one wrapper sequence a query, in fixed buffers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_batch.backends import torch_attention
from dflash_batch.backends.latent_split import LatentSplit
from dflash_batch.backends.torch_attention import TORCH, TorchAttention
from dflash_batch.engine.cache import SeqRows, build_meta
from tests import fake_flashinfer
from tests.test_tp import free_port

HEADS, WIDTH, V_WIDTH, PAGE = 4, 24, 16, 16
PAGES = [list(range(0, 5)), list(range(5, 10))]  # two sequences' pages; page 10 is scratch
SLOTS = 11 * PAGE
# (name, rows of each sequence: (start, count, kv_len), causal, window): lengths not divisible by
# the ranks, a sequence of one token (some ranks keep none of it), uneven query counts (padding).
FORWARDS = [
    ("prefill", [(0, 37, 37), (0, 1, 1)], True, None),
    ("prefill, window 6 (a context shorter than window + queries)", [(0, 9, 9), (0, 1, 1)], True, 6),
    ("chunk", [(37, 21, 58), (1, 9, 10)], True, None),
    ("verify", [(58, 8, 66), (10, 8, 18)], True, None),
    ("verify, window 6", [(66, 8, 74), (18, 8, 26)], True, 6),
    ("draft block, non-causal window 6", [(66, 8, 74), (18, 8, 26)], False, 6),
    ("draft block, non-causal", [(66, 8, 74), (18, 8, 26)], False, None),
    # Windows whose first position is 1, 2 and 3 mod 4 (each rank's first kept key differs).
    ("verify, window 5 (first keys at 62 and 15)", [(66, 8, 74), (19, 8, 27)], True, 5),
    ("draft block, non-causal window 6 (first keys at 61 and 14)", [(66, 8, 74), (19, 8, 27)], False, 6),
]
# flashinfer's latent path takes windows over non-causal blocks no longer than the window only.
FLASHINFER_FORWARDS = [f for f in FORWARDS if f[3] is None] + [
    ("draft block, non-causal window 11", [(66, 8, 74), (18, 8, 26)], False, 11),
    ("draft block, non-causal window 10 past a context shorter than it", [(58, 8, 66), (0, 8, 8)], False, 10),
    # Windows whose first position is 1, 2 and 3 mod 4 (each rank's first kept key differs).
    ("draft block, non-causal window 9 (first keys at 65 and 18)", [(66, 8, 74), (19, 8, 27)], False, 9),
    ("draft block, non-causal window 12 (first keys at 62 and 15)", [(66, 8, 74), (19, 8, 27)], False, 12),
]
FORWARDS_OF = {"torch": FORWARDS, "flashinfer": FLASHINFER_FORWARDS}


def metas(backend, forwards):
    return [(name, build_meta([SeqRows(p, *r) for p, r in zip(PAGES, rows)], PAGE, backend=backend, name=name),
             causal, window) for name, rows, causal, window in forwards]


def data(meta, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    T = meta.num_rows
    return (torch.randn(T, 1, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(T, HEADS, WIDTH, generator=g, dtype=torch.float64))


def whole(forwards) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each forward's output over a whole cache, in one process, and the cache at the end; each
    output checked against softmax attention written out query by query from the masking rules."""
    cache = torch.zeros(SLOTS, 1, WIDTH, dtype=torch.float64)
    outs = []
    for step, (name, meta, causal, window) in enumerate(metas(TORCH, forwards)):
        rows, q = data(meta, step)
        TORCH.write(cache, meta, rows)
        outs.append(TORCH.attend_latent(q, cache, V_WIDTH, meta, 0.3, causal, window))
        torch.testing.assert_close(outs[-1], by_hand(q, cache, meta, causal, window), rtol=0, atol=1e-12, msg=name)
    return outs, cache


def by_hand(q: torch.Tensor, cache: torch.Tensor, meta, causal: bool, window: int | None) -> torch.Tensor:
    """Query at position p of a sequence sees its keys k < kv_len, k <= p if causal, and within the
    window (|p - k| < window on both sides when not causal)."""
    out = torch.zeros(q.shape[0], HEADS, V_WIDTH, dtype=torch.float64)
    for b, pages in enumerate(PAGES):
        kv_len = int(meta.kv_lens[b])
        keys = torch.stack([cache[pages[k // PAGE] * PAGE + k % PAGE, 0] for k in range(kv_len)])
        for j, p in enumerate(meta.q_positions[b].tolist()):
            if p < 0:
                continue
            seen = [k for k in range(kv_len) if (not causal or k <= p) and (window is None or p - k < window)
                    and (window is None or causal or k - p < window)]
            row = int(meta.q_index[b, j])
            weights = torch.softmax(q[row] @ keys[seen].T * 0.3, dim=-1)
            out[row] = weights @ keys[seen, :V_WIDTH]
    return out


def split_backend(kind: str, split: LatentSplit):
    if kind == "torch":
        return TorchAttention(split)
    sys.modules["flashinfer"] = fake_flashinfer.module()  # this rank's process only
    from dflash_batch.backends.flashinfer_attention import FlashInferAttention

    backend = FlashInferAttention("cpu", workspace_bytes=1024, split=split)
    backend.scratch_page = len(PAGES[0]) * len(PAGES)
    return backend


def rank_run(rank: int, ways: int, port: int, out_dir: str, scores_limit: int, kind: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ways)
    try:
        torch_attention.SCORES_LIMIT = scores_limit  # small: keys are read a block at a time
        split = LatentSplit(ways, rank)
        backend = split_backend(kind, split)
        cache = torch.zeros(split.rows(SLOTS), 1, WIDTH, dtype=torch.float64)
        h = HEADS // ways
        outs = []
        for step, (_, meta, causal, window) in enumerate(metas(backend, FORWARDS_OF[kind.split()[0]])):
            rows, q = data(meta, step)
            backend.plan(meta)
            if kind == "flashinfer captured" and meta.dense:  # planned as a captured round's wrappers are
                backend.graph_rows[meta.name] = meta.q_index.shape[0]
            backend.write(cache, meta, rows)
            outs.append(backend.attend_latent(q[:, rank * h:(rank + 1) * h], cache, V_WIDTH, meta, 0.3, causal, window))
        torch.save({"outs": outs, "cache": cache}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind,ways,scores_limit", [
    ("torch", 2, 1 << 24), ("torch", 4, 1 << 24), ("torch", 2, 256),
    ("flashinfer", 2, 0), ("flashinfer", 4, 0), ("flashinfer captured", 4, 0),
], ids=["2 ranks", "4 ranks", "2 ranks, blocks of keys", "flashinfer, 2 ranks", "flashinfer, 4 ranks",
        "flashinfer captured, 4 ranks"])
def test_split_attention_equals_whole(tmp_path, kind, ways, scores_limit):
    forwards = FORWARDS_OF[kind.split()[0]]
    want, cache = whole(forwards)
    mp.spawn(rank_run, args=(ways, free_port(), str(tmp_path), scores_limit, kind), nprocs=ways)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(ways)]
    for r, part in enumerate(got):
        # Rank r keeps exactly the slots s with s mod ways == r, at row s div ways (the scratch page aside).
        torch.testing.assert_close(part["cache"][:-PAGE // ways], cache[r:-PAGE:ways], rtol=0, atol=0)
    for i, (name, *_) in enumerate(forwards):
        heads = torch.cat([part["outs"][i] for part in got], dim=1)
        # flashinfer's log-sum-exps are float32: the merge's weights carry their rounding.
        torch.testing.assert_close(heads, want[i], rtol=0, atol=1e-12 if kind == "torch" else 2e-6, msg=name)


@pytest.mark.parametrize("ways", [1, 2, 3, 4])
def test_kept_positions_are_those_of_the_rank(ways):
    # The one definition both backends read: rank r keeps positions p with p mod ways == r.
    for rank in range(ways):
        split = LatentSplit(ways, rank)
        for low in range(0, 2 * ways + 3):
            kept = [p for p in range(low, low + ways) if p % ways == rank]
            assert split.first_kept(low) == kept[0]
            assert split.first_kept(torch.tensor([low])).tolist() == kept
            below = sum(p % ways == rank for p in range(low))
            assert split.kept_below(low) == below
            assert split.kept_below(torch.tensor([low, -low])).tolist() == [below, 0]


def test_a_split_needs_pages_that_split_evenly():
    with pytest.raises(ValueError, match="does not split 3 ways"):
        LatentSplit(3, 0).rows(SLOTS)
