"""Sanity checks of the fp64 Kimi-K3 oracle (tests/kimi_reference.py) and the tiny checkpoint maker
(dflash_batch/testing/kimi.py) on their own, without the engine: layout, causality, hand-computed pieces,
routing, taps, and cross-checks against transformers' KDA core and the absorbed MLA form."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests import kimi_reference as R
from tests.test_kda import torch_function
from dflash_batch.testing.kimi import FP32_SUFFIXES, TINY_KIMI_TEXT, make_kimi_checkpoint

pytestmark = pytest.mark.numerics

IDS = [5, 17, 3, 88, 42, 9, 60, 1, 33, 70, 12, 50]
F64 = torch.float64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_kimi_checkpoint(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def ref(ckpt):
    return R.load_reference(ckpt)


@pytest.fixture(scope="module")
def full_run(ref):
    """One recorded forward with every layer tapped in both streams."""
    L = ref.cfg["num_hidden_layers"]
    record = {}
    logits, taps = R.reference_forward(ref, IDS, list(range(L)), "prefix", record=record)
    logits2, taps_ar = R.reference_forward(ref, IDS, list(range(L)), "attn_res")
    assert torch.equal(logits, logits2)
    return logits, taps, taps_ar, record


def split_taps(taps, n, H):
    return [taps[:, i * H:(i + 1) * H] for i in range(n)]


# ------------------------------------------------------------------------------------------------
# checkpoint layout


def stored(ckpt):
    out = {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            for n in sf.keys():
                out[n] = sf.get_tensor(n)
    return out


def test_checkpoint_layout(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"] and config["model_type"] == "kimi_k3"
    text = config["text_config"]
    assert text["model_type"] == "kimi_linear" and text["hidden_act"] == "situ" and not text["tie_word_embeddings"]
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] == "float"
    lac = text["linear_attn_config"]
    L, B = text["num_hidden_layers"], text["attn_res_block_size"]
    kinds = ["kda" if l + 1 in lac["kda_layers"] else "mla" for l in range(L)]
    assert kinds[-1] == "mla" and "kda" in kinds and sorted(set(lac["kda_layers"]) | set(lac["full_attn_layers"])) == list(range(1, L + 1))
    assert any(l % B == 0 and l > 0 for l in range(L)) and L % B != 0  # writes at 3, 6; last block partial
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    tensors = stored(ckpt)
    assert set(index["weight_map"]) == set(tensors)
    assert all(n.startswith("language_model.") for n in tensors)
    for n, t in tensors.items():
        if n.endswith(("weight_packed", "weight_scale")):
            assert ".experts." in n and t.dtype == torch.uint8
        elif n.endswith(FP32_SUFFIXES):
            assert t.dtype == torch.float32, n
        else:
            assert t.dtype == torch.bfloat16, n
    nh = lac["num_heads"]
    a_log = tensors["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape[0] > nh and torch.all(a_log[nh:] == 0) and torch.all(a_log[:nh] != 0)
    w1 = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"
    I, Rh = text["moe_intermediate_size"], text["routed_expert_hidden_size"]
    assert tensors[w1 + "_packed"].shape == (I, Rh // 2) and tensors[w1 + "_scale"].shape == (I, math.ceil(Rh / 32))


def test_loader_checks_names_and_shapes(tmp_path, ref):
    """The reference refuses a checkpoint that strays from §3: missing, extra or misshapen tensors."""
    assert set(ref.w) == set(R.expected_shapes(ref.cfg))
    d = make_kimi_checkpoint(tmp_path, num_shards=1)
    good = stored(d)
    p = "language_model.model.layers."
    for edit, message in ((lambda t: t.pop(p + "3.self_attn.kv_a_layernorm.weight"), "missing model.layers.3"),
                          (lambda t: t.update({p + "3.self_attn.rotary.weight": torch.zeros(1)}), "extra"),
                          (lambda t: t.update({p + "2.self_attn.o_norm.weight": torch.zeros(5)}), "shape")):
        tensors = dict(good)
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            R.load_reference(d)


def test_same_model_whatever_the_storage(tmp_path, ref):
    """MXFP4 vs bf16 experts, fp32 storage, one shard, vision tensors: the same text model."""
    base, base_taps = R.reference_forward(ref, IDS[:6], [2, 7])
    for i, kw in enumerate([dict(expert_format="bf16"), dict(dtype=torch.float32, num_shards=1),
                            dict(with_vision=True)]):
        d = make_kimi_checkpoint(tmp_path / str(i), **kw)
        logits, taps = R.reference_forward(d, IDS[:6], [2, 7])
        assert torch.equal(logits, base) and torch.equal(taps, base_taps), kw
    assert any(n.startswith("vision_tower.") for n in stored(tmp_path / "2"))


def test_a_log_padding_is_ignored(ref):
    base, _ = R.reference_forward(ref, IDS[:5], [])
    nh = ref.cfg["linear_attn_config"]["num_heads"]
    w = dict(ref.w)
    for name in [n for n in w if n.endswith("A_log")]:
        w[name] = w[name].clone()
        w[name][nh:] = 7.0
    logits, _ = R.reference_forward(R.KimiReference(ref.cfg, w), IDS[:5], [])
    assert torch.equal(logits, base)


# ------------------------------------------------------------------------------------------------
# whole model


def test_logits_are_o1_and_argmax_varies(full_run):
    logits = full_run[0]
    assert logits.shape == (len(IDS), TINY_KIMI_TEXT["vocab_size"]) and logits.dtype == F64
    assert 0.5 < float(logits.std()) < 10
    assert len(set(logits.argmax(-1).tolist())) > len(IDS) // 2
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3  # no near-ties in the argmax


@pytest.mark.parametrize("stream", ["prefix", "attn_res"])
def test_causal(ref, full_run, stream):
    L = ref.cfg["num_hidden_layers"]
    logits, taps = (full_run[0], full_run[1] if stream == "prefix" else full_run[2])
    for n in (1, 5):
        short_logits, short_taps = R.reference_forward(ref, IDS[:n], list(range(L)), stream)
        torch.testing.assert_close(short_logits, logits[:n], atol=1e-12, rtol=0)
        torch.testing.assert_close(short_taps, taps[:n], atol=1e-12, rtol=0)


def test_taps_shapes_order_and_validation(ref, full_run):
    H = ref.cfg["hidden_size"]
    _, taps, _, _ = full_run
    logits, some = R.reference_forward(ref, IDS, [7, 0, 3])  # given unsorted: ascending out
    assert some.shape == (len(IDS), 3 * H) and some.dtype == F64
    all_taps = split_taps(taps, 8, H)
    assert torch.equal(some, torch.cat([all_taps[0], all_taps[3], all_taps[7]], -1))
    assert R.reference_forward(ref, IDS[:3], [])[1].shape == (3, 0)
    for bad in ([1, 1], [8], [-1]):
        with pytest.raises(ValueError):
            R.reference_forward(ref, IDS[:3], bad)
    with pytest.raises(ValueError):
        R.reference_forward(ref, IDS[:3], [1], "residual")


def test_prefix_taps_reset_at_block_writes(ref, full_run):
    """prefix tap L = sum of (attention + FFN) outputs of layers B*floor(L/B) .. L: after a
    block-write layer it holds that layer's outputs only (no embedding, no earlier block)."""
    H, L, B = ref.cfg["hidden_size"], ref.cfg["num_hidden_layers"], ref.cfg["attn_res_block_size"]
    _, taps, _, record = full_run
    taps = split_taps(taps, L, H)
    layers = record["layers"]
    for l in range(L):
        own = layers[l]["attn_out"] + layers[l]["ffn_out"]
        expect = own if l % B == 0 else taps[l - 1] + own
        torch.testing.assert_close(taps[l], expect, atol=1e-12, rtol=0)
        assert layers[l]["n_blocks_attn"] == math.ceil(l / B)
        assert layers[l]["n_blocks_ffn"] == math.ceil(l / B) + (l % B == 0)
    # snapshots: block 0 = embedding, block k = the prefix after layer B*k - 1
    blocks = record["blocks"]
    assert len(blocks) == math.ceil(L / B)
    assert torch.equal(blocks[0], ref.w["model.embed_tokens.weight"][torch.tensor(IDS)])
    for k in range(1, len(blocks)):
        assert torch.equal(blocks[k], taps[B * k - 1])


