"""Routed experts kept in memory as the checkpoint stores them: MXFP4 (quant.py has the layout).

At production size the routed experts are 181 GB a rank packed and ~680 GB dequantized to
bfloat16, so they stay packed and are dequantized tile by tile inside the grouped matmul
(kernels/moe_mxfp4.py: the Triton kernel on a GPU, its torch reference, one expert at a time,
elsewhere). Each projection of every expert is one stacked parameter pair: this rank's rows of
expert e at e*rows..(e+1)*rows, loaded from the checkpoint's `experts.{e}.{w}.weight_packed` /
`.weight_scale` as they are (the loader stacks parts along dim 0 and cuts each along shard_dim).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_batch import parallel
from dflash_batch.kernels import ops
from dflash_batch.models.layers.linear import per_rank

GROUP = 32  # input columns per E8M0 scale


def _stored(shape: tuple[int, int], shard_dim: int, parts: list[tuple[str, int]]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
    p.shard_dim, p.packed = shard_dim, parts
    return p


class PackedProjection(nn.Module):
    """One projection (w1, w3 or w2) of all experts: codes [E*rows, cols/2], scales [E*rows, ceil(cols/32)]."""

    def __init__(self, name: str, experts: int, rows: int, cols: int, shard_dim: int | None):
        super().__init__()
        if shard_dim == 1 and cols % GROUP:  # a scale group would straddle two ranks
            raise ValueError(f"MXFP4 experts: {name}'s {cols} input columns a rank (tensor_parallel_size "
                             f"{parallel.world_size()}) are not a multiple of its scale group of {GROUP}")
        parts = [(f"{e}.{name}", rows * (parallel.world_size() if shard_dim == 0 else 1)) for e in range(experts)]
        self.weight_packed = _stored((experts * rows, cols // 2), shard_dim, parts)
        self.weight_scale = _stored((experts * rows, -(-cols // GROUP)), shard_dim, parts)
        self.experts = experts

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [E, rows, cols/2], scales [E, rows, ceil(cols/32)]): views, no copy."""
        return self.weight_packed.unflatten(0, (self.experts, -1)), self.weight_scale.unflatten(0, (self.experts, -1))


class MXFP4Experts(nn.Module):
    """Every routed expert of a layer (SiTU between w1/w3 and w2), packed; w1/w3 cut along their
    output rows across ranks and w2 along its input columns, as Expert's linears are, so each
    rank returns a partial sum that the caller reduces once. `whole`: this rank's expert slots,
    each whole (expert parallelism)."""

    def __init__(self, experts: int, hidden: int, inter: int, beta: float, linear_beta: float, whole: bool = False):
        super().__init__()
        local = inter if whole else per_rank(inter, "moe_intermediate_size")
        # Module names are those of the checkpoint's experts.{e}.{w1,w3,w2}.
        self.w1 = PackedProjection("w1", experts, local, hidden, None if whole else 0)
        self.w3 = PackedProjection("w3", experts, local, hidden, None if whole else 0)
        self.w2 = PackedProjection("w2", experts, hidden, local, None if whole else 1)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], ids [T, k] experts, weights [T, k] -> sum_j weights[:, j] * expert_ids[:, j](x)."""
        moe = ops.for_device(x.device).moe_mxfp4
        return moe(x, ids, weights, *self.w1.stacked(), *self.w3.stacked(), *self.w2.stacked(),
                   self.beta, self.linear_beta)
