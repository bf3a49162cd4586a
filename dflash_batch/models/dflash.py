"""DFlash v1 and DFlash2 block drafters: Qwen3-style GQA layers, or DeepSeek-style MLA ones.

The target's tapped hidden states never run through the drafter's layers: `write_context` turns
them into extra K/V rows ("context") in every layer's cache, at the tokens' true positions. A
draft is then one forward over a block per sequence, [anchor, mask x (B-1)], which attends to the
context and to the whole block, and one greedy proposal from the block's last B-1 rows.

DFlash2 adds a grouped dynamic convolution around each sub-layer and a candidate selector that
re-ranks the head's top-k per position with a low-rank predecessor/successor bigram term, and
`attention_mode: "mla"` (the Kimi-K3 drafter): MLA attention over a per-slot latent cache.

A sliding layer reads only its window; given ring slots at allocation, it keeps only that much
too (backends/meta.py's Ring: each batch row's window and a block, reused in turn), so a long
context costs the drafter its full layers' caches and a constant for the sliding ones.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_batch import parallel
from dflash_batch.backends.meta import AttnMeta
from dflash_batch.models.layers.dtypes import wide
from dflash_batch.models.layers.linear import (
    ColumnParallelLinear, MergedColumnLinear, ReplicatedLinear, RowParallelLinear, new_param, per_rank,
)
from dflash_batch.models.layers.norm import RMSNorm
from dflash_batch.models.layers.rope import apply_rope, apply_rope_interleaved, rope_from_config, yarn_softmax_mscale
from dflash_batch.models.qwen3 import Qwen3MLP


def draft_value(config: dict, key: str, default=None):
    """`dflash_config.<key>` first, then the top-level key (the rule the reference and TokenSpeed share)."""
    section = config.get("dflash_config") or {}
    return section[key] if key in section else config.get(key, default)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default taps: evenly spread over target layers 1 .. L-3 (rounded half-even,
    as Python's round does, so the ids match checkpoints trained with that default)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    step = (last - first) / (num_draft_layers - 1)
    return [round(first + i * step) for i in range(num_draft_layers)]


class CacheLayer(nn.Module):
    """An attention whose cache is indexed by the engine's slots, or (sliding layers given ring
    slots) by its ring."""

    window: int | None
    ring = False

    def cache_slots(self, num_slots: int, ring_slots: int | None) -> int:
        """How many slots this layer's cache holds (and remember whether it is a ring)."""
        self.ring = ring_slots is not None and self.window is not None
        return ring_slots if self.ring else num_slots

    def cache_meta(self, meta: AttnMeta) -> AttnMeta:
        return meta.ring_view() if self.ring else meta


def block_mask(config: dict, layer_idx: int) -> tuple[int | None, bool]:
    """(sliding window or None, causal) of a draft layer's attention."""
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    sliding = layer_types[layer_idx] == "sliding_attention"
    # TokenSpeed: the block is non-causal in every layer unless the config says otherwise.
    # (The z-lab reference instead makes sliding layers causal when `is_causal` is unset.)
    return (config.get("sliding_window") if sliding else None), bool(config.get("is_causal") or False)


