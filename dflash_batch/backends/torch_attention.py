"""Reference paged attention in plain PyTorch: the CPU path, and the oracle every faster path is
checked against.

Caches are flat [num_slots, kv_heads, head_dim]; slot = page_id * page_size + offset. A row
whose slot is -1 (padding) is written to the cache's last slot, which the engine keeps as
scratch (it never belongs to a page in use); so writes need no host sync and no data-dependent
shape, and the same code runs under a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_batch import parallel
from dflash_batch.backends.latent_split import LatentSplit, merge_across_ranks
from dflash_batch.backends.meta import AttnMeta


# Scores a forward may hold at once ([bs, heads, q_max, keys] elements): past it, attention runs
# over blocks of keys with an online softmax, so a 128k-token prefill holds a block's scores,
# not the whole context's (and reads the cache block by block).
SCORES_LIMIT = 1 << 24
# A block of keys goes through ATen's fused CPU flash-attention kernel where it exists (a private
# op of the pinned torch; it returns the log-sum-exp that merging blocks needs).
FUSED_CPU_BLOCKS = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
WHOLE = LatentSplit(1, 0)  # no split: the one rank keeps every position


@dataclass(frozen=True)
class Span:
    """The key positions a forward reads: key j of sequence b is at first[b] + j * ways (first
    None: rank + j * ways), j < count. `ways` > 1: a rank's share of a latent split."""

    first: torch.Tensor | None
    count: int
    window: int | None  # the window that chose `first` (None: the whole context)
    ways: int = 1
    rank: int = 0


