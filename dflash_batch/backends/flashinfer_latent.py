"""What flashinfer's MLA wrapper cannot do for a sliding-window layer, done beside it in torch.

flashinfer's BatchMLAPagedAttentionWrapper has no window. A non-causal sliding layer's block of
B queries (the drafter's) sees, for query j at position q_j, the keys less than `window` away on
either side, up to the block's end `kv_len`; with a window of at least B, the right-hand bound
never bites. Every query of the block then sees the last query's window [kv_len - window,
kv_len): the wrapper attends over that, listed slot by slot (page size 1). Query j also sees the
"edge strip" of the B - 1 positions just before it, those above q_j - window: attended here,
masked per query, and merged with the wrapper's part by their log-sum-exps (TokenSpeed's drafter
kernel takes the window itself; this keeps to flashinfer).
Device tensors only, no host read: it runs inside captured rounds.
"""

from __future__ import annotations

import torch

from dflash_batch.backends.meta import AttnMeta


def edge_strip(q: torch.Tensor, cache: torch.Tensor, v_width: int, meta: AttnMeta, scale: float,
               window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, w] of a dense forward over a latent cache [slots, 1, w] -> (out [T, heads,
    v_width] float32, natural log-sum-exp [T, heads]; -inf where a query sees no strip key)."""
    bs, q_max = meta.q_index.shape
    T, heads, w = q.shape
    ps = meta.page_size
    low = (meta.kv_lens - window).clamp_min(0)                                     # [bs]
    pos = low[:, None] - torch.arange(q_max - 1, 0, -1, device=q.device)           # [bs, B-1]
    at = pos.clamp_min(0)
    page = meta.block_tables.gather(1, (at // ps).clamp(max=meta.block_tables.shape[1] - 1))
    keys = cache[(page.clamp_min(0) * ps + at % ps).reshape(-1), 0].view(bs, q_max - 1, w).float()
    seen = (pos >= 0) & (page >= 0)
    # Query j sees strip key e iff e > q_j - window (padding queries, at -1, see what they see).
    seen = seen[:, None, :] & (pos[:, None, :] > meta.q_positions[:, :, None] - window)   # [bs, B, B-1]
    scores = torch.einsum("bqhw,bkw->bqhk", q.view(bs, q_max, heads, w).float(), keys) * scale
    scores = scores.masked_fill(~seen[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                          # [bs, B, heads]
    weights = torch.where(seen[:, :, None, :], torch.exp(scores - lse[..., None]), 0.0)
    out = torch.einsum("bqhk,bkv->bqhv", weights, keys[..., :v_width])
    return out.reshape(T, heads, v_width), lse.reshape(T, heads)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets -> over their union (natural log-sum-exps; part a
    sees at least one key, part b may see none: lse -inf)."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return (out_a.float() * wa + out_b.float() * wb) / (wa + wb)
