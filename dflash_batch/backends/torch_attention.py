"""Reference paged attention in plain PyTorch: the oracle every faster path is checked against.

Caches are flat [num_slots, kv_heads, head_dim]; slot = page_id * page_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_batch.engine.context import AttnMeta


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    cache.index_copy_(0, slots, values.to(cache.dtype))


def key_slots(meta: AttnMeta) -> torch.Tensor:
    """[bs, max_kv] cache slot of key positions 0..max_kv-1 of every sequence."""
    pos = torch.arange(meta.max_kv, device=meta.block_tables.device)
    return meta.block_tables[:, pos // meta.page_size] * meta.page_size + pos % meta.page_size


def gather_keys(cache: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """[bs, max_kv, ...] cache rows of key positions 0..max_kv-1 of every sequence."""
    return cache[meta.shared("key_slots", lambda: key_slots(meta))]


def visible_mask(meta: AttnMeta, causal: bool, window: int | None) -> torch.Tensor:
    """[bs, q_max, max_kv] bool: which key positions each query row may attend to."""
    key_pos = torch.arange(meta.max_kv, device=meta.kv_lens.device)[None, None, :]
    q_pos = meta.q_positions[:, :, None]
    mask = key_pos < meta.kv_lens[:, None, None]
    if causal:
        mask = mask & (key_pos <= q_pos)
    if window is not None:
        mask = mask & (q_pos - key_pos < window)
        if not causal:
            mask = mask & (key_pos - q_pos < window)
    # Padding queries see key 0 so their softmax stays finite; their output is discarded.
    return mask | (key_pos == 0) & (q_pos < 0)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                    scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
    """q: [T, heads, d]; caches already hold this forward's K/V. Returns [T, heads, dv]."""
    T, heads, d = q.shape
    q_pad = torch.cat([q, q.new_zeros(1, heads, d)])[meta.q_index]             # [bs, qm, H, d]
    k = gather_keys(k_cache, meta).to(q.dtype)                                  # [bs, K, Hkv, d]
    v = gather_keys(v_cache, meta).to(q.dtype)
    mask = meta.shared(("mask", causal, window), lambda: visible_mask(meta, causal, window))
    out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=k.shape[2] != heads)        # [bs, H, qm, dv]
    out = out.transpose(1, 2).reshape(-1, heads, v.shape[-1])
    result = q.new_empty(T + 1, heads, v.shape[-1])
    result[meta.q_index.reshape(-1)] = out
    return result[:T]
