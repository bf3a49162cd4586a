"""Cache scatter: row t of `values` goes to row slots[t] of a cache (paged K/V or MLA latents,
flattened to [slots, width]); slot -1 marks a padding row and is skipped."""

from __future__ import annotations

import torch

from dflash_batch.kernels._triton import jit, tl


def scatter_torch(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache [N, ...] (written in place), slots [T] int64, values [T, ...]."""
    keep = slots >= 0
    cache[slots[keep]] = values[keep].to(cache.dtype)


@jit
def _scatter_kernel(cache_ptr, slots_ptr, values_ptr, W, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        for start in range(0, W, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(values_ptr + row.to(tl.int64) * W + offs, mask=offs < W)
            tl.store(cache_ptr + slot * W + offs, v, mask=offs < W)


def scatter_triton(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, block: int = 512) -> None:
    """The Triton twin of `scatter_torch` (cache contiguous; one program per row)."""
    width = cache[0].numel()
    values = values.to(cache.dtype).reshape(values.shape[0], width).contiguous()
    _scatter_kernel[(values.shape[0],)](cache, slots.to(torch.int64).contiguous(), values, width, BLOCK=block)
