"""DFlash2 drafter with `attention_mode: "mla"` (the Kimi-K3 drafter) and its YaRN RoPE.

There is no reference implementation to run, so the oracle is an fp64 forward written below from
the spec (shared/reference/dflash_drafter_and_spec_loop.md §1.4-1.7) with plain loops. Its
attention is the un-absorbed form: every visible latent row is expanded through kv_b_proj into
per-head K_nope / V, which checks the drafter's absorbed form independently. YaRN frequencies and
cos/sin scale come from transformers' own YaRN init.

Ours runs in float32 against the float64 oracle, at 1e-4 of the magnitude; batch == alone and
TP2 == TP1 likewise (float32 rounding, tests/numerics.py); the YaRN frequencies at 1e-6 relative
(computed in float64, stored in float32).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash_batch.models.layers.linear import ParallelLMHead
from dflash_batch.models.layers.rope import (
    apply_rope_interleaved, RotaryEmbedding, rope_from_config, yarn_softmax_mscale,
)
from dflash_batch.models.loader import load_model
from tests import drafter_util
from tests.test_tp import free_port
from dflash_batch.testing.mla_drafter import (
    CONV_GROUP, CONV_TAPS, DN, DR, DV, INTER, KL, LAYERS, QL, RANK, YARN, H, mla_drafter_tensors,
)
from tests.drafter_util import (
    HIDDEN, MASK, NUM_PAGES, PAGE, TAPS, VOCAB, block_ids, load_drafter, meta_for, scattered_tables,
)
from tests.numerics import REL32, assert_close

pytestmark = pytest.mark.numerics

WINDOW, BLOCK, TOP_K = 8, 8, 4
EPS = 1e-5
YARN_UNEVEN = {**YARN, "mscale": 0.9, "mscale_all_dim": 1.3}  # cos/sin scaled too, not only softmax


def mla_config(rope: dict = YARN) -> dict:
    # The window (8) is shorter than the context (20+) but not than the block, where TokenSpeed's
    # rule (whole block visible) and the z-lab/ours symmetric non-causal window agree.
    return dict(
        architectures=["DFlash2DraftModel"], model_type="qwen3", hidden_act="silu",
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=H, num_key_value_heads=H, q_lora_rank=QL, kv_lora_rank=KL,
        qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV, vocab_size=VOCAB, rms_norm_eps=EPS,
        num_target_layers=6, layer_types=["sliding_attention"] * (LAYERS - 1) + ["full_attention"],
        is_causal=False, use_sliding_window=True, sliding_window=WINDOW, rope_parameters=rope,
        dflash_config=dict(block_size=BLOCK, attention_mode="mla", conv_kernel_size=CONV_TAPS,
                           conv_group_size=CONV_GROUP, selector_rank=RANK, selector_top_k=TOP_K,
                           target_layer_ids=TAPS, mask_token_id=MASK))


def mla_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    return mla_drafter_tensors(seed, VOCAB, len(TAPS))


def save_checkpoint(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")
    return directory


def target_weights(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN ** 0.5


def hf_yarn(rope: dict, dim: int) -> tuple[torch.Tensor, float]:
    """transformers' YaRN inv_freq and cos/sin factor for `dim` rotated features."""
    config = DeepseekV3Config(qk_rope_head_dim=dim, rope_parameters=dict(rope),
                              max_position_embeddings=rope["original_max_position_embeddings"] * int(rope["factor"]))
    return ROPE_INIT_FUNCTIONS["yarn"](config)


