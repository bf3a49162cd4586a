"""A differentiable full-sequence forward of `KimiK3ForConditionalGeneration`'s parameters.

The inference model keeps paged MLA caches and KDA state pools and runs its prefill one sequence
at a time; training wants [batch, time] tensors and autograd. This forward takes the SAME module
(so its state_dict is the checkpoint) and replaces only the two attention kinds:
- gated NoPE-MLA in the expanded form: kv_b_proj turns each latent row into per-head K_nope / V,
  plain causal SDPA (equal to the inference model's absorbed attention over the latent cache);
- KDA from a zero state over the whole sequence (kda_train.py: the product's math, recast to be
  fast under autograd).
Everything else (AttnRes mixes, norms, the latent MoE, SiTU MLPs, the head) is the inference
model's own module code. Sequences are right-padded: attention is causal and KDA recurrent, so
padding never changes a real position's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_batch.models.kimi_k3 import KDA, GatedMLA, KimiK3ForConditionalGeneration, attn_res_mix
from dflash_batch.models.layers.kda import kda_gate, l2norm
from dflash_batch.models.layers.norm import rms_norm
from recipes.demo.kda_train import kda_zero_state, short_conv_silu


def mla(attn: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] -> [B, T, H]. The "rope" dims of K are the raw k_pe (NoPE), shared by heads."""
    B, T, _ = x.shape
    h, dn, dr, dv, kl = attn.heads, attn.dn, attn.dr, attn.dv, attn.kl
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(B, T, h, dn + dr)
    latent = attn.kv_a_proj_with_mqa(x)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent[..., :kl])).view(B, T, h, dn + dv)
    k = torch.cat([kv[..., :dn], latent[..., None, kl:].expand(B, T, h, dr)], dim=-1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., dn:].transpose(1, 2),
                                       is_causal=True, scale=attn.scale).transpose(1, 2)
    o = o * torch.sigmoid(attn.g_proj(x).float()).view(B, T, h, dv).to(o.dtype)
    return attn.o_proj(o.reshape(B, T, h * dv))


def kda(attn: KDA, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] -> [B, T, H], every sequence from a zero conv window and a zero state."""
    B, T, _ = x.shape
    H, d = attn.heads, attn.d
    raw = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    weight = torch.cat([attn.q_conv1d.weight, attn.k_conv1d.weight, attn.v_conv1d.weight])[:, 0]
    mixed = short_conv_silu(raw, weight)
    q, k, v = (t.reshape(B, T, H, d) for t in mixed.split(H * d, dim=-1))
    g = kda_gate(attn.f_b_proj(attn.f_a_proj(x)).view(B, T, H, d), attn.A_log, attn.dt_bias, attn.lower_bound)
    beta = torch.sigmoid(attn.b_proj(x).float())
    o = kda_zero_state(l2norm(q), l2norm(k), v, g, beta)
    o = rms_norm(o, attn.o_norm.weight.float(), attn.o_norm.eps)
    o = o * torch.sigmoid(attn.g_proj(x).float()).view(B, T, H, d)
    return attn.o_proj(o.reshape(B, T, H * d).to(x.dtype))


def ffn(layer, h: torch.Tensor) -> torch.Tensor:
    """The layer's dense MLP or latent MoE (module code), over the flattened tokens."""
    module = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
    return module(h.reshape(-1, h.shape[-1])).view(h.shape)


def forward(model: KimiK3ForConditionalGeneration, ids: torch.Tensor, tap_ids: list[int] = (),
            stream: str = "prefix", moe_inputs: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [B, T] -> (logits [B, T, V] float32, taps [B, T, n_taps * H] in ascending layer order or None).

    The layer flow is `DecoderLayer.forward` and the taps are `KimiK3ForConditionalGeneration.forward`'s
    ("prefix": the partial block sum after layer L; "attn_res": the mix entering layer L+1, for the
    last layer the output mix before the final norm). `moe_inputs`, if given, collects each MoE
    layer's input (for the router-bias update)."""
    tap_ids = sorted(tap_ids)
    layers = model.model.layers
    prefix = model.model.embed_tokens(ids)
    blocks: list[torch.Tensor] = []
    taps = []
    for i, layer in enumerate(layers):
        if stream == "attn_res" and i - 1 in tap_ids:
            taps.append(layer.attn_mix(prefix, blocks))
        h = layer.input_layernorm(layer.attn_mix(prefix, blocks))
        if layer.is_write:
            blocks.append(prefix)  # snapshot; block 0 is the embedding
            prefix = None
        a = kda(layer.self_attn, h) if layer.is_kda else mla(layer.self_attn, h)
        prefix = a if prefix is None else prefix + a
        mixed = attn_res_mix(prefix, blocks[:layer.prev + layer.is_write], layer.mlp_res_norm, layer.mlp_res_proj)
        h = layer.post_attention_layernorm(mixed)
        if moe_inputs is not None and hasattr(layer, "block_sparse_moe"):
            moe_inputs.append((layer.block_sparse_moe, h.detach()))
        prefix = prefix + ffn(layer, h)
        if stream == "prefix" and i in tap_ids:
            taps.append(prefix)
    m = model.model
    h = attn_res_mix(prefix, blocks, m.output_attn_res_norm, m.output_attn_res_proj)
    if stream == "attn_res" and len(layers) - 1 in tap_ids:
        taps.append(h)
    logits = model.lm_head(m.norm(h)).float()
    return logits, torch.cat(taps, dim=-1) if taps else None
