"""A round's inputs from the decoding state: positions, cache slots, the draft block's ids and
the key lengths both forwards may see.

Row r verifies [anchor, d_1..d_{B-1}] at positions pos..pos+B-1, whose cache slots come from its
page table (page -1: a padding row, slot -1, never written). The draft block [anchor, mask x
(B-1)] sits at the same positions; its keys stop at pos + min(B, budget + 1), so a block cut short
by the budget drafts what a shorter block would.
"""

from __future__ import annotations

import torch

from dflash_batch.kernels._triton import jit, tl


def prepare_torch(ids: torch.Tensor, pos: torch.Tensor, budget: torch.Tensor, tables: torch.Tensor,
                  page_size: int, mask_id: int) -> tuple[torch.Tensor, ...]:
    """ids [n, B], pos, budget [n], tables [n, P] -> (draft_ids [n*B], positions [n*B],
    slots [n*B], draft_kv [n], verify_kv [n])."""
    B = ids.shape[1]
    steps = torch.arange(B, device=ids.device)
    positions = pos[:, None] + steps
    pages = tables.gather(1, positions // page_size)
    slots = torch.where(pages >= 0, pages * page_size + positions % page_size, -1)
    draft_ids = torch.where(steps == 0, ids[:, :1], mask_id)
    return (draft_ids.reshape(-1), positions.reshape(-1), slots.reshape(-1),
            pos + torch.clamp(budget + 1, max=B), pos + B)


@jit(do_not_specialize=("B", "P"))
def _prepare_kernel(ids_ptr, pos_ptr, budget_ptr, tables_ptr, draft_ptr, positions_ptr, slots_ptr,
                    draft_kv_ptr, verify_kv_ptr, B, P, page_size, mask_id, BLOCK_B: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_B)
    in_block = j < B
    pos = tl.load(pos_ptr + row)
    positions = pos + j
    pages = tl.load(tables_ptr + row * P + positions // page_size, mask=in_block, other=-1)
    slots = tl.where(pages >= 0, pages * page_size + positions % page_size, -1)
    anchor = tl.load(ids_ptr + row * B)
    draft = tl.where(j == 0, anchor, mask_id)
    tl.store(draft_ptr + row * B + j, draft.to(tl.int64), mask=in_block)
    tl.store(positions_ptr + row * B + j, positions, mask=in_block)
    tl.store(slots_ptr + row * B + j, slots.to(tl.int64), mask=in_block)
    budget = tl.load(budget_ptr + row)
    tl.store(draft_kv_ptr + row, pos + tl.minimum(budget + 1, B))
    tl.store(verify_kv_ptr + row, pos + B)


def prepare_triton(ids: torch.Tensor, pos: torch.Tensor, budget: torch.Tensor, tables: torch.Tensor,
                   page_size: int, mask_id: int) -> tuple[torch.Tensor, ...]:
    """The Triton twin of `prepare_torch` (one program per row; int64 inputs)."""
    n, B = ids.shape
    dev = ids.device
    draft, positions, slots = (torch.empty(n * B, dtype=torch.int64, device=dev) for _ in range(3))
    draft_kv, verify_kv = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(2))
    _prepare_kernel[(n,)](ids.contiguous(), pos.contiguous(), budget.contiguous(), tables.contiguous(),
                          draft, positions, slots, draft_kv, verify_kv, B, tables.shape[1], page_size,
                          mask_id, BLOCK_B=max(2, 1 << (B - 1).bit_length()))
    return draft, positions, slots, draft_kv, verify_kv