def key_span(meta: AttnMeta, window: int | None, split: LatentSplit | None = None) -> Span:
    """The key positions a sliding (or full) layer of this forward reads (with `split`: those of
    them this rank keeps). With a window shorter than the context, each sequence reads the window
    + q_max - 1 positions that end at its last query (every key its queries may see: in every
    forward the engine runs, keys lie at or before the last query), so a sliding layer's cost,
    and a ring cache, stay in the window. Otherwise positions 0..max_kv for all."""
    split = split or WHOLE
    ways, rank = split.ways, split.rank
    count = None if window is None else window + meta.q_index.shape[1] - 1
    if count is None or count >= meta.max_kv:
        # A rank may keep none of a short context's positions: it reads one, masked.
        return Span(None, max(1, split.kept_below(meta.max_kv)), None, ways, rank)

    def first() -> torch.Tensor:
        return split.first_kept(meta.q_positions.amax(1) - (count - 1))
    return Span(meta.shared(("first_key", window), first), -(-count // ways), window, ways, rank)


def key_positions(span: Span, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """[bs | 1, stop - start]: positions of keys start..stop-1 of the span."""
    pos = torch.arange(start, stop, device=device)[None, :] * span.ways
    return pos + span.rank if span.first is None else span.first[:, None] + pos


def key_slots(meta: AttnMeta, span: Span, start: int, stop: int) -> torch.Tensor:
    """[bs, stop - start] cache row of keys start..stop-1 of the span of every sequence (page -1
    and positions before 0 read page 0: such keys are masked, a padding row's never used); the
    row this rank keeps a global slot in (LatentSplit)."""
    pos = key_positions(span, start, stop, meta.block_tables.device).clamp_min(0)
    pages = meta.block_tables.clamp_min(0).gather(1, (pos // meta.page_size).expand(meta.block_tables.shape[0], -1))
    return (pages * meta.page_size + pos % meta.page_size) // span.ways


def visible_mask(meta: AttnMeta, causal: bool, window: int | None, span: Span | None = None,
                 start: int = 0, stop: int | None = None) -> torch.Tensor:
    """[bs, q_max, keys] bool: which keys start..stop-1 of the span (default: all of the whole
    context) each query row may attend to."""
    span = span or Span(None, meta.max_kv, None)
    stop = span.count if stop is None else stop
    key_pos = key_positions(span, start, stop, meta.kv_lens.device)[:, None, :]
    q_pos = meta.q_positions[:, :, None]
    mask = (key_pos >= 0) & (key_pos < meta.kv_lens[:, None, None])
    if causal:
        mask = mask & (key_pos <= q_pos)
    if window is not None:
        mask = mask & (q_pos - key_pos < window)
        if not causal:
            mask = mask & (key_pos - q_pos < window)
    # Padding queries see the span's first key so their softmax stays finite; their output is
    # discarded.
    first_key = torch.arange(start, stop, device=mask.device) == 0
    return mask | first_key & (q_pos < 0)


def _folded_mask(meta: AttnMeta, causal: bool, window: int | None, group: int, dtype: torch.dtype,
                 span: Span) -> torch.Tensor:
    """The additive mask [bs, 1, group * q_max, span.count] of query rows folded as (group, query)."""
    mask = visible_mask(meta, causal, window, span)
    bs, q_max, keys = mask.shape
    mask = mask[:, None].expand(bs, group, q_max, keys).reshape(bs, 1, group * q_max, keys)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class TorchAttention:
    """`split`: the MLA latent caches are split across the ranks by token (latent_split.py)."""

    name = "torch"
    splits_rounds = True
    plans_on_host = False

    def __init__(self, split: LatentSplit | None = None):
        self.split = split

    def reads_rings(self, latent: bool) -> bool:
        return True

    def plan(self, meta: AttnMeta) -> None:
        """Nothing to prepare: masks and key slots are computed on first use in each forward."""

    def plan_round(self, batch, n: int, kv_lens: dict[str, list[int]], graph: bool,
                   widths: dict[str, int] | None = None) -> None:
        """Nothing to prepare (see plan)."""

    def write(self, cache: torch.Tensor, meta: AttnMeta, values: torch.Tensor) -> None:
        # Every cache one forward writes has the same slots (the engine allocates them together).
        # Under a split every cache written is a latent cache (build.py: MLA pairs only).
        scratch = cache.shape[0] - 1
        slots = meta.shared("write_slots", lambda: torch.where(meta.slots >= 0, meta.slots, scratch) if not self.split
                            else self.split.write_rows(meta.slots, scratch))
        cache.index_copy_(0, slots, values.to(cache.dtype))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
               scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        if self.split:
            raise ValueError("a latent split splits MLA latent caches; GQA layers' K/V split by head")

        def keys(span: Span, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (self._gather(k_cache, meta, span, start, stop).to(q.dtype),
                    self._gather(v_cache, meta, span, start, stop).to(q.dtype))
        return self._attend(q, keys, k_cache.shape[1], v_cache.shape[-1], meta, scale, causal, window,
                            key_span(meta, window))

    def attend_latent(self, q: torch.Tensor, cache: torch.Tensor, v_width: int, meta: AttnMeta,
                      scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        def keys(span: Span, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
            k = self._gather(cache, meta, span, start, stop).to(q.dtype)
            return k, k[..., :v_width]
        if not self.split:
            return self._attend(q, keys, cache.shape[1], v_width, meta, scale, causal, window, key_span(meta, window))
        # Every rank's heads over the keys this rank keeps, merged across ranks by log-sum-exp.
        out, lse = self._attend(parallel.all_gather_dim1(q), keys, cache.shape[1], v_width, meta, scale, causal,
                                window, key_span(meta, window, self.split), with_lse=True)
        return merge_across_ranks(out, lse).to(q.dtype)

    @staticmethod
    def _gather(cache: torch.Tensor, meta: AttnMeta, span: Span, start: int, stop: int) -> torch.Tensor:
        """[bs, stop - start, kv_heads, d]: the cache rows of keys start..stop-1 of the span (a
        view when each sequence owns its run of slots and the span starts at 0, else a copy)."""
        # A rank of a split keeps 1/ways of each sequence's run, its positions in order.
        bs, stride = meta.block_tables.shape[0], meta.block_tables.shape[1] * meta.page_size // span.ways
        if span.first is None and meta.rows_own_slots and bs * stride <= cache.shape[0]:
            return cache[:bs * stride].view(bs, stride, *cache.shape[1:])[:, start:stop]
        if (start, stop) == (0, span.count):  # every layer of the forward with this span reads them
            slots = meta.shared(("key_slots", span.window), lambda: key_slots(meta, span, 0, stop).reshape(-1))
        else:
            slots = key_slots(meta, span, start, stop).reshape(-1)
        return cache.index_select(0, slots).view(bs, stop - start, *cache.shape[1:])

    @staticmethod
    def _attend(q: torch.Tensor, keys: Callable[..., tuple[torch.Tensor, torch.Tensor]], kv_heads: int,
                dv: int, meta: AttnMeta, scale: float, causal: bool, window: int | None, span: Span,
                with_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`keys(span, start, stop)`: K and V [bs, stop - start, kv_heads, d | dv] of keys
        start..stop-1 of the span (key_span). `with_lse`: also the rows' natural log-sum-exps
        [T, heads] (-inf: a row that saw no key), the output then in at least float32. `window`
        masks keys (the span's own window is None where the span holds the whole context)."""
        T, heads, d = q.shape
        bs, q_max = meta.q_index.shape
        q = q.view(bs, q_max, heads, d) if meta.dense else torch.cat([q, q.new_zeros(1, heads, d)])[meta.q_index]
        group = heads // kv_heads
        # Each K/V head serves `group` query heads: fold them into its query rows, so one SDPA
        # head per K/V head reads each key once.
        q = q.view(bs, q_max, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(bs, kv_heads, group * q_max, d)
        block = max(meta.page_size, SCORES_LIMIT // (bs * heads * q_max))
        if block >= span.count and not with_lse:
            k, v = keys(span, 0, span.count)
            mask = meta.shared(("mask", causal, window, group, q.dtype),
                               lambda: _folded_mask(meta, causal, window, group, q.dtype, span))
            out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
        else:
            out, lse = _blocked(q, keys, meta, scale, causal, window, group, block, span)
            out = torch.cat([out.to(lse.dtype), lse], -1) if with_lse else out.to(q.dtype)  # unfolded as one
        width = out.shape[-1]
        out = out.view(bs, kv_heads, group, q_max, width).permute(0, 3, 1, 2, 4).reshape(bs * q_max, heads, width)
        if not meta.dense:
            result = out.new_empty(T + 1, heads, width)
            result[meta.q_index.reshape(-1)] = out
            out = result[:T]
        return (out[..., :dv], out[..., dv]) if with_lse else out


def _blocked(q: torch.Tensor, keys: Callable[..., tuple[torch.Tensor, torch.Tensor]], meta: AttnMeta,
             scale: float, causal: bool, window: int | None, group: int, block: int,
             span: Span) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of folded queries q [bs, kv_heads, group * q_max, d] over the keys `block` at a
    time: each block's softmax-weighted values and log-sum-exp, merged as they come: (out, lse
    [.., 1]), in at least float32. Memory in the block, not in the context."""
    bs, kv_heads, rows, _ = q.shape
    total = q.new_full((bs, kv_heads, rows, 1), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32))
    acc = None  # the attention over the blocks so far; `total` its log-sum-exp
    # Keys before every sequence's first query are visible to all of a causal forward's queries:
    # those blocks need no mask (in a long prefill chunk, all but the chunk's own few).
    seen_by_all = meta.min_start if causal and window is None and span.first is None else 0
    for start in range(0, span.count, block):
        stop = min(start + block, span.count)
        k, v = keys(span, start, stop)
        last = span.rank + (stop - 1) * span.ways  # the block's last key position (first None)
        visible = None if last < seen_by_all else visible_mask(meta, causal, window, span, start, stop)
        part, lse = block_attention(q, k.transpose(1, 2), v.transpose(1, 2), visible, group, scale)
        acc, total = (part, lse) if acc is None else merge_attention(acc, total, part, lse)
    return acc, total


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint sets of keys -> over their union: (out, log-sum-exp), in at
    least float32. The log-sum-exps (natural) broadcast against the outputs; a row that sees no
    key in either set keeps out 0 and log-sum-exp -inf."""
    wide = torch.promote_types(out_a.dtype, torch.float32)
    merged = torch.logaddexp(lse_a.to(wide), lse_b.to(wide))
    anchor = merged.masked_fill(merged == float("-inf"), 0.0)  # a row that saw no key yet
    out = out_a.to(wide) * (lse_a - anchor).exp() + out_b.to(wide) * (lse_b - anchor).exp()
    return out, merged


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                     group: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of folded queries q [bs, h, group * q_max, d] over k, v [bs, h, keys,
    d | dv] where `visible` [bs, q_max, keys] (None: everywhere): (out, log-sum-exp [bs, h, rows,
    1]); a row that sees no key gets log-sum-exp -inf (and out 0). The heads are unfolded (each
    K/V head repeated for its group: a block's keys are few) so one [q_max, keys] mask serves
    them all. On the CPU through ATen's fused flash kernel (~10x the unfused ops here), which
    wants one head width: V is zero-padded."""
    bs, kv_heads, rows, d = q.shape
    heads, q_max, dv = kv_heads * group, rows // group, v.shape[-1]
    q = q.view(bs, heads, q_max, d)
    k, v = (t[:, :, None].expand(-1, -1, group, -1, -1).reshape(bs, heads, t.shape[2], t.shape[3]) for t in (k, v))
    mask = sees = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))[:, None]
        sees = visible.any(-1, keepdim=True)[:, None]  # [bs, 1, q_max, 1]
    if FUSED_CPU_BLOCKS and q.device.type == "cpu":
        v = F.pad(v, (0, d - dv)) if dv < d else v
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                             scale=scale)
        out, lse = out[..., :dv], lse[..., None]
    else:
        wide = torch.promote_types(q.dtype, torch.float32)
        scores = (q.to(wide) @ k.transpose(-1, -2).to(wide)) * scale
        scores = scores if mask is None else scores + mask.to(wide)
        lse = torch.logsumexp(scores, -1, keepdim=True)
        out = (scores - lse).exp() @ v.to(wide)
    if sees is not None:
        out, lse = out.masked_fill(~sees, 0.0), lse.masked_fill(~sees, float("-inf"))
    return out.reshape(bs, kv_heads, rows, dv), lse.reshape(bs, kv_heads, rows, 1)


TORCH = TorchAttention()
