"""The MLA latent split across the tensor-parallel ranks by token (decode context parallelism).

Under plain tensor parallelism every rank keeps every sequence's whole MLA latent: heads split,
the one latent row a token has does not. Split `ways` ways, position p of a sequence is kept by
rank p mod ways alone. The engine's page size is a multiple of `ways` and pages start at
multiples of it, so the owner of global slot s is s mod ways and its row there is s div ways:
page tables stay as they are, a rank's cache holds 1/ways of the slots (page P's slots are local
rows P * page_size/ways ..), and a padding row's scratch slot is the local scratch row. Tokens,
not pages, are interleaved: any length splits within one token between ranks, a decoded token and
a verify block spread over all of them, and no token ever moves (a page-sized run would leave a
short sequence on one rank and a long one's newest page on one rank too).

Attention (backends call `merge_across_ranks`): each rank gathers every rank's query heads,
attends with all of them over the tokens it keeps, and the partial outputs are weighted by their
log-sum-exps across ranks and summed, each rank keeping its own heads' sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_batch import parallel


@dataclass(frozen=True)
class LatentSplit:
    """Rank `rank` of `ways` keeps the latent rows of positions rank, rank + ways, ..."""

    ways: int
    rank: int

    def rows(self, num_slots: int) -> int:
        """The local rows of a cache of `num_slots` global slots."""
        if num_slots % self.ways:
            raise ValueError(f"a latent cache of {num_slots} slots does not split {self.ways} ways")
        return num_slots // self.ways

    def first_kept(self, low: int | torch.Tensor) -> int | torch.Tensor:
        """The first position at or after `low` that this rank keeps."""
        return low + (self.rank - low) % self.ways

    def kept_below(self, length: int | torch.Tensor) -> int | torch.Tensor:
        """How many of positions 0..length-1 this rank keeps."""
        kept = (length - self.rank + self.ways - 1) // self.ways
        return kept.clamp_min(0) if isinstance(kept, torch.Tensor) else max(kept, 0)

    def write_rows(self, slots: torch.Tensor, scratch: int) -> torch.Tensor:
        """The local row each global slot is written to here (`scratch` where another rank keeps it,
        or the slot is -1)."""
        return torch.where((slots >= 0) & (slots % self.ways == self.rank), slots // self.ways, scratch)

    def owned_pairs(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local rows of the (src, dst) slot pairs this rank keeps (a copy of positions between two
        sequences: src and dst hold the same positions, so the same rank keeps both)."""
        mine = src % self.ways == self.rank
        return src[mine] // self.ways, dst[mine] // self.ways


def merge_across_ranks(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out [T, ranks * h, dv]: every rank's heads attended over this rank's keys, lse [T, ranks * h]
    their natural log-sum-exps (-inf: the row saw no key here) -> [T, h, dv], this rank's heads
    attended over every rank's keys, in at least float32."""
    wide = torch.promote_types(out.dtype, torch.float32)
    lse = lse.to(wide)
    every = parallel.all_gather_dim1(lse[:, None])                   # [T, ranks, ranks * h]
    total = torch.logsumexp(every, 1)                                 # [T, ranks * h]
    weight = (lse - total).exp().nan_to_num(0.0)  # a row no rank saw a key of: -inf - -inf
    return parallel.reduce_scatter_dim1(out.to(wide) * weight[..., None])
