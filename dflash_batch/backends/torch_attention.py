"""Reference paged attention in plain PyTorch: the CPU path, and the oracle every faster path is
checked against.

Caches are flat [num_slots, kv_heads, head_dim]; slot = page_id * page_size + offset. A row
whose slot is -1 (padding) is written to the cache's last slot, which the engine keeps as
scratch (it never belongs to a page in use); so writes need no host sync and no data-dependent
shape, and the same code runs under a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash_batch.backends.meta import AttnMeta


# Scores a forward may hold at once ([bs, heads, q_max, keys] elements): past it, attention runs
# over blocks of keys with an online softmax, so a 128k-token prefill holds a block's scores,
# not the whole context's (and reads the cache block by block).
SCORES_LIMIT = 1 << 24


def key_slots(meta: AttnMeta, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """[bs, keys] cache slot of key positions start..stop-1 (default: all max_kv) of every
    sequence (page -1 reads page 0: a padding row's keys are never used)."""
    pos = torch.arange(start, meta.max_kv if stop is None else stop, device=meta.block_tables.device)
    pages = meta.block_tables.clamp_min(0)[:, pos // meta.page_size]
    return pages * meta.page_size + pos % meta.page_size


def visible_mask(meta: AttnMeta, causal: bool, window: int | None, start: int = 0,
                 stop: int | None = None) -> torch.Tensor:
    """[bs, q_max, keys] bool: which key positions start..stop-1 (default: all) each query row
    may attend to."""
    stop = meta.max_kv if stop is None else stop
    key_pos = torch.arange(start, stop, device=meta.kv_lens.device)[None, None, :]
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
        def keys(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (self._gather(k_cache, meta, start, stop).to(q.dtype),
                    self._gather(v_cache, meta, start, stop).to(q.dtype))
        return self._attend(q, keys, k_cache.shape[1], v_cache.shape[-1], meta, scale, causal, window)

    def attend_latent(self, q: torch.Tensor, cache: torch.Tensor, v_width: int, meta: AttnMeta,
                      scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        def keys(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
            k = self._gather(cache, meta, start, stop).to(q.dtype)
            return k, k[..., :v_width]
        return self._attend(q, keys, cache.shape[1], v_width, meta, scale, causal, window)

    @staticmethod
    def _gather(cache: torch.Tensor, meta: AttnMeta, start: int, stop: int) -> torch.Tensor:
        """[bs, stop - start, kv_heads, d]: the cache rows of key positions start..stop-1 (a view
        when each sequence owns its run of slots, else a copy)."""
        bs, stride = meta.block_tables.shape[0], meta.block_tables.shape[1] * meta.page_size
        if meta.rows_own_slots and bs * stride <= cache.shape[0]:
            return cache[:bs * stride].view(bs, stride, *cache.shape[1:])[:, start:stop]
        if (start, stop) == (0, meta.max_kv):
            slots = meta.shared("key_slots", lambda: key_slots(meta).reshape(-1))
        else:
            slots = key_slots(meta, start, stop).reshape(-1)
        return cache.index_select(0, slots).view(bs, stop - start, *cache.shape[1:])

    @staticmethod
    def _attend(q: torch.Tensor, keys: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], kv_heads: int,
                dv: int, meta: AttnMeta, scale: float, causal: bool, window: int | None) -> torch.Tensor:
        """`keys(start, stop)`: K and V [bs, stop - start, kv_heads, d | dv] of those key positions."""
        T, heads, d = q.shape
        bs, q_max = meta.q_index.shape
        q = q.view(bs, q_max, heads, d) if meta.dense else torch.cat([q, q.new_zeros(1, heads, d)])[meta.q_index]
        group = heads // kv_heads
        # Each K/V head serves `group` query heads: fold them into its query rows, so one SDPA
        # head per K/V head reads each key once.
        q = q.view(bs, q_max, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(bs, kv_heads, group * q_max, d)
        block = max(meta.page_size, SCORES_LIMIT // (bs * heads * q_max))
        if block >= meta.max_kv:
            k, v = keys(0, meta.max_kv)
            mask = meta.shared(("mask", causal, window, group, q.dtype),
                               lambda: _folded_mask(meta, causal, window, group, q.dtype))
            out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
        else:
            out = _blocked(q, keys, meta, scale, causal, window, group, block)
        out = out.view(bs, kv_heads, group, q_max, dv).permute(0, 3, 1, 2, 4).reshape(bs * q_max, heads, dv)
        if meta.dense:
            return out
        result = out.new_empty(T + 1, heads, dv)
        result[meta.q_index.reshape(-1)] = out
        return result[:T]


def _blocked(q: torch.Tensor, keys: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], meta: AttnMeta,
             scale: float, causal: bool, window: int | None, group: int, block: int) -> torch.Tensor:
    """Attention of folded queries q [bs, kv_heads, group * q_max, d] over the keys `block` at a
    time, merged by an online softmax (running max, denominator and weighted sum, in at least
    float32): memory in the block, not in the context."""
    wide = torch.promote_types(q.dtype, torch.float32)
    bs, kv_heads, rows, _ = q.shape
    best = q.new_full((bs, kv_heads, rows, 1), float("-inf"), dtype=wide)
    total = torch.zeros_like(best)
    acc = None
    for start in range(0, meta.max_kv, block):
        stop = min(start + block, meta.max_kv)
        k, v = keys(start, stop)
        visible = visible_mask(meta, causal, window, start, stop)  # [bs, q_max, keys]
        visible = visible[:, None, None].expand(bs, 1, group, -1, -1).reshape(bs, 1, rows, stop - start)
        scores = (q.to(wide) @ k.transpose(1, 2).transpose(-1, -2).to(wide)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
        anchor = new_best.masked_fill(new_best == float("-inf"), 0.0)  # a row that saw no key yet
        fade, p = (best - anchor).exp(), (scores - anchor).exp()
        part = p @ v.transpose(1, 2).to(wide)
        acc = part if acc is None else acc * fade + part
        total = total * fade + p.sum(-1, keepdim=True)
        best = new_best
    return (acc / total).to(q.dtype)
TORCH = TorchAttention()
