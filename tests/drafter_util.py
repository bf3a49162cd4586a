"""Paged-cache helpers for the drafter tests, and their tensor-parallel worker.

Kept free of transformers and dflash imports so the processes torch.multiprocessing spawns
start fast.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dflash_batch import parallel
from dflash_batch.backends.meta import AttnMeta
from dflash_batch.backends.torch_attention import TORCH
from dflash_batch.models.layers.linear import ParallelLMHead, VocabParallelEmbedding
from dflash_batch.models.loader import load_model

VOCAB, HIDDEN, PAGE = 256, 64, 4
MASK = VOCAB - 1
TAPS = [1, 3]
NUM_PAGES = 24


def load_drafter(directory: Path, embed: nn.Module, head: nn.Module) -> nn.Module:
    model = load_model(directory)
    model.bind_target(embed, head)
    model.allocate_cache(NUM_PAGES * PAGE, torch.float32, "cpu")
    return model


def meta_for(rows: list[torch.Tensor], tables: list[list[int]]) -> AttnMeta:
    """Packed rows of several sequences; sequence b's rows sit at positions rows[b] and see every
    key up to its last row's position."""
    positions = torch.cat(rows)
    table = torch.tensor(tables)
    seq = torch.cat([torch.full((len(r),), b) for b, r in enumerate(rows)])
    q_max = max(len(r) for r in rows)
    q_index = torch.full((len(rows), q_max), len(positions))  # padding -> scratch row T
    q_positions = torch.full((len(rows), q_max), -1)
    start = 0
    for b, r in enumerate(rows):
        q_index[b, :len(r)] = torch.arange(start, start + len(r))
        q_positions[b, :len(r)] = r
        start += len(r)
    kv_lens = torch.tensor([int(r[-1]) + 1 for r in rows])
    return AttnMeta(
        positions=positions, slots=table[seq, positions // PAGE] * PAGE + positions % PAGE,
        q_index=q_index, q_positions=q_positions, kv_lens=kv_lens, block_tables=table,
        page_size=PAGE, max_kv=int(kv_lens.max()), logits_rows=torch.arange(len(positions)), backend=TORCH)


def scattered_tables(n: int) -> list[list[int]]:
    """n disjoint, shuffled page lists."""
    perm = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(7)).tolist()
    per = NUM_PAGES // n
    return [perm[b * per:(b + 1) * per] for b in range(n)]


def block_ids(anchor: int, block_size: int) -> torch.Tensor:
    return torch.tensor([anchor] + [MASK] * (block_size - 1))


def two_rounds(directory: Path, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> dict:
    """Two draft rounds for a batch of two sequences, with the target's embedding and head cut
    vocab-parallel as the Qwen3 target cuts them; hidden states and proposals of each round."""
    embed, head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(HIDDEN, VOCAB)
    local = VOCAB // parallel.world_size()
    embed.weight.data.copy_(embed_weight[parallel.rank() * local:(parallel.rank() + 1) * local])
    head.weight.data.copy_(head_weight[parallel.rank() * local:(parallel.rank() + 1) * local])
    model = load_drafter(directory, embed, head)
    tables = scattered_tables(2)
    gen = torch.Generator().manual_seed(11)
    starts, out = [0, 0], {"hidden": [], "proposals": []}
    for n_ctx, anchors in [([20, 13], [17, 99]), ([3, 5], [42, 7])]:
        taps = torch.randn(sum(n_ctx), len(TAPS) * HIDDEN, generator=gen)
        model.write_context(taps, meta_for([torch.arange(s, s + n) for s, n in zip(starts, n_ctx)], tables))
        starts = [s + n for s, n in zip(starts, n_ctx)]
        ids = torch.cat([block_ids(a, 8) for a in anchors])
        hidden = model(ids, meta_for([torch.arange(s, s + 8) for s in starts], tables))
        out["hidden"].append(hidden)
        out["proposals"].append(model.propose(hidden.view(2, 8, HIDDEN), torch.tensor(anchors)))
    return out


def run(rank: int, world_size: int, port: int, checkpoints: list[str], embed_weight: torch.Tensor,
        head_weight: torch.Tensor, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # two ranks share a small CPU
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = [two_rounds(Path(c), embed_weight, head_weight) for c in checkpoints]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
