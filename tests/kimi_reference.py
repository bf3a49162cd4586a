"""An fp64 oracle of the Kimi-K3 text model, written from ../shared/reference/kimi_k3_target.md.

Independent of the engine: it imports nothing from dflash_batch and reads the checkpoint with
safetensors itself (dequantizing MXFP4 experts itself). It runs the whole sequence from position 0
with no cache, in float64, with plain loops where the engine is clever:
- KDA: the causal short conv and the delta-rule recurrence token by token, head by head;
- MLA: the un-absorbed form (kv_b_proj expands the latent into per-head K and V), explicit softmax
  over all previous tokens, per token and head;
- MoE: routing token by token;
- AttnRes: the softmax depth-mix of §2.2 at each layer entry, before the FFN, and at the output.

API:
    ref = load_reference(checkpoint_dir)          # checks every tensor name and shape (§3)
    logits, taps = reference_forward(ref_or_dir, input_ids, tap_layers, stream="prefix")
        logits [T, vocab] float64; taps [T, len(tap_layers) * hidden] float64, layers ascending.
    reference_forward(..., record={}) also fills record["layers"][l] with this layer's
    intermediates (see decoder_layer) for debugging the engine layer by layer.

Precisions followed ("Checked against the official modeling code", top of the spec):
1. q_a_layernorm / kv_a_layernorm use eps 1e-6, every other norm rms_norm_eps.
2. The short conv + SiLU runs on q, k and v; q and k are then L2-normalised, x*rsqrt(sum x² + 1e-6).
3. KDA gate = lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias)); A_log[:num_heads].
4. S = S*exp(g); S += k ⊗ beta(v - Sᵀk); o = Sᵀ(q K^-0.5), with S [K, V] per head.
5. o = RMSNorm_head_dim(o) * w * sigmoid(g_proj(x)), then o_proj.
6. Router: sigmoid logits; top-k on sigmoid + bias; weights = unbiased sigmoid / (sum + 1e-20) * rsf
   (the renormalisation only when moe_renormalize and top-k > 1, as in the official gate).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

F64 = torch.float64
MLA_LORA_NORM_EPS = 1e-6  # precision 1: the official q_a/kv_a norms take the RMSNorm default
L2NORM_EPS = 1e-6  # precision 2
ROUTER_EPS = 1e-20  # precision 6
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")


# ----------------------------------------------------------------------------------------------
# checkpoint


class KimiReference:
    """The text config (config.json's text_config) and every text weight in float64, keyed by the
    checkpoint name without its `language_model.` prefix."""

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights

    def layer(self, l: int, sub: str = "") -> dict[str, torch.Tensor]:
        """The weights of model.layers.{l}.{sub}, keyed by the rest of their name."""
        p = f"model.layers.{l}.{sub}"
        return {n[len(p):]: t for n, t in self.w.items() if n.startswith(p)}


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in/2] U8 (low nibble = even column) and [out, ceil(in/32)] U8 E8M0 -> [out, in] fp64."""
    out, half = packed.shape
    codes = torch.empty(out, 2 * half, dtype=torch.long)
    codes[:, 0::2] = (packed & 0xF).long()
    codes[:, 1::2] = (packed >> 4).long()
    values = torch.tensor(E2M1, dtype=F64)[codes]
    mult = torch.pow(torch.tensor(2.0, dtype=F64), scale.to(F64) - 127.0)
    return values * mult.repeat_interleave(MXFP4_GROUP, dim=1)[:, :2 * half]


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {f: [n for n, g in weight_map.items() if g == f] for f in set(weight_map.values())}
    else:
        files = {"model.safetensors": None}
    out = {}
    for file, names in files.items():
        with safe_open(str(directory / file), "pt") as f:
            for name in names if names is not None else f.keys():
                out[name] = f.get_tensor(name)
    return out


def expected_shapes(cfg: dict) -> dict[str, list[int] | None]:
    """§3.1, scaled to cfg: every text tensor the model reads (routed experts as `.weight`), with its
    shape; None = any length >= num_heads (A_log)."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    lac = cfg["linear_attn_config"]
    nh, d, ck = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    mh, dn, dr, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    E, I, R = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["routed_expert_hidden_size"]
    S = cfg["num_shared_experts"] * I
    shapes = {"model.embed_tokens.weight": [V, H], "lm_head.weight": [V, H], "model.norm.weight": [H],
              "model.output_attn_res_norm.weight": [H], "model.output_attn_res_proj.weight": [1, H]}
    for l in range(L):
        p = f"model.layers.{l}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            shapes[p + n + ".weight"] = [H]
        shapes[p + "self_attention_res_proj.weight"] = [1, H]
        shapes[p + "mlp_res_proj.weight"] = [1, H]
        a = p + "self_attn."
        if is_kda_layer(cfg, l):
            for x in "qkvg":
                shapes[a + f"{x}_proj.weight"] = [nh * d, H]
            for x in "qkv":
                shapes[a + f"{x}_conv1d.weight"] = [nh * d, 1, ck]
            shapes |= {a + "f_a_proj.weight": [d, H], a + "f_b_proj.weight": [nh * d, d],
                       a + "b_proj.weight": [nh, H], a + "A_log": None, a + "dt_bias": [nh * d],
                       a + "o_norm.weight": [d], a + "o_proj.weight": [H, nh * d]}
        else:
            shapes |= {a + "q_a_proj.weight": [qr, H], a + "q_a_layernorm.weight": [qr],
                       a + "q_b_proj.weight": [mh * (dn + dr), qr],
                       a + "kv_a_proj_with_mqa.weight": [kvr + dr, H], a + "kv_a_layernorm.weight": [kvr],
                       a + "kv_b_proj.weight": [mh * (dn + dv), kvr], a + "o_proj.weight": [H, mh * dv]}
            if cfg.get("mla_use_output_gate", False):
                shapes[a + "g_proj.weight"] = [mh * dv, H]
        if not is_moe_layer(cfg, l):
            ID = cfg["intermediate_size"]
            shapes |= {p + "mlp.gate_proj.weight": [ID, H], p + "mlp.up_proj.weight": [ID, H],
                       p + "mlp.down_proj.weight": [H, ID]}
            continue
        m = p + "block_sparse_moe."
        shapes |= {m + "gate.weight": [E, H], m + "gate.e_score_correction_bias": [E],
                   m + "routed_expert_down_proj.weight": [R, H], m + "routed_expert_up_proj.weight": [H, R]}
        if cfg.get("latent_moe_use_norm", True):
            shapes[m + "routed_expert_norm.weight"] = [R]
        if S:
            shapes |= {m + "shared_experts.gate_proj.weight": [S, H], m + "shared_experts.up_proj.weight": [S, H],
                       m + "shared_experts.down_proj.weight": [H, S]}
        for e in range(E):
            shapes |= {m + f"experts.{e}.w1.weight": [I, R], m + f"experts.{e}.w3.weight": [I, R],
                       m + f"experts.{e}.w2.weight": [R, I]}
    return shapes


def load_reference(checkpoint_dir: str | Path) -> KimiReference:
    """Read config.json and every safetensors tensor, strip `language_model.`, drop the vision tower,
    dequantize MXFP4, cast to float64, and check the names and shapes against §3 exactly (a missing,
    extra or misshapen text tensor raises)."""
    directory = Path(checkpoint_dir)
    top = json.loads((directory / "config.json").read_text())
    if top.get("model_type") != "kimi_k3" or top.get("architectures") != ["KimiK3ForConditionalGeneration"]:
        raise ValueError(f"not a Kimi-K3 config: {top.get('architectures')} / {top.get('model_type')}")
    cfg = top["text_config"]
    _check_config(cfg)
    raw = {}
    for name, t in _read_all(directory).items():
        if name.startswith(SKIPPED_PREFIXES):
            continue
        if not name.startswith("language_model."):
            raise ValueError(f"unexpected tensor outside language_model.: {name}")
        raw[name.removeprefix("language_model.")] = t
    weights = {}
    for name, t in raw.items():
        if name.endswith(".weight_scale") and name.removesuffix("_scale") + "_packed" in raw:
            continue
        if name.endswith(".weight_packed"):
            weights[name.removesuffix("_packed")] = dequant_mxfp4(t, raw[name.removesuffix("_packed") + "_scale"])
        else:
            weights[name] = t.to(F64)
    want = expected_shapes(cfg)
    problems = [f"missing {n}" for n in want if n not in weights]
    problems += [f"extra {n}" for n in weights if n not in want]
    for n, shape in want.items():
        if n in weights and shape is not None and list(weights[n].shape) != shape:
            problems.append(f"{n}: shape {list(weights[n].shape)}, expected {shape}")
        if n in weights and shape is None and weights[n].numel() < cfg["linear_attn_config"]["num_heads"]:
            problems.append(f"{n}: {weights[n].numel()} entries < num_heads")
    if problems:
        raise ValueError("checkpoint does not match the spec: " + "; ".join(problems))
    return KimiReference(cfg, weights)


def _check_config(cfg: dict) -> None:
    unsupported = []
    if cfg.get("hidden_act") != "situ":
        unsupported.append(f"hidden_act {cfg.get('hidden_act')}")
    if not cfg.get("mla_use_nope", False):
        unsupported.append("mla_use_nope false (RoPE)")
    if not cfg["linear_attn_config"].get("use_full_rank_gate", True):
        unsupported.append("use_full_rank_gate false")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        unsupported.append(f"topk_method {cfg.get('topk_method')}")
    if cfg.get("num_expert_group", 1) != 1 or cfg.get("topk_group", 1) != 1:
        unsupported.append("grouped top-k")
    if cfg.get("q_lora_rank") is None:
        unsupported.append("q_lora_rank None")
    if not cfg.get("attn_res_block_size"):
        unsupported.append("no attn_res_block_size")
    lac = cfg["linear_attn_config"]
    full = lac.get("full_attn_layers")
    if full is not None and set(full) & set(lac["kda_layers"]):
        unsupported.append(f"layers both KDA and full attention: {sorted(set(full) & set(lac['kda_layers']))}")
    if unsupported:
        raise NotImplementedError("reference does not implement: " + ", ".join(unsupported))


def is_kda_layer(cfg: dict, l: int) -> bool:
    """kda_layers is 1-based (§1.3)."""
    return (l + 1) in cfg["linear_attn_config"]["kda_layers"]


def is_moe_layer(cfg: dict, l: int) -> bool:
    """DeepSeek's rule (first_k_dense_replace, moe_layer_freq); K3: layer 0 dense, 1.. MoE."""
    return cfg["num_experts"] > 0 and l >= cfg["first_k_dense_replace"] and l % cfg["moe_layer_freq"] == 0


# ----------------------------------------------------------------------------------------------
# sub-blocks (x is [T, ...] float64 unless said otherwise)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x²) + eps) * w over the last dim (plain w, not 1 + w)."""
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * w


def attn_res_mix(cur: torch.Tensor, blocks: list[torch.Tensor], proj_w: torch.Tensor, norm_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """§2.2: softmax over the candidates [blocks..., cur] (current LAST) of the score
    sum_h(RMSNorm(V_n)_h * norm_w_h * proj_w_h), per token; returns the mix of the RAW candidates.
    proj_w is the [H] row of the [1, H] weight."""
    V = torch.stack(list(blocks) + [cur])  # [N, T, H]
    scores = (V / torch.sqrt(V.square().mean(-1, keepdim=True) + eps) * (norm_w * proj_w)).sum(-1)  # [N, T]
    p = torch.softmax(scores, dim=0)
    return (p[..., None] * V).sum(0)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """§2.7: (beta tanh(g/beta) sigmoid(g)) * (linear_beta tanh(u/linear_beta))."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def situ_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, cfg: dict) -> torch.Tensor:
    """down(SiTU(gate(x), up(x))): the dense MLP, the shared experts and each routed expert."""
    act = situ(linear(x, gate_w), linear(x, up_w), cfg["activation_situ_beta"], cfg["activation_situ_linear_beta"])
    return linear(act, down_w)


def short_conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv, token by token: y_t[c] = sum_j w[c, j] x_{t-(K-1)+j}[c] (w[:, K-1]
    multiplies the current token; inputs before position 0 are zero), then SiLU. x [T, C], w [C, K]."""
    T, C = x.shape
    K = w.shape[1]
    y = torch.zeros(T, C, dtype=F64)
    for t in range(T):
        for j in range(K):
            s = t - (K - 1) + j
            if s >= 0:
                y[t] += w[:, j] * x[s]
    return torch.nn.functional.silu(y)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x²) + 1e-6) over the last dim."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log-decay per key channel. f = f_b(f_a(x)) + dt_bias [T, nh, d]; a_log [nh] (per head,
    broadcast over head_dim). K3: lower_bound * sigmoid(exp(A_log) f); without a lower bound the
    Kimi-Linear form -exp(A_log) softplus(f)."""
    A = torch.exp(a_log)[None, :, None]
    if lower_bound is None:
        return -A * torch.nn.functional.softplus(f)
    return lower_bound * torch.sigmoid(A * f)


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Precision 4, token by token and head by head. q (already scaled by K^-0.5), k [T, nh, dk];
    v [T, nh, dv]; g [T, nh, dk]; beta [T, nh]; state [nh, dk, dv] (zero if None).
    Returns (o [T, nh, dv], final state)."""
    T, nh, dk = k.shape
    S = torch.zeros(nh, dk, v.shape[-1], dtype=F64) if state is None else state.clone()
    o = torch.zeros(T, nh, v.shape[-1], dtype=F64)
    for t in range(T):
        for h in range(nh):
            S[h] = S[h] * torch.exp(g[t, h])[:, None]  # decay along the key channel
            u = beta[t, h] * (v[t, h] - S[h].T @ k[t, h])  # delta rule, k read from the decayed S
            S[h] = S[h] + torch.outer(k[t, h], u)
            o[t, h] = S[h].T @ q[t, h]  # from the updated S
    return o, S


