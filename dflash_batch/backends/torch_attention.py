"""Reference paged attention in plain PyTorch: the oracle every faster path is checked against.

Caches are flat [num_slots, kv_heads, head_dim]; slot = page_id * page_size + offset.
"""

from __future__ import annotations

import torch

from dflash_batch.engine.context import AttnMeta


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    cache.index_copy_(0, slots, values.to(cache.dtype))


def gather_keys(cache: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """[bs, max_kv, ...] cache rows of key positions 0..max_kv-1 of every sequence."""
    pos = torch.arange(meta.max_kv, device=cache.device)
    pages = meta.block_tables[:, pos // meta.page_size]
    slots = pages * meta.page_size + pos % meta.page_size
    return cache[slots]


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
    T, heads, _ = q.shape
    q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[meta.q_index]       # [bs, qm, H, d]
    k = gather_keys(k_cache, meta)                                             # [bs, K, Hkv, d]
    v = gather_keys(v_cache, meta)
    group = heads // k.shape[2]
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q_pad.float(), k.float()) * scale
    mask = visible_mask(meta, causal, window)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).to(q.dtype)
    result = q.new_zeros(T + 1, heads, v.shape[-1])
    result[meta.q_index.reshape(-1)] = out.reshape(-1, heads, v.shape[-1])
    return result[:T]