def test_attn_res_taps(ref, full_run):
    """attn_res tap L = layer L+1's entry mix (before input_layernorm); the last = the output mix,
    and the logits are lm_head(model.norm(that))."""
    H, L, eps = ref.cfg["hidden_size"], ref.cfg["num_hidden_layers"], ref.cfg["rms_norm_eps"]
    logits, _, taps_ar, record = full_run
    taps = split_taps(taps_ar, L, H)
    for l in range(L - 1):
        assert torch.equal(taps[l], record["layers"][l + 1]["entry_mix"])
        torch.testing.assert_close(R.rms_norm(taps[l], ref.w[f"model.layers.{l + 1}.input_layernorm.weight"], eps),
                                   record["layers"][l + 1]["attn_in"], atol=1e-12, rtol=0)
    assert torch.equal(taps[L - 1], record["output_mix"])
    by_hand = R.rms_norm(taps[L - 1], ref.w["model.norm.weight"], eps) @ ref.w["lm_head.weight"].T
    torch.testing.assert_close(by_hand, logits, atol=1e-12, rtol=0)
    # layer 0 sees the embedding only: its entry mix is the embedding itself
    torch.testing.assert_close(record["layers"][0]["entry_mix"], record["blocks"][0], atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------------
# hand-checkable pieces


def test_attn_res_mix_by_hand():
    """H = 2, eps 0. Candidates (blocks first, current last) with simple RMS-normed values:
    [2, 2] -> [1, 1]; [3, -3] -> [1, -1]; [0, 5] -> [0, sqrt 2]. Score weight norm_w * proj_w =
    [1, 1] * [1, 0.5]: scores 1.5, 0.5, sqrt(2)/2."""
    b1, b2, cur = (torch.tensor([[x, y]], dtype=F64) for x, y in ((2, 2), (3, -3), (0, 5)))
    norm_w, proj_w = torch.tensor([1.0, 1.0], dtype=F64), torch.tensor([1.0, 0.5], dtype=F64)
    e = [math.exp(1.5), math.exp(0.5), math.exp(math.sqrt(2) / 2)]
    p = [x / sum(e) for x in e]
    want = [p[0] * 2 + p[1] * 3 + p[2] * 0, p[0] * 2 - p[1] * 3 + p[2] * 5]  # mix of the RAW values
    got = R.attn_res_mix(cur, [b1, b2], proj_w, norm_w, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([want], dtype=F64), atol=1e-14, rtol=0)
    # the order matters only through which vector is current: swapping candidates permutes p alike
    torch.testing.assert_close(R.attn_res_mix(b1, [b2, cur], proj_w, norm_w, 0.0), got, atol=1e-14, rtol=0)
    # two candidates, equal scores -> plain average
    a, b = torch.tensor([[1.0, 0.0]], dtype=F64), torch.tensor([[0.0, 4.0]], dtype=F64)
    ones = torch.ones(2, dtype=F64)
    torch.testing.assert_close(R.attn_res_mix(a, [b], ones, ones, 0.0), torch.tensor([[0.5, 2.0]], dtype=F64))
    # one candidate -> itself, whatever its scale
    assert torch.equal(R.attn_res_mix(3 * cur, [], proj_w, norm_w, 1e-5), 3 * cur)


def test_situ_by_hand():
    g = torch.tensor([0.0, 4.0, -4.0, 1.0, 40.0, -40.0], dtype=F64)
    u = torch.tensor([2.0, 25.0, -25.0, 0.0, 1000.0, 1.0], dtype=F64)
    got = R.situ(g, u, 4.0, 25.0)
    sig = lambda x: 1 / (1 + math.exp(-x))
    t1 = 0.7615941559557649  # tanh(1)
    want = [0.0,
            4 * t1 * sig(4) * 25 * t1,  # 2.99158... * 19.0398...
            -4 * t1 * sig(-4) * -25 * t1,
            0.0,
            4 * math.tanh(10) * sig(40) * 25 * math.tanh(40),  # both branches saturate: ~4 * 25
            -4 * sig(-40) * 25 * math.tanh(1 / 25)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), atol=1e-12, rtol=1e-12)
    assert abs(float(got[4]) - 100) < 1e-6
    assert abs(4 * t1 * sig(4) - 2.9915839) < 1e-6 and abs(25 * t1 - 19.0398539) < 1e-6


