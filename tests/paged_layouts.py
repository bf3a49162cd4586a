"""Attention layouts for backend tests, importable where neither transformers nor the dflash
reference package is installed (tests/test_gpu.py runs on the GPU machine, which has neither)."""

from __future__ import annotations

import torch

from dflash_batch.backends.meta import AttnMeta
from dflash_batch.engine.cache import SeqRows, build_meta


def scattered_meta(seqs: list[tuple[int, int]], page: int, device: str, seed: int = 0) -> AttnMeta:
    """A forward of (query rows, context before them) per sequence, each on its own pages
    scattered over 64."""
    pages = torch.randperm(64, generator=torch.Generator().manual_seed(seed)).tolist()
    rows, used = [], 0
    for new, ctx in seqs:
        n = -(-(new + ctx) // page)
        rows.append(SeqRows(pages[used:used + n], ctx, new, ctx + new))
        used += n
    return build_meta(rows, page, None, device, name="forward")
