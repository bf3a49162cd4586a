"""config.json of the demo target (Kimi-K3 architecture) and drafter (DFlash2, MLA attention).

Both are written exactly as the real checkpoints' configs are laid out (KimiK3ForConditionalGeneration
with a kimi_linear text_config; DFlash2DraftModel with a dflash_config section), so the product
loader reads them with no demo-specific code. Two presets: `demo` (the trained pair) and `tiny`
(seconds per step, for tests); each keeps every architectural part:
- target: KDA layers, gated NoPE-MLA layers (full attention at l % 4 == 3 and the last layer),
  AttnRes blocks whose boundaries fall on non-zero layers, latent MoE after a dense layer 0, SiTU;
- drafter: block size 8, sliding then full attention layers, YaRN RoPE, the grouped dynamic conv
  and the candidate selector.
"""

from __future__ import annotations

PRESETS = {
    # 7.3M target parameters (5M active per token: 2 of 8 experts), 1.35M drafter; ~1.6 s per
    # target step and ~0.75 s per drafter step (16 sequences) on one core. At batch 1 a drafter
    # round (block forward + proposal + context write) takes ~6 ms against ~36 ms for the
    # target's 8-row verify and ~15 ms for one target-only step. AttnRes blocks of 3: writes
    # at layers 0, 3, 6.
    "demo": dict(hidden=256, layers=8, attn_res_block=3, kda_heads=4, kda_head_dim=64, mla_heads=4,
                 q_lora=96, kv_lora=64, nope=32, rope=16, v_dim=32, dense_inter=512, experts=8, top_k=2,
                 moe_inter=128, latent=128, shared=1,
                 draft_layers=2, draft_heads=4, draft_q_lora=96, draft_kv_lora=64, draft_nope=32,
                 draft_rope=16, draft_v=32, draft_inter=512, window=32, selector_rank=32, selector_top_k=8),
    # For tests: 4 layers (KDA 0-2, MLA 3 = last), AttnRes writes at 0 and 2.
    "tiny": dict(hidden=64, layers=4, attn_res_block=2, kda_heads=2, kda_head_dim=32, mla_heads=2,
                 q_lora=32, kv_lora=16, nope=16, rope=8, v_dim=16, dense_inter=128, experts=4, top_k=2,
                 moe_inter=32, latent=48, shared=1,
                 draft_layers=2, draft_heads=2, draft_q_lora=32, draft_kv_lora=16, draft_nope=16,
                 draft_rope=8, draft_v=16, draft_inter=128, window=8, selector_rank=8, selector_top_k=4),
}

BLOCK_SIZE = 8
# The published K3 drafter family's RoPE (TokenSpeed's DFlash2-MLA fixture): the target is NoPE,
# so the drafter's own positions are what tells its identical mask rows apart.
YARN = dict(rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=32768,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def target_config(p: dict, vocab: int, special: dict[str, int]) -> dict:
    n = p["layers"]
    full = [l + 1 for l in range(n) if l % 4 == 3 or l == n - 1]  # 1-based, as the config lists them
    text = dict(
        model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=vocab,
        hidden_size=p["hidden"], intermediate_size=p["dense_inter"], num_hidden_layers=n,
        num_attention_heads=p["mla_heads"], num_key_value_heads=p["mla_heads"],
        q_lora_rank=p["q_lora"], kv_lora_rank=p["kv_lora"], qk_nope_head_dim=p["nope"],
        qk_rope_head_dim=p["rope"], v_head_dim=p["v_dim"], mla_use_nope=True, mla_use_output_gate=True,
        num_experts=p["experts"], num_experts_per_token=p["top_k"], num_shared_experts=p["shared"],
        moe_intermediate_size=p["moe_inter"], routed_expert_hidden_size=p["latent"],
        latent_moe_use_norm=True, moe_renormalize=True, moe_router_activation_func="sigmoid",
        topk_method="noaux_tc", use_grouped_topk=True, num_expert_group=1, topk_group=1,
        routed_scaling_factor=1.0, first_k_dense_replace=1, moe_layer_freq=1,
        attn_res_block_size=p["attn_res_block"], hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
        tie_word_embeddings=False, num_nextn_predict_layers=0,
        linear_attn_config=dict(kda_layers=[l for l in range(1, n + 1) if l not in full], full_attn_layers=full,
                                num_heads=p["kda_heads"], head_dim=p["kda_head_dim"], short_conv_kernel_size=4,
                                use_full_rank_gate=True, gate_lower_bound=-5.0),
        bos_token_id=special["<|bos|>"], eos_token_id=special["<|im_end|>"], pad_token_id=special["<|pad|>"],
        torch_dtype="float32")
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
        "pad_token_id": text["pad_token_id"], "bos_token_id": text["bos_token_id"],
        # Chats end on <|im_end|>, plain samples on <|eos|>: the job stops on either.
        "eos_token_id": [special["<|im_end|>"], special["<|eos|>"]],
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def default_taps(layers: int, block: int) -> list[int]:
    """The last layer of every AttnRes block. With the "prefix" stream the tap there is that
    block's complete sum of sub-layer outputs, so the taps together hold the whole residual
    stream but the embedding (for `demo`: layers 2, 5 (KDA) and 7 (MLA)). In a 4-minute trial
    this beat taps 1, 3, 6 slightly (acc_len 4.82 vs 4.71), and "attn_res" taps 1, 3, 6 tied."""
    return sorted({l for l in range(layers) if (l + 1) % block == 0} | {layers - 1})


def drafter_config(p: dict, vocab: int, target_layers: int, mask_id: int, taps: list[int],
                   stream: str) -> dict:
    n = p["draft_layers"]
    return dict(
        architectures=["DFlash2DraftModel"], model_type="qwen3", hidden_act="silu",
        hidden_size=p["hidden"], intermediate_size=p["draft_inter"], num_hidden_layers=n,
        num_attention_heads=p["draft_heads"], num_key_value_heads=p["draft_heads"],
        q_lora_rank=p["draft_q_lora"], kv_lora_rank=p["draft_kv_lora"], qk_nope_head_dim=p["draft_nope"],
        qk_rope_head_dim=p["draft_rope"], v_head_dim=p["draft_v"], vocab_size=vocab, rms_norm_eps=1e-5,
        num_target_layers=target_layers,
        layer_types=["sliding_attention"] * (n - 1) + ["full_attention"],
        is_causal=False, use_sliding_window=True, sliding_window=p["window"], rope_parameters=dict(YARN),
        max_position_embeddings=4096, torch_dtype="float32",
        dflash_config=dict(block_size=BLOCK_SIZE, attention_mode="mla", conv_kernel_size=2, conv_group_size=16,
                           selector_rank=p["selector_rank"], selector_top_k=p["selector_top_k"],
                           target_layer_ids=sorted(taps), aux_hidden_stream=stream, mask_token_id=mask_id))
