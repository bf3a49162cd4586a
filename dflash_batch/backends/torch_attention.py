"""Reference paged attention in plain PyTorch: the CPU path, and the oracle every faster path is
checked against.

Caches are flat [num_slots, kv_heads, head_dim]; slot = page_id * page_size + offset. A row
whose slot is -1 (padding) is written to the cache's last slot, which the engine keeps as
scratch (it never belongs to a page in use); so writes need no host sync and no data-dependent
shape, and the same code runs under a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_batch.backends.meta import AttnMeta


def key_slots(meta: AttnMeta) -> torch.Tensor:
    """[bs, max_kv] cache slot of key positions 0..max_kv-1 of every sequence (page -1 reads
    page 0: a padding row's keys are never used)."""
    pos = torch.arange(meta.max_kv, device=meta.block_tables.device)
    pages = meta.block_tables.clamp_min(0)[:, pos // meta.page_size]
    return pages * meta.page_size + pos % meta.page_size


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


def _folded_mask(meta: AttnMeta, causal: bool, window: int | None, group: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [bs, 1, group * q_max, max_kv] of query rows folded as (group, query)."""
    mask = visible_mask(meta, causal, window)
    bs, q_max, keys = mask.shape
    mask = mask[:, None].expand(bs, group, q_max, keys).reshape(bs, 1, group * q_max, keys)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class TorchAttention:
    name = "torch"

    def plan(self, meta: AttnMeta) -> None:
        """Nothing to prepare: masks and key slots are computed on first use in each forward."""

    def plan_round(self, batch, n: int, kv_lens: dict[str, list[int]], graph: bool) -> None:
        """Nothing to prepare (see plan)."""

    def write(self, cache: torch.Tensor, meta: AttnMeta, values: torch.Tensor) -> None:
        # Every cache one forward writes has the same slots (the engine allocates them together).
        slots = meta.shared("write_slots", lambda: torch.where(meta.slots >= 0, meta.slots, cache.shape[0] - 1))
        cache.index_copy_(0, slots, values.to(cache.dtype))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
               scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        k, v = self._gather(k_cache, meta), self._gather(v_cache, meta)
        return self._attend(q, k.to(q.dtype), v.to(q.dtype), meta, scale, causal, window)

    def attend_latent(self, q: torch.Tensor, cache: torch.Tensor, v_width: int, meta: AttnMeta,
                      scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        k = self._gather(cache, meta).to(q.dtype)
        return self._attend(q, k, k[..., :v_width], meta, scale, causal, window)

    @staticmethod
    def _gather(cache: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """[bs, max_kv, kv_heads, d]: the cache rows of key positions 0..max_kv-1 (a view when
        each sequence owns its run of slots, else a copy)."""
        bs, stride = meta.block_tables.shape[0], meta.block_tables.shape[1] * meta.page_size
        if meta.rows_own_slots and bs * stride <= cache.shape[0]:
            return cache[:bs * stride].view(bs, stride, *cache.shape[1:])[:, :meta.max_kv]
        slots = meta.shared("key_slots", lambda: key_slots(meta).reshape(-1))
        return cache.index_select(0, slots).view(bs, meta.max_kv, *cache.shape[1:])

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, scale: float,
                causal: bool, window: int | None) -> torch.Tensor:
        T, heads, d = q.shape
        bs, q_max = meta.q_index.shape
        kv_heads, dv = k.shape[2], v.shape[-1]
        group = heads // kv_heads
        q = q.view(bs, q_max, heads, d) if meta.dense else torch.cat([q, q.new_zeros(1, heads, d)])[meta.q_index]
        # Each K/V head serves `group` query heads: fold them into its query rows, so one SDPA
        # head per K/V head reads each key once.
        q = q.view(bs, q_max, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(bs, kv_heads, group * q_max, d)
        mask = meta.shared(("mask", causal, window, group, q.dtype),
                           lambda: _folded_mask(meta, causal, window, group, q.dtype))
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
        out = out.view(bs, kv_heads, group, q_max, dv).permute(0, 3, 1, 2, 4).reshape(bs * q_max, heads, dv)
        if meta.dense:
            return out
        result = out.new_empty(T + 1, heads, dv)
        result[meta.q_index.reshape(-1)] = out
        return result[:T]


TORCH = TorchAttention()
