"""A tiny random Kimi-K3 checkpoint in the real Hugging Face layout (seconds to build, CPU).

Written from ../shared/reference/kimi_k3_target.md (§1 config.json, §3 tensor names and shapes,
precision 8 for the fp32 tensors). Shared by the engine tests, benchmarks and the fp64 oracle
(tests/kimi_reference.py); it imports nothing from dflash_batch.

Layout, as in moonshotai/Kimi-K3:
- config.json: `architectures: ["KimiK3ForConditionalGeneration"]`, `model_type: "kimi_k3"`, the text
  fields under `text_config` (`model_type: "kimi_linear"`), a small `vision_config`, and with MXFP4
  experts a compressed-tensors `quantization_config` at the top level.
- safetensors tensors named `language_model.model.…` / `language_model.lm_head.weight`; routed
  experts `…block_sparse_moe.experts.{e}.w{1,2,3}.weight_packed` (U8, two E2M1 codes a byte, low
  nibble = even column) + `.weight_scale` (U8 E8M0, one per 32 input columns); A_log, dt_bias,
  {q,k,v}_conv1d.weight, o_norm.weight and gate.e_score_correction_bias in float32; everything
  else in `dtype` (bfloat16 by default). A_log is zero-padded past num_heads (to head_dim entries,
  as the real F32[128] holds 96 heads then zeros).
- No tokenizer: tests feed token ids.

Default tiny config (the spec's suggestion): 8 layers, AttnRes block 3 (snapshot writes at layers
0, 3, 6, so the blocks cross at non-zero layers), KDA at 1-based [1,2,3,5,6,7] and MLA at [4,8]
(0-based 3 and 7: the last layer is MLA, and layer 3 is both MLA and a block-write layer), dense
layer 0 then latent-MoE layers 1..7.

Weights are unit-scale random so logits are O(1) and the argmax varies; the MLP gate/up weights
are a little larger (gain 2) so SiTU's tanh clipping matters, and q_a_proj and the c_kv rows of
kv_a_proj_with_mqa are small (gain 0.1) so the eps (1e-6) of the LoRA RMSNorms shows in the logits. The same seed gives the same model
whatever `expert_format`, `dtype`, `num_shards` or `with_vision`: the routed-expert values are
MXFP4-representable (also exactly in bfloat16), and `expert_format="bf16"` stores those values
dequantized under `experts.{e}.w{1,2,3}.weight`. With `dtype=torch.float32` only the stored dtype of
the non-fp32 tensors changes; their values are the bf16-rounded ones either way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_LINEAR_ATTN = dict(
    kda_layers=[1, 2, 3, 5, 6, 7],  # 1-based
    full_attn_layers=[4, 8],  # 1-based
    num_heads=4,
    head_dim=16,
    short_conv_kernel_size=4,
    use_full_rank_gate=True,
    gate_lower_bound=-5.0,
)

TINY_KIMI_TEXT = dict(
    model_type="kimi_linear",
    architectures=["KimiLinearForCausalLM"],
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,  # dense MLP width (layer 0)
    num_hidden_layers=8,
    num_attention_heads=4,  # MLA heads
    num_key_value_heads=4,  # unused (MLA)
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    mla_use_nope=True,
    mla_use_output_gate=True,
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=1,
    moe_intermediate_size=32,
    routed_expert_hidden_size=48,
    latent_moe_use_norm=True,
    moe_renormalize=True,
    moe_router_activation_func="sigmoid",
    topk_method="noaux_tc",
    use_grouped_topk=True,
    num_expert_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    attn_res_block_size=3,
    hidden_act="situ",
    activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
    linear_attn_config=TINY_LINEAR_ATTN,
    bos_token_id=92,
    eos_token_id=93,
    pad_token_id=95,
    torch_dtype="bfloat16",
)

TINY_VISION = dict(model_type="moonvit3d", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                   patch_size=4, temporal_patch_size=2, mm_hidden_size=16)

FP32_SUFFIXES = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
                 "o_norm.weight", "gate.e_score_correction_bias")

# FP4 E2M1 magnitudes by code (bit 3 = sign); E8M0 scale e means 2^(e - 127).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_RMS = math.sqrt(sum(v * v for v in E2M1) / len(E2M1))
MXFP4_GROUP = 32
PREFIX = "language_model."


def text_config(**overrides) -> dict:
    """TINY_KIMI_TEXT updated by overrides; `linear_attn_config` merges key by key, and a changed
    layer count without explicit layer lists gets full attention at l % 4 == 3 and the last layer."""
    cfg = json.loads(json.dumps(TINY_KIMI_TEXT))
    lac = overrides.pop("linear_attn_config", {})
    cfg.update(overrides)
    cfg["linear_attn_config"].update(lac)
    n = cfg["num_hidden_layers"]
    if "num_hidden_layers" in overrides and "kda_layers" not in lac:
        full = [l + 1 for l in range(n) if l % 4 == 3 or l == n - 1]
        cfg["linear_attn_config"]["kda_layers"] = [l + 1 for l in range(n) if l + 1 not in full]
        cfg["linear_attn_config"]["full_attn_layers"] = full
    elif "kda_layers" in lac and "full_attn_layers" not in lac:
        kda = set(cfg["linear_attn_config"]["kda_layers"])
        cfg["linear_attn_config"]["full_attn_layers"] = [l for l in range(1, n + 1) if l not in kda]
    return cfg


def is_moe_layer(cfg: dict, l: int) -> bool:
    """DeepSeek's rule, which the Kimi configs inherit: MoE from first_k_dense_replace on, every
    moe_layer_freq-th layer."""
    return cfg["num_experts"] > 0 and l >= cfg["first_k_dense_replace"] and l % cfg["moe_layer_freq"] == 0


def tensor_specs(cfg: dict, a_log_size: int | None = None) -> list[tuple[str, list[int], str]]:
    """(name without the language_model. prefix, shape, init kind) for every text tensor, §3 order."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    lac = cfg["linear_attn_config"]
    nh, d, ck = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    mh = cfg["num_attention_heads"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    E, I, R = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["routed_expert_hidden_size"]
    S = cfg["num_shared_experts"] * I
    specs = [("model.embed_tokens.weight", [V, H], "embed"),
             ("lm_head.weight", [V, H], "head"),
             ("model.norm.weight", [H], "norm"),
             ("model.output_attn_res_norm.weight", [H], "norm"),
             ("model.output_attn_res_proj.weight", [1, H], "res_proj")]
    for l in range(L):
        p = f"model.layers.{l}."
        specs += [(p + "input_layernorm.weight", [H], "norm"),
                  (p + "post_attention_layernorm.weight", [H], "norm"),
                  (p + "self_attention_res_norm.weight", [H], "norm"),
                  (p + "self_attention_res_proj.weight", [1, H], "res_proj"),
                  (p + "mlp_res_norm.weight", [H], "norm"),
                  (p + "mlp_res_proj.weight", [1, H], "res_proj")]
        a = p + "self_attn."
        if (l + 1) in lac["kda_layers"]:
            specs += [(a + f"{x}_proj.weight", [nh * d, H], "linear") for x in "qkvg"]
            specs += [(a + "f_a_proj.weight", [d, H], "linear"),
                      (a + "f_b_proj.weight", [nh * d, d], "linear"),
                      (a + "b_proj.weight", [nh, H], "linear")]
            specs += [(a + f"{x}_conv1d.weight", [nh * d, 1, ck], "conv") for x in "qkv"]
            specs += [(a + "A_log", [a_log_size or max(d, nh)], "A_log"),
                      (a + "dt_bias", [nh * d], "dt_bias"),
                      (a + "o_norm.weight", [d], "norm"),
                      (a + "o_proj.weight", [H, nh * d], "linear")]
        else:
            specs += [(a + "q_a_proj.weight", [qr, H], "lora_in"),
                      (a + "q_a_layernorm.weight", [qr], "norm"),
                      (a + "q_b_proj.weight", [mh * (dn + dr), qr], "linear"),
                      (a + "kv_a_proj_with_mqa.weight", [kvr + dr, H], "kv_a"),
                      (a + "kv_a_layernorm.weight", [kvr], "norm"),
                      (a + "kv_b_proj.weight", [mh * (dn + dv), kvr], "linear"),
                      (a + "g_proj.weight", [mh * dv, H], "linear"),
                      (a + "o_proj.weight", [H, mh * dv], "linear")]
        if not is_moe_layer(cfg, l):
            ID = cfg["intermediate_size"]
            specs += [(p + "mlp.gate_proj.weight", [ID, H], "mlp_in"),
                      (p + "mlp.up_proj.weight", [ID, H], "mlp_in"),
                      (p + "mlp.down_proj.weight", [H, ID], "linear")]
            continue
        m = p + "block_sparse_moe."
        specs += [(m + "gate.weight", [E, H], "linear"),
                  (m + "gate.e_score_correction_bias", [E], "router_bias"),
                  (m + "routed_expert_down_proj.weight", [R, H], "linear"),
                  (m + "routed_expert_up_proj.weight", [H, R], "linear"),
                  (m + "routed_expert_norm.weight", [R], "norm")]
        if S:
            specs += [(m + "shared_experts.gate_proj.weight", [S, H], "mlp_in"),
                      (m + "shared_experts.up_proj.weight", [S, H], "mlp_in"),
                      (m + "shared_experts.down_proj.weight", [H, S], "linear")]
        for e in range(E):
            specs += [(m + f"experts.{e}.w1.weight", [I, R], "expert_in"),
                      (m + f"experts.{e}.w3.weight", [I, R], "expert_in"),
                      (m + f"experts.{e}.w2.weight", [R, I], "expert_out")]
    return specs


def _random_mxfp4(gen: torch.Generator, out: int, cols: int, std: float) -> tuple[torch.Tensor, ...]:
    """Random MXFP4 weight of about `std`: (packed U8 [out, cols/2], scale U8 [out, ceil(cols/32)],
    the dequantized float32 values [out, cols]). Scales vary by one binade around the target."""
    assert cols % 2 == 0
    codes = torch.randint(0, 16, (out, cols), generator=gen, dtype=torch.int64)
    k0 = round(math.log2(std / E2M1_RMS))
    groups = -(-cols // MXFP4_GROUP)
    scale = (127 + k0 + torch.randint(-1, 2, (out, groups), generator=gen)).to(torch.uint8)
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    sign = torch.where(codes >= 8, -1.0, 1.0).double()
    mult = torch.pow(2.0, scale.double() - 127).repeat_interleave(MXFP4_GROUP, dim=1)[:, :cols]
    values = (sign * mag * mult).float()
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # low nibble = even column
    return packed, scale, values


def _random_tensor(gen: torch.Generator, name: str, shape: list[int], kind: str, cfg: dict) -> torch.Tensor:
    n = torch.randn(shape, generator=gen, dtype=torch.float32)
    fan_in = shape[-1]
    if kind == "embed":
        return n
    if kind == "head":
        return 1.5 * n / math.sqrt(fan_in)  # logits of std ~1.5
    if kind == "norm":
        return 1.0 + 0.2 * n
    if kind == "res_proj":
        return 1.5 * n / math.sqrt(fan_in)  # AttnRes scores of std ~1.5: mixes far from uniform or one-hot
    if kind == "linear":
        return n / math.sqrt(fan_in)
    if kind == "lora_in":  # small LoRA latents, so the 1e-6 eps of their RMSNorms is visible in logits
        return 0.1 * n / math.sqrt(fan_in)
    if kind == "kv_a":  # rows [c_kv (small, like lora_in) | k_pe (unit: no norm follows)]
        kvr = cfg["kv_lora_rank"]
        return torch.cat([0.1 * n[:kvr], n[kvr:]]) / math.sqrt(fan_in)
    if kind == "mlp_in":
        return 2.0 * n / math.sqrt(fan_in)  # SiTU's clip matters
    if kind == "conv":
        return 0.5 * n
    if kind == "A_log":  # exp(A_log) around 1, padding entries exactly zero
        nh = cfg["linear_attn_config"]["num_heads"]
        out = torch.zeros(shape)
        out[:nh] = 0.5 * n[:nh]
        return out
    if kind == "dt_bias":  # gate = -5 sigmoid(A (f + dt_bias)): mostly mild decays, some strong
        return 0.5 * n - 1.5
    if kind == "router_bias":  # as large as sigmoid-score gaps: the bias changes selections
        return 0.3 * n
    raise ValueError(f"{name}: unknown init kind {kind}")


def make_kimi_checkpoint(directory: str | Path, seed: int = 0, *, expert_format: str = "mxfp4",
                         dtype: torch.dtype = torch.bfloat16, with_vision: bool = False, num_shards: int = 2,
                         a_log_size: int | None = None, **overrides) -> Path:
    """Write a random tiny Kimi-K3 checkpoint (TINY_KIMI_TEXT updated by overrides) to directory.

    expert_format: "mxfp4" (real layout: weight_packed + weight_scale, quantization_config in
    config.json) or "bf16" (the same values as plain `experts.{e}.w*.weight` in `dtype`).
    with_vision: also write a few vision_tower.* / mm_projector.* tensors, which text loaders skip.
    num_shards: >1 writes model-0000i-of-0000n.safetensors + model.safetensors.index.json, 1 writes
    model.safetensors. a_log_size: length of the zero-padded A_log (default max(head_dim, heads)).
    """
    if expert_format not in ("mxfp4", "bf16"):
        raise ValueError(f"expert_format must be 'mxfp4' or 'bf16', not {expert_format!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = text_config(**overrides)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, kind in tensor_specs(cfg, a_log_size):
        if kind in ("expert_in", "expert_out"):
            gain = 2.0 if kind == "expert_in" else 1.0
            packed, scale, values = _random_mxfp4(gen, shape[0], shape[1], gain / math.sqrt(shape[1]))
            if expert_format == "mxfp4":
                tensors[PREFIX + name + "_packed"] = packed
                tensors[PREFIX + name + "_scale"] = scale
            else:
                tensors[PREFIX + name] = values.to(dtype)  # exact: at most 2 significant bits
            continue
        t = _random_tensor(gen, name, shape, kind, cfg)
        if name.endswith(FP32_SUFFIXES):
            tensors[PREFIX + name] = t.float()
        else:
            tensors[PREFIX + name] = t.to(torch.bfloat16).to(dtype)  # same values whatever dtype
    if with_vision:
        vg = torch.Generator().manual_seed(seed + 1)  # separate stream: text weights do not change
        for name, shape in (("vision_tower.patch_embed.proj.weight", [16, 3, 2, 4, 4]),
                            ("vision_tower.encoder.blocks.0.attn.wqkv.weight", [48, 16]),
                            ("vision_tower.encoder.blocks.0.norm0.weight", [16]),
                            ("mm_projector.pre_norm.weight", [16]),
                            ("mm_projector.proj.0.weight", [cfg["hidden_size"], 16])):
            tensors[name] = torch.randn(shape, generator=vg).to(dtype)

    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": cfg,
        "vision_config": dict(TINY_VISION),
        "media_placeholder_token_id": 94,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "pad_token_id": cfg["pad_token_id"],
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if expert_format == "mxfp4":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_GROUP,
                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
                "input_activations": None, "output_activations": None, "format": "mxfp4-pack-quantized"}},
            "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\..*",
                       r"re:.*routed_expert_(down|up)_proj", r"re:.*gate$", r"re:vision_tower.*",
                       r"re:mm_projector.*"],
            "kv_cache_scheme": None,
        }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    _save_sharded(tensors, directory, num_shards)
    return directory


def _save_sharded(tensors: dict[str, torch.Tensor], directory: Path, num_shards: int) -> None:
    if num_shards <= 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    per = -(-len(names) // num_shards)
    weight_map, total = {}, 0
    for i in range(num_shards):
        part = names[i * per:(i + 1) * per]
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(directory / file), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


if __name__ == "__main__":  # print the tensor list of the default tiny checkpoint
    import sys
    import tempfile

    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        d = make_kimi_checkpoint(tmp, with_vision="--vision" in sys.argv)
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                for n in sf.keys():
                    t = sf.get_slice(n)
                    print(f"{n} {t.get_dtype()} {t.get_shape()}")