class DFlashAttention(CacheLayer):
    """Qwen3-style GQA: per-head q/k RMSNorm, rotate-half RoPE, K and V caches. k|v are one
    matmul (context rows need only them), q another."""

    def __init__(self, config: dict, layer_idx: int):
        super().__init__()
        hidden = config["hidden_size"]
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // heads
        self.rope_dim = self.head_dim
        bias = bool(config.get("attention_bias", False))
        self.q_proj = ColumnParallelLinear(hidden, heads * self.head_dim, bias)
        self.kv_proj = MergedColumnLinear(hidden, {"k_proj": kv_heads * self.head_dim,
                                                   "v_proj": kv_heads * self.head_dim}, bias)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias)
        self.q_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
        self.num_heads = self.q_proj.weight.shape[0] // self.head_dim
        self.num_kv_heads = self.kv_proj.sizes[0] // self.head_dim
        self.scale = self.head_dim ** -0.5
        self.window, self.causal = block_mask(config, layer_idx)
        # Runtime state, not checkpoint: plain attributes filled by allocate().
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str,
                 ring_slots: int | None = None, latent_split: int = 1) -> int:
        if latent_split != 1:
            raise ValueError("GQA caches split by head, not by token (a latent split is for MLA drafters)")
        shape = (self.cache_slots(num_slots, ring_slots), self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        return 2 * self.k_cache.nbytes

    def write_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> None:
        """Context rows and block rows get their K/V the same way: k_norm, then RoPE at their position."""
        self._write(x, cos, sin, self.cache_meta(meta))

    def _write(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> None:
        T = x.shape[0]
        k, v = self.kv_proj(x).view(T, 2 * self.num_kv_heads, self.head_dim).chunk(2, dim=1)
        meta.backend.write(self.k_cache, meta, apply_rope(self.k_norm(k), cos, sin))
        meta.backend.write(self.v_cache, meta, v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        T = x.shape[0]
        meta = self.cache_meta(meta)
        self._write(x, cos, sin, meta)
        q = apply_rope(self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim)), cos, sin)
        o = meta.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, self.causal, self.window)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class DFlashMLAAttention(CacheLayer):
    """DeepSeek-V3-style MLA with interleaved RoPE on a dr-wide slice and no output gate,
    attended in the absorbed form.

    The cache holds one latent row per slot, [kv_a_layernorm(c_kv) | rope(k_pe)] (kl + dr wide),
    shared by all heads and so replicated on every TP rank (or split by token across them:
    backends/latent_split.py). Rather than expanding it to per-head
    K/V, each head's query is mapped into the latent space (q_nope @ w_kc) and the attention
    output back out of it (o_lat @ w_vc^T), with w_kc, w_vc the K and V rows of kv_b_proj.
    """

    def __init__(self, config: dict, layer_idx: int):
        super().__init__()
        hidden, eps, heads = config["hidden_size"], config["rms_norm_eps"], config["num_attention_heads"]
        if config.get("q_lora_rank") is None:
            raise NotImplementedError("MLA drafters without q_lora_rank (a plain q_proj) are not supported")
        q_lora, self.kl = config["q_lora_rank"], config["kv_lora_rank"]
        self.dn, self.dr, self.dv = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        self.rope_dim = self.dr
        self.num_heads = per_rank(heads, "num_attention_heads")
        self.q_a_proj = ReplicatedLinear(hidden, q_lora)
        self.q_a_layernorm = RMSNorm(q_lora, eps)
        self.q_b_proj = ColumnParallelLinear(q_lora, heads * (self.dn + self.dr))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kl + self.dr)
        self.kv_a_layernorm = RMSNorm(self.kl, eps)
        self.kv_b_proj = ColumnParallelLinear(self.kl, heads * (self.dn + self.dv))
        self.o_proj = RowParallelLinear(heads * self.dv, hidden)
        self.scale = (self.dn + self.dr) ** -0.5 * yarn_softmax_mscale(config) ** 2
        self.window, self.causal = block_mask(config, layer_idx)
        self.cache: torch.Tensor | None = None  # [slots, 1, kl + dr], filled by allocate()

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str,
                 ring_slots: int | None = None, latent_split: int = 1) -> int:
        """`latent_split`: this rank keeps 1/latent_split of the slots (backends/latent_split.py)."""
        self.cache = torch.zeros(self.cache_slots(num_slots, ring_slots) // latent_split, 1, self.kl + self.dr,
                                 dtype=dtype, device=device)
        return self.cache.nbytes

    def write_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> None:
        """Context rows and block rows get their latent row the same way."""
        self._write(x, cos, sin, self.cache_meta(meta))

    def _write(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> None:
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kl, self.dr], dim=-1)
        k_pe = apply_rope_interleaved(k_pe[:, None], cos, sin)
        meta.backend.write(self.cache, meta, torch.cat([self.kv_a_layernorm(c)[:, None], k_pe], dim=-1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        T = x.shape[0]
        meta = self.cache_meta(meta)
        self._write(x, cos, sin, meta)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(T, self.num_heads, self.dn + self.dr)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        # kv_b_proj holds, per head, dn rows that expand the latent to K_nope and dv rows to V.
        w_kc, w_vc = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.kl).split([self.dn, self.dv], 1)
        q_lat = torch.einsum("thd,hdk->thk", q_nope, w_kc)
        # One "kv head" for all query heads: keys are whole latent rows, values their c part.
        o_lat = meta.backend.attend_latent(torch.cat([q_lat, apply_rope_interleaved(q_pe, cos, sin)], dim=-1),
                                             self.cache, self.kl, meta, self.scale, self.causal, self.window)
        o = torch.einsum("thk,hvk->thv", o_lat, w_vc)
        return self.o_proj(o.reshape(T, self.num_heads * self.dv))


def grouped_block_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """out[t] = sum_i (base[i] + dynamic[t, i, group]) * x[t - i], over taps i <= t mod block_size.

    x [N, D] holds whole blocks of `block_size` rows; dynamic [N, taps, groups]; base [taps, D].
    Taps stop at the block start: the anchor row sees only itself, whatever precedes it in x.
    """
    N, D = x.shape
    taps, groups = dynamic.shape[1], dynamic.shape[2]
    blocks = x.view(N // block_size, block_size, groups, D // groups)
    dynamic = dynamic.view(N // block_size, block_size, taps, groups, 1)
    out = torch.zeros_like(blocks)
    for i in range(taps):
        shifted = blocks if i == 0 else torch.cat([torch.zeros_like(blocks[:, :i]), blocks[:, :-i]], dim=1)
        out = out + (base[i].view(groups, D // groups) + dynamic[:, :, i]) * shifted
    return out.view(N, D)


class GroupedDynamicConv(nn.Module):
    """DFlash2's conv around a sub-layer. One projection of the sub-layer's normed input predicts
    two per-group dynamic kernels: the first filters that input, the second the sub-layer output."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden % group_size:
            raise ValueError(f"hidden_size={hidden} is not divisible by conv_group_size={group_size}")
        self.kernel_size = kernel_size
        self.groups = hidden // group_size
        self.base_kernel = new_param((2, kernel_size, hidden), None)
        self.kernel_projection = ReplicatedLinear(hidden, 2 * kernel_size * self.groups)

    def prepare(self, h: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(h).view(h.shape[0], 2, self.kernel_size, self.groups)
        return grouped_block_conv(h, dynamic[:, 0], self.base_kernel[0], block_size), dynamic[:, 1]

    def finish(self, h: torch.Tensor, dynamic: torch.Tensor, block_size: int) -> torch.Tensor:
        return grouped_block_conv(h, dynamic, self.base_kernel[1], block_size)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_idx: int, attention: type[nn.Module], conv: tuple[int, int] | None):
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.self_attn = attention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        # conv = (kernel_size, group_size) for DFlash2; v1 layers have none.
        self.attention_conv = GroupedDynamicConv(hidden, *conv) if conv else None
        self.mlp_conv = GroupedDynamicConv(hidden, *conv) if conv else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta,
                block_size: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            h = self.self_attn(h, cos, sin, meta)
        else:
            h, dynamic = self.attention_conv.prepare(h, block_size)
            h = self.attention_conv.finish(self.self_attn(h, cos, sin, meta), dynamic, block_size)
        x = x + h
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is None:
            h = self.mlp(h)
        else:
            h, dynamic = self.mlp_conv.prepare(h, block_size)
            h = self.mlp_conv.finish(self.mlp(h), dynamic, block_size)
        return x + h


class DFlashDrafter(nn.Module):
    """DFlash v1: proposal = argmax of the target's head on the block's rows 1..B-1."""

    conv_layers = False  # DFlash2 wraps every sub-layer in a GroupedDynamicConv

    def __init__(self, config: dict):
        super().__init__()
        mode = draft_value(config, "attention_mode", "gqa")
        attention = {"gqa": DFlashAttention, "mla": DFlashMLAAttention}.get(mode)
        if attention is None:
            raise ValueError(f"unknown dflash attention_mode {mode!r}")
        self.latent = mode == "mla"  # its attention reads a latent cache (MLA)
        if config.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act={config['hidden_act']!r} is not supported")
        self.mask_token_id: int = draft_value(config, "mask_token_id")
        if self.mask_token_id is None:
            raise ValueError("drafter config has no dflash_config.mask_token_id")
        self.config = config
        self.block_size = int(draft_value(config, "block_size", 16))
        layer_ids = draft_value(config, "target_layer_ids")
        if layer_ids is None:
            layer_ids = build_target_layer_ids(config["num_target_layers"], config["num_hidden_layers"])
        self.target_layer_ids: list[int] = list(layer_ids)
        self.input_embedding_scale = float(draft_value(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(draft_value(config, "output_multiplier", 1.0))
        self.softcap = float(draft_value(config, "final_logit_softcapping") or 0.0)

        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        conv = None
        if self.conv_layers:
            conv = (int(draft_value(config, "conv_kernel_size")), int(draft_value(config, "conv_group_size")))
        self.fc = ReplicatedLinear(len(self.target_layer_ids) * hidden, hidden)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i, attention, conv) for i in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(hidden, eps)
        self.rotary_emb = rope_from_config(config, self.layers[0].self_attn.rope_dim)
        # The target's embedding and head, held in a tuple so nn.Module does not register them:
        # they are not the drafter's parameters and the loader must not expect them.
        self._target_io: tuple[nn.Module, nn.Module] | None = None

    def checkpoint_name(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        # The drafter borrows the target's embedding; a copy in its checkpoint is redundant.
        if name == "embed_tokens.weight" or name.endswith("rotary_emb.inv_freq"):
            return None
        return name

    def bind_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self._target_io = (embed_tokens, lm_head)

    def allocate_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device | str,
                       ring_slots: int | None = None, latent_split: int = 1) -> int:
        """Every layer's cache of `num_slots` slots (context and block rows), the sliding layers'
        of `ring_slots` (rings) when given; returns their bytes."""
        return sum(layer.self_attn.allocate(num_slots, dtype, device, ring_slots, latent_split)
                   for layer in self.layers)

    def ring_pages(self, block: int, page_size: int) -> int | None:
        """Pages per batch row a sliding layer's ring needs: its window and a block of `block`
        rows (a draft's first query sees `window - 1` positions back, its last block row is
        written at once). None: no sliding layers."""
        return None if self.window is None else -(-(self.window + block - 1) // page_size)

    @property
    def window(self) -> int | None:
        """The longest sliding window of its layers (None: none slides)."""
        return max((w for w in (layer.self_attn.window for layer in self.layers) if w is not None), default=None)

    def write_context(self, taps: torch.Tensor, meta: AttnMeta) -> None:
        """taps [T, n_taps*hidden] of rows the target ran -> context K/V (or MLA latent rows) at
        meta.slots in every layer. The context skips the layers' input_layernorm: hidden_norm
        has normed it already."""
        ctx = self.hidden_norm(self.fc(taps))
        cos, sin = self.rotary_emb(meta.positions)
        for layer in self.layers:
            layer.self_attn.write_kv(ctx, cos, sin, meta)

    def forward(self, block_ids: torch.Tensor, meta: AttnMeta, block_size: int | None = None) -> torch.Tensor:
        """block_ids [bs*B]: contiguous blocks [anchor, mask...] -> final-normed hidden [bs*B, hidden].
        B is the drafter's trained block size unless the caller verifies a different width."""
        block_size = block_size or self.block_size
        x = self._target_io[0](block_ids) * self.input_embedding_scale
        cos, sin = self.rotary_emb(meta.positions)
        for layer in self.layers:
            x = layer(x, cos, sin, meta, block_size)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """The target's head on the drafter's rows; `gather` False: this rank's vocabulary slice
        (the proposals read only each row's top few: parallel.sharded_*)."""
        logits = wide(self._target_io[1](hidden, gather)) * self.output_multiplier
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [bs, B, hidden] -> this rank's vocabulary slice of the logits [bs, B-1, V / ranks]
        of the block's draft rows (as one 2-D matmul: the strided 3-D view would go through a
        batched one, 2.5x slower on CPU)."""
        rows = hidden[:, 1:].reshape(-1, hidden.shape[-1])
        return self.compute_logits(rows, gather=False).view(hidden.shape[0], hidden.shape[1] - 1, -1)

    def propose(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """hidden [bs, B, hidden], anchor [bs] -> greedy drafts [bs, B-1] (row 0 is the anchor's own).
        v1 drafts each row independently; the anchor matters only to DFlash2's selector."""
        return self.pick(hidden, self.draft_logits(hidden), anchor)

    def propose_scored(self, hidden: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """propose, and the drafter's own probability of each draft [bs, B-1] (its softmax at that
        position: what engine/row_drafts.py calibrates into a chance of acceptance)."""
        logits = self.draft_logits(hidden)
        drafts = self.pick(hidden, logits, anchor)
        return drafts, parallel.sharded_prob(logits, drafts)

    def pick(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The drafts from the block's draft logits (this rank's vocabulary slice): each row's best."""
        return parallel.sharded_argmax(logits)


class CandidateSelector(nn.Module):
    """Scores candidate c after predecessor p at draft position l as
    unary[l, c] + sum_r P[p, r] * proj(h_l)[r] * S[c, r]; the greedy walk follows the best path."""

    def __init__(self, config: dict):
        super().__init__()
        rank = int(draft_value(config, "selector_rank"))
        self.top_k = int(draft_value(config, "selector_top_k"))
        self.predecessor_codebook = new_param((config["vocab_size"], rank), None)
        self.successor_codebook = new_param((config["vocab_size"], rank), None)
        self.hidden_projection = ReplicatedLinear(config["hidden_size"], rank)

    def greedy_path(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """hidden [bs, L, D], logits [bs, L, V / ranks] (this rank's vocabulary slice), anchor [bs]
        -> tokens [bs, L]."""
        unary, candidates = parallel.sharded_topk(logits, self.top_k)              # [bs, L, K]
        # Fold the hidden projection into the successor side once: pair[l, c] = proj(h_l) * S[c].
        succ = self.hidden_projection(hidden)[:, :, None, :] * self.successor_codebook[candidates]
        prev, path = anchor, []
        for pos in range(candidates.shape[1]):
            scores = unary[:, pos] + torch.einsum("br,bkr->bk", self.predecessor_codebook[prev], succ[:, pos])
            prev = candidates[:, pos].gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1)


class DFlash2Drafter(DFlashDrafter):
    """DFlash2: conv-wrapped layers and a candidate-selector proposal."""

    conv_layers = True

    def __init__(self, config: dict):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        # The codebooks are bare parameters (TokenSpeed's layout); z-lab's save_pretrained writes
        # them as nn.Embedding weights with a `.weight` suffix.
        for book in ("predecessor_codebook", "successor_codebook"):
            if name == f"candidate_selector.{book}.weight":
                return f"candidate_selector.{book}"
        return name

    def pick(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return self.candidate_selector.greedy_path(hidden[:, 1:], logits, anchor)
