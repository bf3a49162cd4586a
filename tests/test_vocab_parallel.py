"""Argmax, top-1 and top-k over a vocabulary split across tensor-parallel ranks (gloo, 3 CPU ranks)
== torch's max / topk over the whole row: ties go to the lowest id (argmax's rule) across ranks
too, a non-finite value on any rank marks the row on every rank, k may exceed a rank's slice."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_batch import parallel
from tests.test_tp import free_port

RANKS, LOCAL, K = 3, 4, 6


def logits() -> torch.Tensor:
    full = torch.randn(6, RANKS * LOCAL, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    full[0, 2] = full[0, 9] = 9.0  # the maximum on ranks 0 and 2: id 2 wins
    full[1, 5] = full[1, 6] = 9.0  # twice on rank 1: id 5
    full[2, 11] = 9.0              # on the last rank
    full[3, 7] = float("inf")      # not finite (rank 1)
    full[4, 0] = float("nan")      # not finite (rank 0)
    return full


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        local = logits()[:, rank * LOCAL:(rank + 1) * LOCAL]
        ids, finite = parallel.sharded_top1(local)
        values, top_ids = parallel.sharded_topk(local[:3], K)  # rows without non-finite values
        torch.save(dict(ids=ids, finite=finite, values=values, top_ids=top_ids, argmax=parallel.sharded_argmax(local)),
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sharded_top1_and_topk_equal_whole_row(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=RANKS)
    full = logits()
    want_top = full[:3].topk(K, dim=-1)
    for rank in range(RANKS):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        finite_rows = [0, 1, 2, 5]
        assert got["ids"][finite_rows].tolist() == full.max(-1).indices[finite_rows].tolist()
        assert got["ids"][:3].tolist() == [2, 5, 11]
        assert torch.equal(got["argmax"], got["ids"])
        assert got["finite"].tolist() == torch.isfinite(full).all(-1).tolist() == [True] * 3 + [False] * 2 + [True]
        assert torch.equal(got["values"], want_top.values)
        # Ties sit at the top of rows 0 and 1: compare ids as sets there, in order below them.
        assert got["top_ids"][:, :2].sort().values.tolist() == want_top.indices[:, :2].sort().values.tolist()
        assert torch.equal(got["top_ids"][:, 2:], want_top.indices[:, 2:])


def test_one_rank_is_torch():
    full = logits()
    ids, finite = parallel.sharded_top1(full)
    assert torch.equal(ids, full.max(-1).indices) and torch.equal(finite, torch.isfinite(full).all(-1))
    values, top_ids = parallel.sharded_topk(full[:3], K)
    assert torch.equal(values, full[:3].topk(K).values) and torch.equal(top_ids, full[:3].topk(K).indices)
