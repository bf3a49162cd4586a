"""Linear layers and embeddings that know how they are split across tensor-parallel ranks.

Each parameter carries `shard_dim`: the dim along which the checkpoint tensor is cut into
`world_size` equal slices (None = replicated). The loader reads only this rank's slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_batch import parallel


def new_param(shape: tuple[int, ...], shard_dim: int | None, dtype: torch.dtype | None = None) -> nn.Parameter:
    """A frozen parameter cut along shard_dim across ranks (None: replicated). dtype float32: for
    tensors that stay at least float32 whatever the model dtype (recurrent-state gates, router
    biases; a float64 model keeps them in float64)."""
    if dtype is not None:
        dtype = torch.promote_types(torch.get_default_dtype(), dtype)
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.shard_dim = shard_dim
    return p


def per_rank(n: int, what: str) -> int:
    """This rank's share of n (heads, features, vocab rows); n must divide evenly."""
    tp = parallel.world_size()
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={tp}")
    return n // tp


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = new_param((out_features, in_features), None)
        self.bias = new_param((out_features,), None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; each rank returns its own slice (no collective)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        local = per_rank(out_features, "out_features")
        self.weight = new_param((local, in_features), 0)
        self.bias = new_param((local,), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnLinear(nn.Module):
    """Column-parallel projections of one input in one matmul (q|k|v, gate|up). The checkpoint
    keeps them apart, as sibling modules named by `parts` (name -> output features): each part
    is cut across ranks on its own, and this rank's slices lie side by side in part order."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__()
        self.sizes = [per_rank(n, f"{name} out_features") for name, n in parts.items()]
        self.weight = new_param((sum(self.sizes), in_features), 0)
        self.weight.packed = list(parts.items())
        self.bias = None
        if bias:
            self.bias = new_param((sum(self.sizes),), 0)
            self.bias.packed = list(parts.items())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True):
        super().__init__()
        local = per_rank(in_features, "in_features")
        self.weight = new_param((out_features, local), 1)
        self.bias = new_param((out_features,), None) if bias else None
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce:
            y = parallel.all_reduce(y)
        # Bias is added once, after the sum, so it is not counted world_size times.
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; out-of-shard ids contribute zeros, then all-reduce."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.local_vocab = per_rank(vocab_size, "vocab_size")
        self.start = parallel.rank() * self.local_vocab
        self.weight = new_param((self.local_vocab, dim), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel.world_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return parallel.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Vocab-parallel output projection: the full logits row gathered on every rank, or (`gather`
    False) this rank's slice, for a caller that only needs the row's top few (parallel.sharded_*)."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__()
        self.weight = new_param((per_rank(vocab_size, "vocab_size"), dim), 0)

    def forward(self, x: torch.Tensor, gather: bool = True) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        return parallel.all_gather_last(logits) if gather else logits
