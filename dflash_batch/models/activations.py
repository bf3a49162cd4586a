"""How much memory one forward needs beyond the weights and caches: an upper bound from the config.

A forward keeps a few hidden-width streams for its whole length (the residual, Kimi-K3's AttnRes
block snapshots, the drafter's taps) while one layer at a time holds its widest intermediates
(projections, the MLP's or the routed experts' hidden rows, the router's scores), and ends in
the logits of the rows it scores (checked for finiteness). The bound is the sum: streams +
widest layer + logits, per token of the forward, at this rank's share of every sharded width
(parallel.world_size()). Widths are those the GPU path allocates (the Triton MoE keeps T * top_k
rows of each expert width; Triton's AttnRes and fla's KDA hold no float32 copies of their
inputs; flashinfer's attention works in its own workspace), or with `torch_kernels` the torch
references'; the torch attention's blocked scores and gathered keys are added where that
backend runs. tests/test_sizing.py checks the bound against the CPU allocator's peak of real
runs and rounds of the tiny models, and the MoE's term against a MoE layer's forward on the GPU
path.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dflash_batch import parallel
from dflash_batch.backends.torch_attention import SCORES_LIMIT
from dflash_batch.models.layers.kda import CHUNK as KDA_CHUNK

WIDE = 4  # float32: norms, gates, router scores, logits
SAMPLER_COPIES = 6  # float32 copies of a row's logits while it is sampled (sampling_bytes)


@dataclass(frozen=True)
class Widths:
    """Bytes a token of a forward holds: for its whole length, and in the widest layer; the
    vocabulary slice its logits rows span; the query heads and the key bytes of a context token
    the torch attention scores and gathers."""

    stream: int
    layer: int
    vocab: int
    heads: int
    key: int
    chunk: int = 0  # what a prefill holds whatever its length (the torch KDA's chunk products)


def widths(model: nn.Module, dtype_bytes: int, torch_kernels: bool) -> Widths:
    """`torch_kernels`: the torch references run (the CPU path), not the Triton kernels."""
    config, tp, b = model.config, parallel.world_size(), dtype_bytes
    config = config.get("text_config", config)
    hidden = config["hidden_size"]
    if "linear_attn_config" in config:
        return _kimi(config, tp, b, torch_kernels)
    heads, kv = config["num_attention_heads"] // tp, max(1, config.get("num_key_value_heads", 1) // tp)
    mlp = _mlp(config["intermediate_size"] // tp, b)
    if "kv_lora_rank" in config:  # a DFlash2-MLA drafter
        attn = _mla(config, heads, b)
        key = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b
    else:
        d = config.get("head_dim") or hidden // config["num_attention_heads"]
        attn = (heads + 2 * kv) * d * (3 * b + 2 * WIDE) + heads * d * b
        key = 2 * kv * d * b
    taps = len(getattr(model, "target_layer_ids", None) or getattr(model, "tap_ids", None) or [])
    stream = 4 * hidden * b + 2 * taps * hidden * b  # residual, normed, sublayer out, sum; taps and their concat
    return Widths(stream, max(attn, mlp) + hidden * WIDE, config["vocab_size"] // tp, heads, key)


def _mlp(width: int, b: int) -> int:
    """A gated MLP of `width` hidden units a rank: gate and up, the activation in float32, its output."""
    return 3 * width * b + 2 * width * WIDE


def _mla(config: dict, heads: int, b: int) -> int:
    dn, dr, dv, kl = (config[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
    return (config["q_lora_rank"] * (b + WIDE) + 2 * heads * (dn + dr) * b + 2 * (kl + dr) * (b + WIDE)
            + 2 * heads * (kl + dr) * b + heads * kl * b + heads * dv * (2 * b + WIDE))


def _kimi(config: dict, tp: int, b: int, torch_kernels: bool) -> Widths:
    hidden = config["hidden_size"]
    lin = config["linear_attn_config"]
    blocks = -(-config["num_hidden_layers"] // config["attn_res_block_size"]) + 1
    kda = lin["num_heads"] // tp * lin["head_dim"]
    attn = max(_mla(config, config["num_attention_heads"] // tp, b),
               3 * kda * (3 * b + 2 * WIDE) + 4 * kda * WIDE)
    latent, top_k = config["routed_expert_hidden_size"], config["num_experts_per_token"]
    # The routed experts: the router's scores; each (token, slot)'s expert id, weight and place in
    # the expert-sorted order with the tile table over it (int64); the latent rows; and the Triton
    # MoE's rows, SiTU(W1 x, W3 x) and W2 of it, for every (token, slot).
    routed = (3 * config["num_experts"] * WIDE + top_k * (3 * 8 + WIDE) + latent * (3 * b + WIDE)
              + top_k * (config["moe_intermediate_size"] // tp + latent) * b)
    # Then the shared experts, beside the routed sum's output.
    shared = hidden * b + _mlp(config.get("num_shared_experts", 0) * config["moe_intermediate_size"] // tp, b)
    moe = max(routed, shared)
    dense = _mlp(config["intermediate_size"] // tp, b)
    # AttnRes: the torch reference stacks the snapshots and widens them; the Triton kernel reads them.
    mix = 2 * (blocks + 1) * hidden * WIDE if torch_kernels else 0
    # The torch chunked delta rule holds a few [heads, chunk, chunk, d] float32 products at once.
    chunk = 4 * lin["num_heads"] // tp * KDA_CHUNK ** 2 * lin["head_dim"] * WIDE if torch_kernels else 0
    stream = (blocks + 4) * hidden * b
    return Widths(stream, max(attn, moe, dense, mix) + hidden * WIDE, config["vocab_size"] // tp,
                  config["num_attention_heads"] // tp, (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * b,
                  chunk)


def forward_bytes(w: Widths, tokens: int, logit_rows: int, gathered: int, sequences: int = 1, keys: int = 0,
                  torch_attention: bool = False) -> int:
    """A forward of `tokens` tokens of `sequences` sequences with up to `keys` keys each, scoring
    `logit_rows` rows (this rank's slice of each), of which `gathered` at once are gathered
    whole on every rank (the verify's groups: engine/choice.py)."""
    # The rows' logits and, while their finiteness is checked, |logits| and three bool masks.
    logits = logit_rows * w.vocab * (2 * WIDE + 3) + (gathered * w.vocab * parallel.world_size() * 2 * WIDE
                                                        if parallel.world_size() > 1 else 0)
    # The torch attention scores blocks of keys (at most SCORES_LIMIT scores at once) from a gather.
    scores = min(SCORES_LIMIT, tokens * w.heads * keys)
    attention = 3 * WIDE * scores + 2 * sequences * keys * w.key if torch_attention else 0
    return tokens * (w.stream + w.layer) + logits + attention


def sampling_bytes(w: Widths, rows: int) -> int:
    """Choosing sampled tokens from `rows` whole rows of logits at once: the filtered copies, the
    top-p sort (values and int64 indices), the probabilities and their running sum."""
    return SAMPLER_COPIES * rows * w.vocab * parallel.world_size() * WIDE


def latent_split_bytes(model: nn.Module, dtype_bytes: int, tokens: int) -> int:
    """What an MLA layer split across the ranks by token (backends/latent_split.py) holds beyond
    its heads-split form for `tokens` query rows: the gathered queries of every rank's heads, their
    outputs over this rank's keys and the weighted copy the merge reduces (both float32), and the
    log-sum-exps gathered from every rank."""
    config = model.config.get("text_config", model.config)
    if "kv_lora_rank" not in config:
        return 0
    heads, ranks = config["num_attention_heads"], parallel.world_size()
    latent, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    return tokens * heads * ((latent + rope) * dtype_bytes + 2 * latent * WIDE + (ranks + 1) * WIDE)
