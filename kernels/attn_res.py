"""Kimi-K3's block attention residual: per token, a softmax over N values [block snapshots...,
current] of the scores <RMSNorm(v), w>, mixing the raw values, in float32.

w is the norm's weight times the projection's single row, in float32 (float64 for a float64
model): `wide(norm.weight) * wide(proj.weight)[0]`, as `kimi_k3.attn_res_mix` forms it.

The Triton version runs one program per block of tokens with whole hidden rows in registers (H
masked up to a power of two: 7168 -> 8192). It reads each value once: its mean square, its score
and its share of the mix all come from the one load, the mix kept right by an online softmax
(running max, denominator and weighted sum, rescaled when the max moves). The values arrive as a
tuple of kernel arguments, one pointer and row stride each: no torch.stack copy, no pointer table
copied to the device, and a CUDA graph bakes the addresses in as it does any kernel's arguments.
The kernel is unrolled over N, so it compiles once per N (a model has a handful).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_batch.kernels._triton import jit, tl


def attn_res_torch(values: Sequence[torch.Tensor] | torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """values N x [T, H] (a list, current last, or stacked [N, T, H]), w [H] -> the mix [T, H] in
    the values' dtype, computed in float32 (float64 for float64 values)."""
    stacked = values if isinstance(values, torch.Tensor) else torch.stack(list(values))
    x = stacked.to(torch.promote_types(stacked.dtype, torch.float32))
    scores = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)).sum(-1)
    return (scores.softmax(0)[..., None] * x).sum(0).to(stacked.dtype)


@jit(do_not_specialize=("T",))
def _attn_res_kernel(values, row_strides, w_ptr, out_ptr, T, H, eps,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (cols < H)[None, :]
    rows = rows.to(tl.int64)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)[None, :]
    best = tl.full([BLOCK_T], float("-inf"), tl.float32)  # the largest score so far
    total = tl.zeros([BLOCK_T], tl.float32)               # sum of exp(score - best)
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)        # sum of exp(score - best) * value
    for i in tl.static_range(len(values)):
        # Masked lanes and rows load zeros: they add nothing to the sums, and a padding row's
        # scores are 0 (not NaN), its output never stored.
        v = tl.load(values[i] + rows * row_strides[i] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        score = tl.sum(v * w, 1) * tl.rsqrt(tl.sum(v * v, 1) / H + eps)
        new_best = tl.maximum(best, score)
        fade = tl.exp(best - new_best)  # 0 at the first value (best = -inf)
        p = tl.exp(score - new_best)
        total = total * fade + p
        acc = acc * fade[:, None] + p[:, None] * v
        best = new_best
    tl.store(out_ptr + rows * H + cols[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def attn_res_triton(values: Sequence[torch.Tensor] | torch.Tensor, w: torch.Tensor, eps: float,
                    block_t: int | None = None) -> torch.Tensor:
    """The Triton twin of `attn_res_torch` (float32 arithmetic whatever the dtype; each value
    needs unit stride along H only, any row stride; block_t tokens a program: by default up to 16,
    as many as keep its tile within 4096 elements, at least one)."""
    parts = tuple(values.unbind(0) if isinstance(values, torch.Tensor) else values)
    parts = tuple(v if v.stride(-1) == 1 else v.contiguous() for v in parts)
    T, H = parts[-1].shape
    out = torch.empty(T, H, dtype=parts[-1].dtype, device=parts[-1].device)
    block_h = 1 << (H - 1).bit_length()
    block_t = block_t or max(1, min(16, 4096 // block_h))
    strides = tuple(v.stride(0) for v in parts)
    _attn_res_kernel[(-(-T // block_t),)](parts, strides, w.to(torch.float32).contiguous(), out, T, H, eps,
                                          BLOCK_T=block_t, BLOCK_H=block_h,
                                          num_warps=8 if block_t * block_h >= 4096 else 4)
    return out