class Reference:
    """The drafter in fp64, one sequence at a time, recomputed from all its taps every round."""

    def __init__(self, directory: Path, embed: torch.Tensor, head: torch.Tensor):
        self.w = {k: v.double() for k, v in load_file(directory / "model.safetensors").items()}
        config = json.loads((directory / "config.json").read_text())
        rope = config["rope_parameters"]
        inv_freq, self.rope_scale = hf_yarn(rope, DR)
        self.inv_freq = inv_freq.double()
        m = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1
        self.scale = (DN + DR) ** -0.5 * m * m
        self.embed, self.head = embed.double(), head.double()

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * (x.pow(2).mean(-1, keepdim=True) + EPS).rsqrt() * self.w[name]

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.w[name].T

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, ..., DR] at positions [N]: pair i = (x[2i], x[2i+1]) turned by pos * inv_freq[i]."""
        out = torch.empty_like(x)
        for i in range(DR // 2):
            angle = positions.double() * self.inv_freq[i]
            cos, sin = angle.cos(), angle.sin()
            while cos.dim() < x.dim() - 1:
                cos, sin = cos[:, None], sin[:, None]
            a, b = x[..., 2 * i], x[..., 2 * i + 1]
            out[..., 2 * i] = self.rope_scale * (a * cos - b * sin)
            out[..., 2 * i + 1] = self.rope_scale * (b * cos + a * sin)
        return out

    def conv(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """One block: out[t] = sum_{i <= t} (base[i] + dynamic[t, i, group]) * x[t - i]."""
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for i in range(min(CONV_TAPS, t + 1)):
                out[t] += (base[i] + dynamic[t, i].repeat_interleave(CONV_GROUP)) * x[t - i]
        return out

    def attention(self, p: str, h: torch.Tensor, ctx: torch.Tensor, window: int | None) -> torch.Tensor:
        """Block rows h [B, D] at positions P..P+B-1 over the context ctx [P, D] and the block."""
        P = ctx.shape[0]
        rows = torch.cat([ctx, h])
        latent = self.linear(rows, p + "kv_a_proj_with_mqa.weight")
        c = self.rms(latent[:, :KL], p + "kv_a_layernorm.weight")
        kpe = self.rope(latent[:, KL:], torch.arange(len(rows)))
        kv = self.linear(c, p + "kv_b_proj.weight").view(len(rows), H, DN + DV)
        q = self.linear(self.rms(self.linear(h, p + "q_a_proj.weight"), p + "q_a_layernorm.weight"),
                        p + "q_b_proj.weight").view(BLOCK, H, DN + DR)
        q = torch.cat([q[..., :DN], self.rope(q[..., DN:], torch.arange(P, P + BLOCK))], dim=-1)
        out = torch.zeros(BLOCK, H, DV, dtype=torch.float64)
        for j in range(BLOCK):
            visible = [k for k in range(P + BLOCK) if k >= P or window is None or P + j - k < window]
            for head in range(H):
                keys = torch.cat([kv[visible, head, :DN], kpe[visible]], dim=-1)
                probs = torch.softmax(keys @ q[j, head] * self.scale, dim=0)
                out[j, head] = probs @ kv[visible, head, DN:]
        return self.linear(out.reshape(BLOCK, H * DV), p + "o_proj.weight")

    def conv_wrapped(self, p: str, h: torch.Tensor, sublayer) -> torch.Tensor:
        dynamic = self.linear(h, p + "kernel_projection.weight").view(BLOCK, 2, CONV_TAPS, HIDDEN // CONV_GROUP)
        h = sublayer(self.conv(h, dynamic[:, 0], self.w[p + "base_kernel"][0]))
        return self.conv(h, dynamic[:, 1], self.w[p + "base_kernel"][1])

    def draft(self, taps: torch.Tensor, anchor: int) -> torch.Tensor:
        """All taps so far [P, n*D] (positions 0..P-1) and the anchor -> final-normed hidden [B, D]."""
        ctx = self.rms(self.linear(taps.double(), "fc.weight"), "hidden_norm.weight")
        x = self.embed[block_ids(anchor, BLOCK)]
        for i in range(LAYERS):
            p = f"layers.{i}."
            window = WINDOW if i < LAYERS - 1 else None
            h = self.rms(x, p + "input_layernorm.weight")
            x = x + self.conv_wrapped(p + "attention_conv.", h,
                                      lambda h: self.attention(p + "self_attn.", h, ctx, window))
            h = self.rms(x, p + "post_attention_layernorm.weight")
            x = x + self.conv_wrapped(p + "mlp_conv.", h, lambda h: self.linear(
                F.silu(self.linear(h, p + "mlp.gate_proj.weight")) * self.linear(h, p + "mlp.up_proj.weight"),
                p + "mlp.down_proj.weight"))
        return self.rms(x, "norm.weight")

    def propose(self, hidden: torch.Tensor, anchor: int) -> list[int]:
        """Greedy walk over the top-k candidates of rows 1..B-1 with the bigram selector."""
        pred, succ = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        prev, path = anchor, []
        for row in hidden[1:]:
            unary, cands = torch.topk(row @ self.head.T, TOP_K)
            proj = self.linear(row, "candidate_selector.hidden_projection.weight")
            scores = [unary[c] + (pred[prev] * proj * succ[cands[c]]).sum() for c in range(TOP_K)]
            prev = int(cands[max(range(TOP_K), key=lambda c: scores[c])])
            path.append(prev)
        return path


@pytest.mark.parametrize("rope", [YARN, YARN_UNEVEN], ids=["fixture", "uneven_mscale"])
def test_matches_fp64_reference_over_rounds(tmp_path, rope):
    """Two sequences batched over two rounds (prompt context, then 3 accepted rows appended and the
    block re-drafted) == the fp64 reference; each sequence alone == the batch."""
    path = save_checkpoint(tmp_path, mla_config(rope), mla_tensors())
    embed_w, head_w = target_weights()
    embed, head = nn.Embedding.from_pretrained(embed_w), ParallelLMHead(HIDDEN, VOCAB)
    head.weight.data.copy_(head_w)
    ours, ref = load_drafter(path, embed, head), Reference(path, embed_w, head_w)
    tables = scattered_tables(2)
    gen = torch.Generator().manual_seed(3)
    rounds = [([20, 13], [17, 99]), ([3, 5], [42, 7])]
    taps = [[torch.randn(n, len(TAPS) * HIDDEN, generator=gen) for n in n_ctx] for n_ctx, _ in rounds]

    def run(seqs: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ours.allocate_cache(NUM_PAGES * PAGE, torch.float32, "cpu")
        starts, out = [0] * len(seqs), []
        for r, (n_ctx, anchors) in enumerate(rounds):
            ours.write_context(torch.cat([taps[r][b] for b in seqs]), meta_for(
                [torch.arange(s, s + n_ctx[b]) for s, b in zip(starts, seqs)], [tables[b] for b in seqs]))
            starts = [s + n_ctx[b] for s, b in zip(starts, seqs)]
            hidden = ours(torch.cat([block_ids(anchors[b], BLOCK) for b in seqs]),
                          meta_for([torch.arange(s, s + BLOCK) for s in starts], [tables[b] for b in seqs]))
            proposals = ours.propose(hidden.view(len(seqs), BLOCK, HIDDEN), torch.tensor([anchors[b] for b in seqs]))
            out.append((hidden, proposals))
        return out

    together = run([0, 1])
    for b in range(2):
        alone = run([b])
        for r, (n_ctx, anchors) in enumerate(rounds):
            got = together[r][0][b * BLOCK:(b + 1) * BLOCK]
            assert_close(got, alone[r][0], rel=REL32)
            want = ref.draft(torch.cat([taps[k][b] for k in range(r + 1)]), anchors[b])
            assert_close(got.double(), want, rel=REL32)
            assert together[r][1][b].tolist() == alone[r][1][0].tolist() == ref.propose(want, anchors[b])


def test_config_and_checkpoint_variants(tmp_path):
    """v4 `rope_scaling` + top-level rope_theta == v5 `rope_parameters`; an embed_tokens copy is
    ignored; a missing MLA tensor is refused by name."""
    tensors = mla_tensors()
    v5 = load_model(save_checkpoint(tmp_path / "v5", mla_config(), tensors))
    v4_config = mla_config()
    scaling = dict(v4_config.pop("rope_parameters"))
    v4_config["rope_theta"] = scaling.pop("rope_theta")
    v4_config["rope_scaling"] = {"type": scaling.pop("rope_type"), **scaling}
    with_embedding = {**tensors, "embed_tokens.weight": torch.randn(VOCAB, HIDDEN)}
    v4 = load_model(save_checkpoint(tmp_path / "v4", v4_config, with_embedding))
    assert torch.equal(v4.rotary_emb.inv_freq, v5.rotary_emb.inv_freq)
    assert v4.rotary_emb.attention_scaling == v5.rotary_emb.attention_scaling
    assert [layer.self_attn.scale for layer in v4.layers] == [layer.self_attn.scale for layer in v5.layers]
    assert v4.state_dict().keys() == v5.state_dict().keys()
    assert all(torch.equal(v4.state_dict()[k], v5.state_dict()[k]) for k in v5.state_dict())
    assert [layer.self_attn.window for layer in v5.layers] == [WINDOW, WINDOW, None]
    assert not any(layer.self_attn.causal for layer in v5.layers)

    del tensors["layers.1.self_attn.kv_b_proj.weight"]
    with pytest.raises(ValueError, match=r"missing: layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_model(save_checkpoint(tmp_path / "missing", mla_config(), tensors))


@pytest.mark.parametrize("dim", [64, 8])
@pytest.mark.parametrize("rope", [YARN, YARN_UNEVEN], ids=["fixture", "uneven_mscale"])
def test_yarn_matches_transformers(rope, dim):
    inv_freq, attention_factor = hf_yarn(rope, dim)
    ours = rope_from_config({"rope_parameters": rope}, dim)
    torch.testing.assert_close(ours.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(attention_factor, rel=1e-12)
    assert yarn_softmax_mscale({"rope_parameters": rope}) == pytest.approx(
        0.1 * rope["mscale_all_dim"] * math.log(32) + 1, rel=1e-12)
    assert yarn_softmax_mscale({"rope_theta": 1e6}) == 1.0


def test_interleaved_rotation_by_hand():
    inv_freq = torch.tensor([1.0, 0.1, 0.01])
    rotary = RotaryEmbedding(inv_freq, attention_scaling=1.5)
    positions = torch.tensor([0, 3, 7])
    x = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(0))
    got = apply_rope_interleaved(x, *rotary(positions))
    for t, pos in enumerate(positions.tolist()):
        for h in range(2):
            for i, f in enumerate(inv_freq.tolist()):
                a, b = x[t, h, 2 * i].item(), x[t, h, 2 * i + 1].item()
                cos, sin = math.cos(pos * f), math.sin(pos * f)
                assert got[t, h, 2 * i].item() == pytest.approx(1.5 * (a * cos - b * sin), abs=1e-5)
                assert got[t, h, 2 * i + 1].item() == pytest.approx(1.5 * (b * cos + a * sin), abs=1e-5)


def test_tensor_parallel_matches_single(tmp_path):
    path = save_checkpoint(tmp_path / "mla", mla_config(YARN_UNEVEN), mla_tensors())
    weights = target_weights()
    single = drafter_util.two_rounds(path, *weights)
    mp.spawn(drafter_util.run, args=(2, free_port(), [str(path)], *weights, str(tmp_path)), nprocs=2)
    for rank in range(2):
        (got,) = torch.load(tmp_path / f"rank{rank}.pt")
        for a, b in zip(got["hidden"], single["hidden"]):
            assert_close(a, b, rel=REL32)
        assert [p.tolist() for p in got["proposals"]] == [p.tolist() for p in single["proposals"]]
