"""What flashinfer's MLA wrapper cannot do for a sliding-window layer, done beside it in torch.

flashinfer's BatchMLAPagedAttentionWrapper has no window. A non-causal sliding layer's block of
B queries (the drafter's) sees, for query j at position q_j, the keys less than `window` away on
either side, up to the block's end `kv_len`; with a window of at least B, the right-hand bound
never bites. Every query of the block then sees the last query's window [kv_len - window,
kv_len): the wrapper attends over that, listed slot by slot (page size 1). Query j also sees the
"edge strip" of the B - 1 positions just before it, those above q_j - window: attended here,
masked per query, and merged with the wrapper's part by their log-sum-exps (TokenSpeed's drafter
kernel takes the window itself; this keeps to flashinfer). Device tensors only, no host read:
it runs inside captured rounds.
"""

from __future__ import annotations

import torch

from dflash_batch.backends.latent_split import LatentSplit
from dflash_batch.backends.meta import AttnMeta
from dflash_batch.backends.torch_attention import block_attention


def edge_strip(q: torch.Tensor, cache: torch.Tensor, v_width: int, meta: AttnMeta, scale: float,
               window: int, split: LatentSplit | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, w] of a dense forward over a latent cache [slots, 1, w] -> (out [T, heads,
    v_width], natural log-sum-exp [T, heads, 1]; -inf where a query sees no strip key). `split`:
    the strip's positions this rank keeps, in its rows of the cache."""
    bs, q_max = meta.q_index.shape
    T, heads, w = q.shape
    ps = meta.page_size
    low = (meta.kv_lens - window).clamp_min(0)                                     # [bs]
    pos = low[:, None] - torch.arange(q_max - 1, 0, -1, device=q.device)           # [bs, B-1]
    at = pos.clamp_min(0)
    page = meta.block_tables.gather(1, (at // ps).clamp(max=meta.block_tables.shape[1] - 1))
    slots = page.clamp_min(0) * ps + at % ps
    kept = (pos >= 0) & (page >= 0)
    if split:
        slots, kept = slots // split.ways, kept & (pos % split.ways == split.rank)
    keys = cache[slots.reshape(-1)].view(bs, 1, q_max - 1, w).to(q.dtype)
    # Query j sees strip key e iff e > q_j - window (padding queries, at -1, see what they see).
    seen = kept[:, None, :] & (pos[:, None, :] > meta.q_positions[:, :, None] - window)
    # One latent "K/V head" serves every query head: fold them into its query rows (head-major).
    folded = q.view(bs, q_max, heads, w).transpose(1, 2).reshape(bs, 1, heads * q_max, w)
    out, lse = block_attention(folded, keys, keys[..., :v_width], seen, heads, scale)
    out = out.view(bs, heads, q_max, v_width).transpose(1, 2).reshape(T, heads, v_width)
    return out, lse.view(bs, heads, q_max).transpose(1, 2).reshape(T, heads, 1)
