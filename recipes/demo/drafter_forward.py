"""A differentiable DFlash2-MLA forward over many blocks at once, on `DFlash2Drafter`'s parameters.

At inference the drafter writes the target's taps as context rows into a paged latent cache and
runs one block [anchor, mask x (B-1)] per sequence. Training runs every sampled block of a
sequence in one pass instead: keys are [context rows 0..S-1 | all blocks' rows] and a dense mask
gives each block exactly what it would see at inference:
- context rows at positions strictly before its anchor (the anchor itself has no taps yet: it is
  the token the target has just chosen), within the layer's sliding window;
- its own block's rows, bidirectionally (within the window too, as at inference);
- never another block.
Positions are absolute (block k of anchor a sits at a + k), rotated with the drafter's YaRN RoPE.
MLA is computed in the expanded form (kv_b_proj -> per-head K_nope / V), equal to the inference
model's absorbed form. Convs, norms and MLPs are the inference modules' own code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_batch.models.dflash import DFlash2Drafter, DFlashMLAAttention
from dflash_batch.models.layers.rope import apply_rope_interleaved


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
    """x [B, N, heads, dr] at positions [B, N] -> rotated (interleaved pairs, with YaRN's scale)."""
    B, N = positions.shape
    cos, sin = rotary(positions.reshape(-1))
    return apply_rope_interleaved(x.reshape(B * N, *x.shape[2:]), cos, sin).view(x.shape)


def block_mask(anchors: torch.Tensor, context_len: int, block: int, window: int | None) -> torch.Tensor:
    """[B, n*block, S + n*block] bool: which keys each block row sees (see the module doc)."""
    B, n = anchors.shape
    q_pos = (anchors[..., None] + torch.arange(block)).reshape(B, n * block)          # [B, N]
    anchor = anchors.repeat_interleave(block, dim=1)                                  # [B, N]
    ctx_pos = torch.arange(context_len)
    ctx = ctx_pos[None, None, :] < anchor[..., None]
    if window is not None:
        ctx = ctx & (q_pos[..., None] - ctx_pos[None, None, :] < window)
    rows = torch.arange(n * block)
    same = (rows[:, None] // block) == (rows[None, :] // block)
    if window is not None:
        same = same & ((rows[:, None] - rows[None, :]).abs() < window)
    return torch.cat([ctx, same[None].expand(B, -1, -1)], dim=-1)


def mla_attention(attn: DFlashMLAAttention, h: torch.Tensor, ctx: torch.Tensor, block_pos: torch.Tensor,
                  rotary, mask: torch.Tensor) -> torch.Tensor:
    """h [B, N, D] block rows (after the conv), ctx [B, S, D] context rows -> [B, N, D]."""
    B, N, _ = h.shape
    S = ctx.shape[1]
    heads, dn, dr, dv, kl = attn.num_heads, attn.dn, attn.dr, attn.dv, attn.kl
    # Context and block rows make their latent rows the same way (DFlashMLAAttention.write_kv).
    rows = torch.cat([ctx, h], dim=1)
    positions = torch.cat([torch.arange(S).expand(B, S), block_pos], dim=1)
    c, k_pe = attn.kv_a_proj_with_mqa(rows).split([kl, dr], dim=-1)
    k_pe = _rope(k_pe[:, :, None], positions, rotary)                              # [B, S+N, 1, dr]
    kv = attn.kv_b_proj(attn.kv_a_layernorm(c)).view(B, S + N, heads, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe.expand(B, S + N, heads, dr)], dim=-1)
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h))).view(B, N, heads, dn + dr)
    q = torch.cat([q[..., :dn], _rope(q[..., dn:], block_pos, rotary)], dim=-1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., dn:].transpose(1, 2),
                                       attn_mask=mask[:, None], scale=attn.scale).transpose(1, 2)
    return attn.o_proj(o.reshape(B, N, heads * dv))


def forward(drafter: DFlash2Drafter, embed_weight: torch.Tensor, taps: torch.Tensor, block_ids: torch.Tensor,
            anchors: torch.Tensor) -> torch.Tensor:
    """taps [B, S, n_taps*D] (the target's, every position), block_ids [B, n, block] ([anchor token,
    mask...] each), anchors [B, n] (the anchors' positions) -> final-normed hidden [B, n, block, D]."""
    B, n, block = block_ids.shape
    D = embed_weight.shape[1]
    ctx = drafter.hidden_norm(drafter.fc(taps))
    x = F.embedding(block_ids.reshape(B, n * block), embed_weight) * drafter.input_embedding_scale
    block_pos = (anchors[..., None] + torch.arange(block)).reshape(B, n * block)
    masks = {}
    for layer in drafter.layers:
        attn = layer.self_attn
        if attn.window not in masks:
            masks[attn.window] = block_mask(anchors, taps.shape[1], block, attn.window)
        h, dynamic = layer.attention_conv.prepare(layer.input_layernorm(x).reshape(-1, D), block)
        a = mla_attention(attn, h.view(B, n * block, D), ctx, block_pos, drafter.rotary_emb, masks[attn.window])
        x = x + layer.attention_conv.finish(a.reshape(-1, D), dynamic, block).view(B, n * block, D)
        h, dynamic = layer.mlp_conv.prepare(layer.post_attention_layernorm(x).reshape(-1, D), block)
        x = x + layer.mlp_conv.finish(layer.mlp(h), dynamic, block).view(B, n * block, D)
    return drafter.norm(x).view(B, n, block, D)


def selector_scores(drafter: DFlash2Drafter, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                    predecessor: torch.Tensor) -> torch.Tensor:
    """The candidate selector's score of each of the top-k candidates after a given predecessor
    (`CandidateSelector.greedy_path`'s formula): hidden [M, D], unary/candidates [M, K],
    predecessor [M] -> [M, K]."""
    sel = drafter.candidate_selector
    pair = sel.predecessor_codebook[predecessor] * sel.hidden_projection(hidden)        # [M, r]
    return unary + (pair[:, None, :] * sel.successor_codebook[candidates]).sum(-1)