def kda_attention(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    """§2.4 KDA sublayer on the normed input x [T, H] -> [T, H]."""
    lac = cfg["linear_attn_config"]
    nh, d = lac["num_heads"], lac["head_dim"]
    T = x.shape[0]
    q, k, v = (short_conv_silu(linear(x, p[f"{n}_proj.weight"]), p[f"{n}_conv1d.weight"][:, 0, :]) for n in "qkv")
    q = l2norm(q.view(T, nh, d)) * d ** -0.5
    k = l2norm(k.view(T, nh, d))
    v = v.view(T, nh, d)
    f = linear(linear(x, p["f_a_proj.weight"]), p["f_b_proj.weight"]) + p["dt_bias"]
    g = kda_gate(f.view(T, nh, d), p["A_log"][:nh], lac.get("gate_lower_bound"))
    beta = torch.sigmoid(linear(x, p["b_proj.weight"]))
    o, _ = kda_recurrence(q, k, v, g, beta)
    o = rms_norm(o, p["o_norm.weight"], cfg["rms_norm_eps"]) * torch.sigmoid(linear(x, p["g_proj.weight"]).view(T, nh, d))
    return linear(o.reshape(T, nh * d), p["o_proj.weight"])


def mla_attention(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    """§2.5 gated NoPE-MLA on the normed input x [T, H] -> [T, H], un-absorbed: kv_b_proj expands the
    normed latent into per-head k_nope and v; k_pe (un-normed, un-rotated) is shared by the heads."""
    nh, dn, dr, dv = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    kvr = cfg["kv_lora_rank"]
    T = x.shape[0]
    q = linear(rms_norm(linear(x, p["q_a_proj.weight"]), p["q_a_layernorm.weight"], MLA_LORA_NORM_EPS),
               p["q_b_proj.weight"]).view(T, nh, dn + dr)
    c = linear(x, p["kv_a_proj_with_mqa.weight"])
    c_kv = rms_norm(c[:, :kvr], p["kv_a_layernorm.weight"], MLA_LORA_NORM_EPS)
    k_pe = c[:, kvr:]
    kv = linear(c_kv, p["kv_b_proj.weight"]).view(T, nh, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    scale = (dn + dr) ** -0.5
    out = torch.zeros(T, nh, dv, dtype=F64)
    for t in range(T):
        for h in range(nh):
            scores = torch.stack([(q[t, h, :dn] @ k_nope[s, h] + q[t, h, dn:] @ k_pe[s]) * scale for s in range(t + 1)])
            w = torch.exp(scores - scores.max())
            w = w / w.sum()
            out[t, h] = sum(w[s] * v[s, h] for s in range(t + 1))
    out = out.reshape(T, nh * dv)
    if cfg.get("mla_use_output_gate", False):
        out = out * torch.sigmoid(linear(x, p["g_proj.weight"]))
    return linear(out, p["o_proj.weight"])


def route(x_t: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, cfg: dict) -> tuple[list[int], torch.Tensor, float]:
    """One token's routing (precision 6). Returns (expert ids by descending biased score, their
    weights, the margin between the k-th and (k+1)-th biased score: a near-tie makes the choice
    fragile against rounding)."""
    logits = gate_w @ x_t
    if cfg.get("moe_router_activation_func", "sigmoid") == "sigmoid":
        scores = torch.sigmoid(logits)
    elif cfg["moe_router_activation_func"] == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        raise NotImplementedError(f"moe_router_activation_func {cfg['moe_router_activation_func']}")
    choice = scores + bias  # the bias decides the selection only
    order = sorted(range(len(choice)), key=lambda e: -float(choice[e]))
    k = cfg["num_experts_per_token"]
    ids = order[:k]
    weights = scores[ids]
    if k > 1 and cfg.get("moe_renormalize", True):  # the official gate skips it for top-1
        weights = weights / (weights.sum() + ROUTER_EPS)
    weights = weights * cfg.get("routed_scaling_factor", 1.0)
    margin = float(choice[order[k - 1]] - choice[order[k]]) if k < len(order) else math.inf
    return ids, weights, margin


def latent_moe(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: dict, record: dict | None = None) -> torch.Tensor:
    """§2.6 without the "+ prefix": routed experts in the latent (down-proj, per-token top-k experts,
    weighted sum, RMSNorm, up-proj) plus the shared experts on the full-width x."""
    lat = linear(x, p["routed_expert_down_proj.weight"])
    r = torch.zeros_like(lat)
    routes = []
    for t in range(x.shape[0]):
        ids, weights, margin = route(x[t], p["gate.weight"], p["gate.e_score_correction_bias"], cfg)
        routes.append((ids, weights, margin))
        for e, w in zip(ids, weights):
            r[t] += w * situ_mlp(lat[t], p[f"experts.{e}.w1.weight"], p[f"experts.{e}.w3.weight"],
                                 p[f"experts.{e}.w2.weight"], cfg)
    if cfg.get("latent_moe_use_norm", True):
        r = rms_norm(r, p["routed_expert_norm.weight"], cfg["rms_norm_eps"])
    out = linear(r, p["routed_expert_up_proj.weight"])
    if cfg["num_shared_experts"]:
        out = out + situ_mlp(x, p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"],
                             p["shared_experts.down_proj.weight"], cfg)
    if record is not None:
        record["routes"] = routes
    return out


# ----------------------------------------------------------------------------------------------
# layers and model


def decoder_layer(ref: KimiReference, l: int, prefix: torch.Tensor, blocks: list[torch.Tensor],
                  record: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """§2.3. Appends this layer's snapshot to `blocks` when l % B == 0. Returns (new prefix, the
    entry mix before input_layernorm, i.e. the "attn_res" tap of layer l - 1).

    record, when given, gets: entry_mix, attn_in (normed), attn_out, ffn_in (normed), ffn_out
    (routed + shared, or dense), prefix (after the layer), n_blocks_attn / n_blocks_ffn (snapshots
    each mix saw), and routes [(ids, weights, margin) per token] for MoE layers."""
    cfg, eps, B = ref.cfg, ref.cfg["rms_norm_eps"], ref.cfg["attn_res_block_size"]
    p = ref.layer(l)
    prev = math.ceil(l / B)
    assert len(blocks) == prev
    entry_mix = attn_res_mix(prefix, blocks[:prev], p["self_attention_res_proj.weight"][0],
                             p["self_attention_res_norm.weight"], eps)
    h = rms_norm(entry_mix, p["input_layernorm.weight"], eps)
    is_write = l % B == 0
    if is_write:
        blocks.append(prefix)  # block 0 = embedding; block k = sum of layers B(k-1) .. Bk-1
        prefix = None
    attn = kda_attention if is_kda_layer(cfg, l) else mla_attention
    a = attn(h, ref.layer(l, "self_attn."), cfg)
    prefix = a if prefix is None else prefix + a
    mlp_valid = prev + (1 if is_write else 0)
    h2 = rms_norm(attn_res_mix(prefix, blocks[:mlp_valid], p["mlp_res_proj.weight"][0], p["mlp_res_norm.weight"], eps),
                  p["post_attention_layernorm.weight"], eps)
    sub = {} if record is not None else None
    if is_moe_layer(cfg, l):
        f = latent_moe(h2, ref.layer(l, "block_sparse_moe."), cfg, sub)
    else:
        f = situ_mlp(h2, p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"], p["mlp.down_proj.weight"], cfg)
    prefix = prefix + f
    if record is not None:
        record.update(entry_mix=entry_mix, attn_in=h, attn_out=a, ffn_in=h2, ffn_out=f, prefix=prefix.clone(),
                      n_blocks_attn=prev, n_blocks_ffn=mlp_valid, **sub)
    return prefix, entry_mix


def reference_forward(checkpoint: str | Path | KimiReference, input_ids: list[int], tap_layers: list[int],
                      stream: str = "prefix", record: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole text model from position 0, no cache, float64.

    tap_layers: 0-based completed-layer ids, unique, in [0, num_layers); taps come out in ascending
    layer order whatever the order given (§5.1). stream (§5.2):
      "prefix":   tap_L = prefix_sum right after layer L (the partial block sum, no embedding);
      "attn_res": tap_L = layer L+1's entry AttnRes mix before its input_layernorm; for the last
                  layer the output mix (output_attn_res_*) before model.norm.
    Returns (logits [T, vocab], taps [T, len(tap_layers) * hidden]).
    record, when given, gets record["layers"] = [per-layer dict (see decoder_layer)],
    record["blocks"] (the snapshots), record["output_mix"], record["final_hidden"] (after model.norm).
    """
    ref = checkpoint if isinstance(checkpoint, KimiReference) else load_reference(checkpoint)
    cfg = ref.cfg
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    if stream not in ("prefix", "attn_res"):
        raise ValueError(f"stream must be 'prefix' or 'attn_res', not {stream!r}")
    ids = sorted(tap_layers)
    if len(set(ids)) != len(ids) or any(not 0 <= i < L for i in ids):
        raise ValueError(f"tap_layers must be unique in [0, {L}): {tap_layers}")
    tokens = torch.tensor(list(input_ids), dtype=torch.long)
    if tokens.ndim != 1 or len(tokens) == 0 or int(tokens.min()) < 0 or int(tokens.max()) >= cfg["vocab_size"]:
        raise ValueError("input_ids must be a non-empty list of ids in [0, vocab_size)")

    prefix = ref.w["model.embed_tokens.weight"][tokens]  # no scaling
    blocks: list[torch.Tensor] = []
    taps: dict[int, torch.Tensor] = {}
    layers = []
    for l in range(L):
        rec = {} if record is not None else None
        prefix, entry_mix = decoder_layer(ref, l, prefix, blocks, rec)
        layers.append(rec)
        if stream == "attn_res" and l - 1 in ids:
            taps[l - 1] = entry_mix
        if stream == "prefix" and l in ids:
            taps[l] = prefix.clone()
    assert len(blocks) == math.ceil(L / cfg["attn_res_block_size"])
    out_mix = attn_res_mix(prefix, blocks, ref.w["model.output_attn_res_proj.weight"][0],
                           ref.w["model.output_attn_res_norm.weight"], eps)
    if stream == "attn_res" and L - 1 in ids:
        taps[L - 1] = out_mix
    hidden = rms_norm(out_mix, ref.w["model.norm.weight"], eps)
    logits = linear(hidden, ref.w["lm_head.weight"])  # no softcap, no scale
    if record is not None:
        record.update(layers=layers, blocks=list(blocks), output_mix=out_mix, final_hidden=hidden)
    tap = torch.cat([taps[i] for i in ids], dim=-1) if ids else torch.zeros(len(tokens), 0, dtype=F64)
    return logits, tap
