"""Acceptance: from the target's chosen tokens to what a round emits, and the next anchor.

Per row, with ids = [anchor, d_1..d_{B-1}] the verified block and chosen[j] the target's token
after row j (argmax, or the row's seeded sample):
    n       = longest prefix with d_{j+1} == chosen[j], at most budget  (accepted drafts)
    emitted = chosen[0..n]                                       (d_1..d_n are chosen[0..n-1])
    kept    = min(n + 1, budget), cut after the first stop token among them
The row then advances: anchor = emitted[kept-1], pos += kept, budget -= kept. `out` gets
[emitted (B, -1 past kept) | kept | finished] with finished 1 = stop token, 2 = budget spent.
Rows with budget 0 (padding) emit nothing and do not move.
"""

from __future__ import annotations

import torch

from dflash_batch.kernels._triton import jit, tl

STOP, LENGTH = 1, 2


def accept_torch(ids: torch.Tensor, chosen: torch.Tensor, pos: torch.Tensor, budget: torch.Tensor,
                 stop_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """ids, chosen [n, B]; pos, budget [n] (updated in place, as is ids[:, 0]); stop_ids [n, S]
    (-1 = none); out [n, B + 2]. Returns the accepted drafts n [n]."""
    B = ids.shape[1]
    steps = torch.arange(B, device=ids.device)
    match = (ids[:, 1:] == chosen[:, :-1]).to(torch.int64).cumprod(-1).sum(-1)
    accepted = torch.minimum(match, budget)
    kept = torch.minimum(accepted + 1, budget)
    live = steps[None, :] < kept[:, None]
    is_stop = (chosen[:, :, None] == stop_ids[:, None, :]).any(-1) & live
    has_stop = is_stop.any(-1)
    kept = torch.where(has_stop, is_stop.to(torch.int64).argmax(-1) + 1, kept)
    emitted = torch.where(steps[None, :] < kept[:, None], chosen, -1)
    finished = torch.where(has_stop, STOP, torch.where((kept == budget) & (budget > 0), LENGTH, 0))
    out[:, :B] = emitted
    out[:, B] = kept
    out[:, B + 1] = finished
    last = emitted.gather(1, (kept - 1).clamp_min(0)[:, None])[:, 0]
    ids[:, 0] = torch.where(kept > 0, last, ids[:, 0])
    pos += kept
    budget -= kept
    return accepted


@jit(do_not_specialize=("B", "S"))
def _accept_kernel(ids_ptr, chosen_ptr, pos_ptr, budget_ptr, stop_ptr, out_ptr, acc_ptr,
                   B, S, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_B)
    in_block = j < B
    ids = tl.load(ids_ptr + row * B + j, mask=in_block, other=-1)
    chosen = tl.load(chosen_ptr + row * B + j, mask=in_block, other=-2)
    budget = tl.load(budget_ptr + row)
    # drafts[j] = ids[j + 1] compared with chosen[j], for j < B - 1
    drafts = tl.load(ids_ptr + row * B + j + 1, mask=j < B - 1, other=-1)
    miss = (drafts != chosen) | (j >= B - 1)
    match = tl.min(tl.where(miss, j, B - 1), 0)
    accepted = tl.minimum(match, budget)
    kept = tl.minimum(accepted + 1, budget)
    live = j < kept
    s = tl.arange(0, BLOCK_S)
    stops = tl.load(stop_ptr + row * S + s, mask=s < S, other=-1)
    is_stop = tl.sum((chosen[:, None] == stops[None, :]).to(tl.int32), 1) > 0
    is_stop = is_stop & live
    first_stop = tl.min(tl.where(is_stop, j, BLOCK_B), 0)
    has_stop = first_stop < BLOCK_B
    kept = tl.where(has_stop, first_stop + 1, kept)
    live = j < kept
    emitted = tl.where(live, chosen, -1)
    finished = tl.where(has_stop, 1, tl.where((kept == budget) & (budget > 0), 2, 0))
    tl.store(out_ptr + row * (B + 2) + j, emitted, mask=in_block)
    tl.store(out_ptr + row * (B + 2) + B, kept.to(tl.int64))
    tl.store(out_ptr + row * (B + 2) + B + 1, finished.to(tl.int64))
    last = tl.sum(tl.where(j == kept - 1, chosen, 0), 0)
    anchor = tl.load(ids_ptr + row * B)
    tl.store(ids_ptr + row * B, tl.where(kept > 0, last, anchor))
    tl.store(pos_ptr + row, tl.load(pos_ptr + row) + kept)
    tl.store(budget_ptr + row, budget - kept)
    tl.store(acc_ptr + row, accepted.to(tl.int64))


def accept_triton(ids: torch.Tensor, chosen: torch.Tensor, pos: torch.Tensor, budget: torch.Tensor,
                  stop_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The Triton twin of `accept_torch` (one program per row; every tensor contiguous int64)."""
    n, B = ids.shape
    accepted = torch.empty(n, dtype=torch.int64, device=ids.device)
    S = stop_ids.shape[1]
    _accept_kernel[(n,)](ids, chosen.contiguous(), pos, budget, stop_ids, out, accepted, B, S,
                         BLOCK_B=max(2, 1 << (B - 1).bit_length()), BLOCK_S=max(2, 1 << max(S - 1, 0).bit_length()))
    return accepted