def test_router_selects_with_bias_weighs_without():
    cfg = dict(num_experts_per_token=2, moe_renormalize=True, routed_scaling_factor=1.0,
               moe_router_activation_func="sigmoid")
    gate_w = torch.eye(4, dtype=F64)
    x = torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=F64)  # logits = x
    bias = torch.tensor([0.0, 0.0, 3.0, 0.0], dtype=F64)
    ids, w, margin = R.route(x, gate_w, bias, cfg)
    s0, s2 = 1 / (1 + math.exp(-2.0)), 0.5  # the unbiased sigmoids of the chosen experts
    assert ids == [2, 0]  # expert 2 only because of the bias
    torch.testing.assert_close(w, torch.tensor([s2, s0], dtype=F64) / (s0 + s2), atol=1e-15, rtol=0)
    assert abs(margin - (s0 - 1 / (1 + math.exp(-1.0)))) < 1e-15
    ids, w, _ = R.route(x, gate_w, torch.zeros(4, dtype=F64), cfg)
    assert ids == [0, 1]
    cfg |= dict(routed_scaling_factor=2.5, moe_renormalize=False)
    ids, w, _ = R.route(x, gate_w, bias, cfg)
    torch.testing.assert_close(w, 2.5 * torch.tensor([s2, s0], dtype=F64), atol=1e-15, rtol=0)
    cfg |= dict(num_experts_per_token=1, moe_renormalize=True)  # top-1: no renormalisation (official gate)
    ids, w, _ = R.route(x, gate_w, bias, cfg)
    assert ids == [2] and w.tolist() == [2.5 * s2]


