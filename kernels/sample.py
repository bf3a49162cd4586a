"""Seeded sampling from filtered logits: one token per row, drawn by inverse CDF at the row's coin.

Rows arrive scaled by their temperature and filtered (tokens outside top-k / top-p at -inf), so
the law is softmax(row). The coin is `coins.coin(seed, position)`: the draw depends on the row's
own values, seed and position only. Should rounding put the coin past the last cumulative
mass, the row's argmax (always a kept token) is taken.
"""

from __future__ import annotations

import torch

from dflash_batch.kernels._triton import jit, tl
from dflash_batch.kernels.coins import coin, coins


def top1(logits: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum along the last dim: argmax, by the max kernel (2-3x faster than
    argmax's on CPU; both return the first maximal index)."""
    return logits.max(-1).indices


def sample_torch(logits: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (scaled, filtered), seed [N], position [N] -> token ids [N] int64."""
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    cdf = probs.cumsum(-1)
    target = coins(seed, position) * cdf[:, -1]
    drawn = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return torch.where(drawn < logits.shape[-1], drawn, logits.argmax(-1))


@jit
def _sample_kernel(logits_ptr, stride, seed_ptr, pos_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    # Pass 1: the row's maximum and the first index holding it.
    best = float("-inf")
    best_i = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        i = tl.min(tl.where(x == m, offs, V), 0)
        better = m > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    # Pass 2: the softmax denominator.
    total = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        total += tl.sum(tl.exp(x - best), 0)
    # Pass 3: the first token whose cumulative mass passes coin * total.
    target = coin(tl.load(seed_ptr + row), tl.load(pos_ptr + row)) * total
    running = 0.0
    found = V
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        cdf = tl.cumsum(tl.exp(x - best), 0) + running
        found = tl.minimum(found, tl.min(tl.where((cdf > target) & (offs < V), offs, V), 0))
        running = tl.max(cdf, 0)
    tl.store(out_ptr + row, tl.where(found < V, found, best_i).to(tl.int64))


def sample_triton(logits: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                  block: int = 1024) -> torch.Tensor:
    """The Triton twin of `sample_torch` (one program per row)."""
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _sample_kernel[(logits.shape[0],)](logits, logits.stride(0), seed.to(torch.int64).contiguous(),
                                       position.to(torch.int64).contiguous(), out, logits.shape[1],
                                       BLOCK=block)
    return out