def test_mxfp4_dequant_by_hand():
    # byte 0x21: even column code 1 (0.5), odd column code 2 (1.0); 0x9F: code 15 (-6), code 9 (-0.5)
    packed = torch.tensor([[0x21, 0x9F] + [0] * 15, [0x77] * 17], dtype=torch.uint8)  # 34 columns
    scale = torch.tensor([[127, 129], [126, 120]], dtype=torch.uint8)  # x1, x4 ; x0.5, x2^-7
    w = R.dequant_mxfp4(packed, scale)
    assert w.shape == (2, 34)
    assert w[0, :4].tolist() == [0.5, 1.0, -6.0, -0.5] and w[0, 4:].abs().sum() == 0
    assert w[1, :32].tolist() == [3.0] * 32 and w[1, 32:].tolist() == [6 * 2 ** -7] * 2


def test_short_conv_matches_conv1d():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 5, generator=gen, dtype=F64), torch.randn(5, 4, generator=gen, dtype=F64)
    want = torch.nn.functional.silu(torch.nn.functional.conv1d(torch.nn.functional.pad(x.T, (3, 0)), w[:, None, :], groups=5)).T
    torch.testing.assert_close(R.short_conv_silu(x, w), want, atol=1e-13, rtol=0)


def test_kda_core_matches_transformers():
    """The delta-rule loop against transformers' (older Kimi-Linear) torch KDA core, whose recurrence
    is the same; it takes q unscaled, L2-normalizes q and k itself with use_qk_l2norm_in_kernel."""
    mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    hf = torch_function(mod.recurrent_kimi_delta_attention)
    gen = torch.Generator().manual_seed(2)
    T, nh, d = 7, 3, 8
    q, k, v, f = (torch.randn(T, nh, d, generator=gen, dtype=F64) for _ in range(4))
    g = R.kda_gate(f, 0.5 * torch.randn(nh, generator=gen, dtype=F64), -5.0)
    beta = torch.sigmoid(torch.randn(T, nh, generator=gen, dtype=F64))
    o, S = R.kda_recurrence(R.l2norm(q) * d ** -0.5, R.l2norm(k), v, g, beta)
    ho, hS = hf(q[None], k[None], v[None], g[None], beta[None], None, True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, ho[0].double(), atol=1e-5, rtol=0)  # theirs runs in float32
    torch.testing.assert_close(S, hS[0].double(), atol=1e-5, rtol=0)


def test_kda_gate_bounds():
    f = torch.tensor([[[-100.0, 0.0, 100.0]]], dtype=F64)
    g = R.kda_gate(f, torch.tensor([0.0], dtype=F64), -5.0)
    torch.testing.assert_close(g, torch.tensor([[[0.0, -2.5, -5.0]]], dtype=F64), atol=1e-12, rtol=0)


def test_mla_absorbed_form_equals_unabsorbed(ref):
    """The engine's absorbed MLA (cache rows [c_kv | k_pe], Q = [q_nope W_UK_h | q_pe], output
    latent @ W_UV_h) equals the reference's expanded form, on MLA layer 3's real weights."""
    cfg = ref.cfg
    nh, dn, dr, dv, kvr = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                            "v_head_dim", "kv_lora_rank"))
    p = ref.layer(3, "self_attn.")
    x = torch.randn(6, cfg["hidden_size"], generator=torch.Generator().manual_seed(3), dtype=F64)
    want = R.mla_attention(x, p, cfg)
    T = x.shape[0]
    q = R.linear(R.rms_norm(R.linear(x, p["q_a_proj.weight"]), p["q_a_layernorm.weight"], 1e-6),
                 p["q_b_proj.weight"]).view(T, nh, dn + dr)
    c = R.linear(x, p["kv_a_proj_with_mqa.weight"])
    rows = torch.cat([R.rms_norm(c[:, :kvr], p["kv_a_layernorm.weight"], 1e-6), c[:, kvr:]], -1)  # [T, kvr + dr]
    w = p["kv_b_proj.weight"].view(nh, dn + dv, kvr)
    w_kc, w_vc = w[:, :dn], w[:, dn:]  # [nh, dn, kvr], [nh, dv, kvr]
    Q = torch.cat([torch.einsum("thn,hnc->thc", q[..., :dn], w_kc), q[..., dn:]], -1)  # [T, nh, kvr + dr]
    scores = torch.einsum("thc,sc->hts", Q, rows) * (dn + dr) ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    lat = torch.einsum("hts,sc->thc", torch.softmax(scores, -1), rows[:, :kvr])
    out = torch.einsum("thc,hvc->thv", lat, w_vc).reshape(T, nh * dv) * torch.sigmoid(R.linear(x, p["g_proj.weight"]))
    torch.testing.assert_close(R.linear(out, p["o_proj.weight"]), want, atol=1e-12, rtol=0)
