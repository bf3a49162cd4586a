"""Kimi-K3 (text path) as a DFlash target: hybrid KDA + gated NoPE-MLA, block attention residuals,
latent MoE with SiTU. Spec: shared/reference/kimi_k3_target.md.

State a sequence keeps between forwards:
- MLA layers: one latent row [RMSNorm(c_kv) | k_pe] per token in a paged cache (no RoPE anywhere);
- KDA layers: a conv window (last kernel-1 raw q/k/v inputs) and a float32 delta-rule state, in a
  pool indexed by the sequence's state slot. A prefill forward updates the pool in place; a verify
  forward (meta.stage) leaves it alone and keeps each row's raw inputs (projections, gate, beta),
  and `commit` replays the accepted rows from the committed state: a row costs 4*H*d + H values
  instead of a [H, d, d] state (8.5 MB a sequence per rank at production size, not 434 MB).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_batch import parallel
from dflash_batch.backends.meta import AttnMeta, Stagger
from dflash_batch.kernels import moe_mxfp4, ops
from dflash_batch.kernels.moe_mxfp4 import situ
from dflash_batch.models.layers.dtypes import wide, wide_dtype
from dflash_batch.models.layers.expert_parallel import ExpertTable, sharded_experts
from dflash_batch.models.layers.kda import kda_gate, kda_kernels, l2norm, short_conv
from dflash_batch.models.layers.linear import (
    ColumnParallelLinear, ParallelLMHead, ReplicatedLinear, RowParallelLinear, VocabParallelEmbedding,
    new_param, per_rank,
)
from dflash_batch.models.layers.mxfp4 import MXFP4Experts
from dflash_batch.models.layers.norm import RMSNorm, rms_norm
from dflash_batch.models.stages import held_layers, module_bytes, staged_forward, stage_name

LORA_NORM_EPS = 1e-6  # the official q_a/kv_a LoRA norms take RMSNorm's default, not rms_norm_eps


class SituMLP(nn.Module):
    """gate/up column-parallel, down row-parallel, SiTU between (dense layer 0, shared experts);
    `whole`: every projection whole on this rank (a routed expert under expert parallelism)."""

    names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: dict, hidden: int, inter: int, reduce: bool = True, whole: bool = False):
        super().__init__()
        gate, up, down = self.names
        setattr(self, gate, ReplicatedLinear(hidden, inter) if whole else ColumnParallelLinear(hidden, inter))
        setattr(self, up, ReplicatedLinear(hidden, inter) if whole else ColumnParallelLinear(hidden, inter))
        setattr(self, down, ReplicatedLinear(inter, hidden) if whole else RowParallelLinear(inter, hidden,
                                                                                            reduce=reduce))
        self.beta = config.get("activation_situ_beta", 4.0)
        self.linear_beta = config.get("activation_situ_linear_beta", 25.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(situ(gate(x), up(x), self.beta, self.linear_beta))


class Expert(SituMLP):
    """A routed expert, in the latent width; built with reduce=False, as all experts' partial
    outputs are summed and reduced once (or whole, under expert parallelism)."""

    names = ("w1", "w3", "w2")


class DenseExperts(nn.ModuleList):
    """Routed experts stored in the compute dtype, applied one expert at a time."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # Through the module, which the plan (plan/work.py) swaps on the meta device.
        return moe_mxfp4.routed_sum(x, ids, weights, x.shape[-1], len(self), lambda e, xe: self[e](xe))


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = new_param((experts, hidden), None)
        self.e_score_correction_bias = new_param((experts,), None, torch.float32)


class LatentMoE(nn.Module):
    """Sigmoid router (bias for selection only), experts in a latent width, RMSNorm, up-projection,
    plus full-width shared experts.

    The routed experts are cut across the tensor-parallel ranks, each rank holding a slice of
    every expert; or, with config["expert_placement"] (models/layers/expert_parallel.py), whole,
    each rank holding its slots' experts, the latent rows dispatched to every data-parallel group.
    `routed_tokens` counts the (token, expert) routes of this group's rows (the placement's input)."""

    def __init__(self, config: dict, index: int):
        super().__init__()
        hidden, latent = config["hidden_size"], config["routed_expert_hidden_size"]
        self.top_k = config["num_experts_per_token"]
        self.renormalize = config.get("moe_renormalize", True)
        self.scaling = config.get("routed_scaling_factor", 1.0)
        self.gate = Router(hidden, config["num_experts"])
        self.routed_expert_down_proj = ReplicatedLinear(hidden, latent)
        self.routed_expert_up_proj = ReplicatedLinear(latent, hidden)
        self.routed_expert_norm = RMSNorm(latent, config["rms_norm_eps"])
        experts, inter = config["num_experts"], config["moe_intermediate_size"]
        placement = config.get("expert_placement")
        self.table = None if placement is None else ExpertTable(placement.of_layer(index), experts,
                                                                 parallel.expert_rank()[0])
        slots, whole = (experts, False) if placement is None else (placement.slots, True)
        if (config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
            # MXFP4 experts (quant.check_config admits no other compressed-tensors scheme) stay packed.
            self.experts = MXFP4Experts(slots, latent, inter, config.get("activation_situ_beta", 4.0),
                                        config.get("activation_situ_linear_beta", 25.0), whole)
        else:
            self.experts = DenseExperts(Expert(config, latent, inter, reduce=False, whole=whole) for _ in range(slots))
        self.register_buffer("routed_tokens", torch.zeros(experts, dtype=torch.long), persistent=False)
        shared = config.get("num_shared_experts", 0) * config["moe_intermediate_size"]
        self.shared_experts = SituMLP(config, hidden, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(F.linear(wide(x), wide(self.gate.weight)))
        ids = torch.topk(scores + wide(self.gate.e_score_correction_bias), self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.renormalize and self.top_k > 1:  # the official gate leaves a single expert's weight as is
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = (weights * self.scaling).to(x.dtype)
        # The routes counted from a stride-0 one: no [T * k] tensor (the plan's activation bound).
        self.routed_tokens.index_add_(0, ids.flatten(), self.routed_tokens.new_ones(()).expand(ids.numel()))
        routed = self.routed(self.routed_expert_down_proj(x), ids, weights)
        # The norm must see the sum over every rank's expert shards.
        out = self.routed_expert_up_proj(self.routed_expert_norm(routed))
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def routed(self, latent: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum for these rows, over every rank's experts (or expert slices)."""
        if self.table is None:
            return parallel.all_reduce(self.experts(latent, ids, weights))
        return sharded_experts(self.experts, self.table, latent, ids, weights)

    def serve(self) -> None:
        """Serve the other groups' rows in a forward this group has none for (parallel.expert_idle)."""
        weight = self.routed_expert_down_proj.weight  # [latent, hidden]: the latent's width and dtype
        none = weight.new_zeros(0, weight.shape[0])
        self.routed(none, torch.zeros(0, self.top_k, dtype=torch.long, device=weight.device),
                    weight.new_zeros(0, self.top_k))


def attn_res_mix(current: torch.Tensor, blocks: list[torch.Tensor], norm: RMSNorm,
                 proj: ReplicatedLinear) -> torch.Tensor:
    """Block attention residual: a per-token softmax mix over [block snapshots..., current]
    (current last) with score <RMSNorm(v), norm.w * proj.w>, mixing the raw values, in float32
    (kernels/attn_res.py: the torch reference, or the Triton kernel on a GPU)."""
    if not blocks:
        return current
    w = wide(norm.weight) * wide(proj.weight)[0]
    return ops.for_device(current.device).attn_res([*blocks, current], w, norm.eps)


class GatedMLA(nn.Module):
    """NoPE MLA with a sigmoid output gate, attended in the absorbed form over the latent cache."""

    def __init__(self, config: dict):
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.dn, self.dr, self.dv = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        self.kl = config["kv_lora_rank"]
        self.heads = per_rank(heads, "num_attention_heads")
        self.q_a_proj = ReplicatedLinear(hidden, config["q_lora_rank"])
        self.q_a_layernorm = RMSNorm(config["q_lora_rank"], LORA_NORM_EPS)
        self.q_b_proj = ColumnParallelLinear(config["q_lora_rank"], heads * (self.dn + self.dr))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kl + self.dr)
        self.kv_a_layernorm = RMSNorm(self.kl, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kl, heads * (self.dn + self.dv))
        self.g_proj = ColumnParallelLinear(hidden, heads * self.dv)
        self.o_proj = RowParallelLinear(heads * self.dv, hidden)
        self.scale = (self.dn + self.dr) ** -0.5
        # [slots, 1, kl + dr] on every rank, or its rows of a split (backends/latent_split.py)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(T, self.heads, self.dn + self.dr)
        latent = self.kv_a_proj_with_mqa(x)
        row = torch.cat([self.kv_a_layernorm(latent[:, :self.kl]), latent[:, self.kl:]], dim=-1)
        meta.backend.write(self.cache, meta, row[:, None, :])
        # kv_b_proj holds, per head, dn rows that expand the latent to K_nope and dv rows to V.
        w = self.kv_b_proj.weight.view(self.heads, self.dn + self.dv, self.kl)
        q_lat = torch.einsum("thd,hdk->thk", q[..., :self.dn], w[:, :self.dn])
        o_lat = meta.backend.attend_latent(torch.cat([q_lat, q[..., self.dn:]], dim=-1), self.cache, self.kl,
                                             meta, self.scale, causal=True)
        o = torch.einsum("thk,hvk->thv", o_lat, w[:, self.dn:])
        o = o * torch.sigmoid(wide(self.g_proj(x))).view(T, self.heads, self.dv).to(o.dtype)
        return self.o_proj(o.reshape(T, self.heads * self.dv))


def _in_order(stagger: Stagger | None, first: int, *per_sequence: torch.Tensor) -> tuple:
    """(the staging rows, then each of `per_sequence` [n, ...]) of a verify's sequences in the
    order a Stagger takes them, or as they come without one; `first`: where sequence 0 is staged."""
    n = len(per_sequence[0])
    if stagger is None:
        return slice(first, first + n), *per_sequence
    return first + stagger.order, *(t[stagger.order] for t in per_sequence)


def _running(stagger: Stagger | None) -> dict:
    """What a recurrent KDA function is told of a Stagger (kda_kernels: the torch loop runs only
    those rows; fla's kernel runs every row, the ones past a sequence's own being zeros)."""
    return {} if stagger is None else {"running": stagger.running}


class KDA(nn.Module):
    """Kimi Delta Attention: short conv + SiLU on q/k/v, L2-normed q/k, lower-bounded sigmoid gate,
    float32 delta rule, gated per-head RMSNorm."""

    def __init__(self, config: dict):
        super().__init__()
        lin = config["linear_attn_config"]
        hidden, heads, d = config["hidden_size"], lin["num_heads"], lin["head_dim"]
        self.heads, self.d, self.kernel = per_rank(heads, "linear_attn_config.num_heads"), d, lin["short_conv_kernel_size"]
        self.lower_bound = lin.get("gate_lower_bound", -5.0)
        if not lin.get("use_full_rank_gate", True):
            raise NotImplementedError("KDA with use_full_rank_gate=false is not supported")
        for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
            setattr(self, name, ColumnParallelLinear(hidden, heads * d))
        self.f_a_proj = ReplicatedLinear(hidden, d)
        self.f_b_proj = ColumnParallelLinear(d, heads * d)
        self.b_proj = ColumnParallelLinear(hidden, heads)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, name, nn.Module())
            getattr(self, name).weight = new_param((self.heads * d, 1, self.kernel), 0, torch.float32)
        self.A_log = new_param((self.heads,), 0, torch.float32)
        self.A_log.checkpoint_padded = True  # the checkpoint zero-pads it past num_heads
        self.dt_bias = new_param((self.heads * d,), 0, torch.float32)
        self.o_norm = RMSNorm(d, config["rms_norm_eps"])
        self.o_proj = RowParallelLinear(heads * d, hidden)
        # State pool [seqs, ...]; for verify, each row's raw inputs [seqs, rows, ...] (commit replays them).
        self.conv_state = self.state = self.staged_raw = self.staged_g = self.staged_beta = None

    def allocate(self, slots: int, batch: int, rows: int, device) -> None:
        C, H, d = 3 * self.heads * self.d, self.heads, self.d
        dtype = self.A_log.dtype  # float32 (float64 for a float64 model)
        self.conv_state = torch.zeros(slots, C, self.kernel - 1, device=device, dtype=dtype)
        self.state = torch.zeros(slots, H, d, d, device=device, dtype=dtype)
        self.allocate_staging(batch, rows, device)

    def allocate_staging(self, batch: int, rows: int, device) -> None:
        """Staging for verifies of `batch` sequences of `rows` rows each (the state is kept)."""
        C, H, d = 3 * self.heads * self.d, self.heads, self.d
        dtype = self.A_log.dtype
        self.staged_raw = torch.zeros(batch, rows, C, device=device, dtype=self.q_proj.weight.dtype)
        self.staged_g = torch.zeros(batch, rows, H, d, device=device, dtype=dtype)
        self.staged_beta = torch.zeros(batch, rows, H, device=device, dtype=dtype)

    def _conv_weight(self) -> torch.Tensor:
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]

    def _qkv(self, raw: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k (L2-normalised), v [*B, T, H, d] of raw projections [*B, T, C], and the new conv window."""
        mixed, conv_out = short_conv(raw, self._conv_weight(), conv_state)
        q, k, v = (t.unflatten(-1, (self.heads, self.d)) for t in mixed.split(self.heads * self.d, dim=-1))
        return l2norm(q), l2norm(k), v, conv_out

    def forward(self, x: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        T, H, d = x.shape[0], self.heads, self.d
        raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(T, H, d), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(wide(self.b_proj(x)))
        recurrent, chunked = kda_kernels(self.state)
        if meta.stage:
            # Verify: each sequence's rows in order, read from the committed state, which stays
            # as it is; each row's raw inputs are kept so that commit can replay the accepted
            # ones (d*d floats a row saved). Sequences of fewer rows (a ragged verify,
            # engine/row_drafts.py) are padded at their end with zero rows, which no row before
            # them reads; eagerly they are taken widest first and each runs only its own rows
            # (meta.stagger). No host sync: a round is captured as one graph.
            n, stagger = meta.state_ids.shape[0], meta.stagger
            seqs, ids, index = _in_order(stagger, meta.first_seq, meta.state_ids, meta.q_index)
            if meta.dense:
                raw, g, beta = raw.view(n, -1, raw.shape[-1]), g.view(n, -1, H, d), beta.view(n, -1, H)
            else:
                raw, g, beta = (torch.cat([t, t.new_zeros(1, *t.shape[1:])])[index] for t in (raw, g, beta))
            q, k, v, _ = self._qkv(raw, self.conv_state[ids])
            out, _ = recurrent(q, k, v, g, beta, self.state[ids], **_running(stagger))
            if meta.dense:
                out = out.reshape(T, H, d)
            else:
                out = out.new_zeros(T + 1, H, d).index_copy_(0, index.reshape(-1), out.flatten(0, 1))[:T]
            rows = raw.shape[1]
            self.staged_raw[seqs, :rows], self.staged_g[seqs, :rows], self.staged_beta[seqs, :rows] = raw, g, beta
        else:  # prefill chunks: each sequence's rows through the chunked form, state updated
            out = x.new_zeros(T, H, d, dtype=wide_dtype(x.dtype))
            for b, slot in enumerate(meta.state_ids.tolist()):
                rows = meta.q_index[b][meta.q_index[b] < T]
                q, k, v, conv_out = self._qkv(raw[rows], self.conv_state[slot])
                out[rows], self.state[slot] = chunked(q, k, v, g[rows], beta[rows], self.state[slot])
                self.conv_state[slot] = conv_out
        o = rms_norm(out, wide(self.o_norm.weight), self.o_norm.eps)
        o = o * torch.sigmoid(wide(self.g_proj(x))).view(T, H, d)
        return self.o_proj(o.reshape(T, H * d).to(x.dtype))

    def commit(self, state_ids: torch.Tensor, kept: torch.Tensor, first: int = 0, rows: int | None = None,
               stagger: Stagger | None = None) -> None:
        """After a verify: sequence b's committed state advances over its first kept[b] rows,
        replayed from their raw inputs, all sequences at once (no host sync: graph-safe). A row
        past kept[b] replays as zeros with no decay (g = 0) and no write (beta = 0): the state
        passes it unchanged (whatever the rejected row held), so one recurrent pass over every
        row serves every accepted length. `first`: where the verify staged sequence 0 (a lane's
        first row, engine/lanes.py); `rows`: the rows it staged a sequence (default all);
        `stagger`: the sequences by kept, most first (eager rounds that know kept on the host):
        each then replays only its kept rows."""
        n, rows = len(state_ids), rows or self.staged_raw.shape[1]
        staged, state_ids, kept = _in_order(stagger, first, state_ids, kept)
        raw, conv = self.staged_raw[staged, :rows], self.conv_state[state_ids]
        q, k, v, _ = self._qkv(raw, conv)
        live = torch.arange(rows, device=kept.device) < kept[:, None]  # [n, rows]
        k, v, g = (torch.where(live[:, :, None, None], t, 0) for t in (k, v, self.staged_g[staged, :rows]))
        beta = torch.where(live[:, :, None], self.staged_beta[staged, :rows], 0)
        recurrent, _ = kda_kernels(self.state)
        _, after = recurrent(q, k, v, g, beta, self.state[state_ids], **_running(stagger))
        self.state[state_ids] = after
        # The conv window after kept[b] rows: the last kernel-1 raw inputs up to there.
        window = torch.cat([conv, raw.transpose(1, 2).to(conv.dtype)], dim=-1)  # [n, C, kernel-1+rows]
        index = kept.view(n, 1, 1) + torch.arange(self.kernel - 1, device=kept.device)
        self.conv_state[state_ids] = window.gather(-1, index.expand(n, window.shape[1], -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: dict, index: int):
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.is_kda, moe = self.kind(config, index)
        self.self_attn = KDA(config) if self.is_kda else GatedMLA(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attention_res_norm = RMSNorm(hidden, eps)
        self.self_attention_res_proj = ReplicatedLinear(hidden, 1)
        self.mlp_res_norm = RMSNorm(hidden, eps)
        self.mlp_res_proj = ReplicatedLinear(hidden, 1)
        if not moe:
            self.mlp = SituMLP(config, hidden, config["intermediate_size"])
        else:
            self.block_sparse_moe = LatentMoE(config, index)
        block = config["attn_res_block_size"]
        self.is_write, self.write_idx, self.prev = index % block == 0, index // block, -(-index // block)

    @staticmethod
    def kind(config: dict, index: int) -> tuple[bool, bool]:
        """(KDA attention, else MLA; a MoE, else a dense MLP) of layer `index`."""
        kda = (index + 1) in config["linear_attn_config"]["kda_layers"]  # 1-based
        return kda, index >= config.get("first_k_dense_replace", 1) and index % config.get("moe_layer_freq", 1) == 0

    def attn_mix(self, prefix: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The attention-side mix this layer computes at its entry, before input_layernorm."""
        return attn_res_mix(prefix, blocks[:self.prev], self.self_attention_res_norm, self.self_attention_res_proj)

    def forward(self, prefix: torch.Tensor, blocks: list[torch.Tensor], meta: AttnMeta) -> torch.Tensor:
        h = self.input_layernorm(self.attn_mix(prefix, blocks))
        if self.is_write:
            blocks.append(prefix)  # snapshot: block 0 is the embedding
            prefix = None
        a = self.self_attn(h, meta)
        prefix = a if prefix is None else prefix + a
        mixed = attn_res_mix(prefix, blocks[:self.prev + self.is_write], self.mlp_res_norm, self.mlp_res_proj)
        h = self.post_attention_layernorm(mixed)
        ffn = self.mlp if hasattr(self, "mlp") else self.block_sparse_moe
        return prefix + ffn(h)


class KimiLinearModel(nn.Module):
    """The decoder; on a pipeline stage (models/stages.py) the `held` layers, the embedding on the
    first and last stage (the drafter borrows it there), the output mix and norm on the last."""

    def __init__(self, config: dict, held: range):
        super().__init__()
        hidden, eps, n = config["hidden_size"], config["rms_norm_eps"], config["num_hidden_layers"]
        if held.start == 0 or held.stop == n:
            self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], hidden)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in held)
        if held.stop == n:
            self.norm = RMSNorm(hidden, eps)
            self.output_attn_res_norm = RMSNorm(hidden, eps)
            self.output_attn_res_proj = ReplicatedLinear(hidden, 1)


class KimiK3ForConditionalGeneration(nn.Module):
    """Text path of Kimi-K3; the vision tower's weights are skipped at load."""

    def __init__(self, config: dict):
        super().__init__()
        text = config.get("text_config", config)
        if "quantization_config" in config and "quantization_config" not in text:
            text = {**text, "quantization_config": config["quantization_config"]}  # as TokenSpeed propagates it
        if config.get("expert_placement") is not None:  # build_model's, under expert parallelism
            text = {**text, "expert_placement": config["expert_placement"]}
        if text.get("hidden_act", "situ") != "situ":
            raise NotImplementedError(f"hidden_act={text['hidden_act']!r} is not supported for Kimi-K3")
        self.config = text
        self.hidden_size, self.vocab_size = text["hidden_size"], text["vocab_size"]
        self.num_layers, self.dtype = text["num_hidden_layers"], torch.get_default_dtype()
        self.expert_placement = text.get("expert_placement")  # None: routed experts cut across the ranks
        self.held = held_layers(self.num_layers, lambda: self._sizes(text))
        self.model = KimiLinearModel(text, self.held)
        if self.held.stop == self.num_layers:
            self.lm_head = ParallelLMHead(self.hidden_size, self.vocab_size)
        self.tap_ids: list[int] = []
        self.tap_stream = "prefix"

    def _sizes(self, config: dict) -> tuple[list[int], int, int]:
        """Bytes of each layer (one of each kind built), of the embedding and of the head
        (models/stages.py balances them)."""
        kinds: dict[tuple[bool, bool], int] = {}
        for i in range(self.num_layers):
            kind = DecoderLayer.kind(config, i)
            if kind not in kinds:
                kinds[kind] = module_bytes(lambda: DecoderLayer(config, i))
        table = module_bytes(lambda: VocabParallelEmbedding(self.vocab_size, self.hidden_size))
        return [kinds[DecoderLayer.kind(config, i)] for i in range(self.num_layers)], table, table

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def checkpoint_name(self, name: str) -> str | None:
        if not name.startswith("language_model."):
            return None  # vision_tower.*, mm_projector.*: the text path does not use them
        name = name.removeprefix("language_model.")
        if name.endswith("rotary_emb.inv_freq"):
            return None
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= self.num_layers:
            return None  # multi-token-prediction layers past the last decoder layer
        name = stage_name(name, self.held, self.num_layers, ("model.norm.", "model.output_attn_res_", "lm_head."))
        return name if name is None else self._expert_slot(name)

    def _expert_slot(self, name: str) -> str | None:
        """Under expert parallelism: a routed expert's tensor under the name of the slot that holds
        it here, None where another rank holds it (this rank never reads it)."""
        parts = name.split(".")
        if len(parts) < 6 or parts[3:5] != ["block_sparse_moe", "experts"] or not parts[5].isdigit():
            return name
        table = self.model.layers[int(parts[2])].block_sparse_moe.table
        if table is None:
            return name
        slot = table.checkpoint_slot(int(parts[5]))
        return None if slot is None else ".".join([*parts[:5], str(slot), *parts[6:]])

    @property
    def experts_sharded(self) -> bool:
        """The routed experts whole over every rank of every data-parallel group (lockstep forwards)."""
        return self.expert_placement is not None

    def moe_layers(self) -> dict[int, LatentMoE]:
        """This model's MoE layers by layer index."""
        return {i: layer.block_sparse_moe for i, layer in zip(self.held, self.model.layers)
                if hasattr(layer, "block_sparse_moe")}

    def serve_experts(self) -> None:
        """This group's rows are all done: serve every forward the other data-parallel groups still
        run (each MoE layer's dispatch and combine) until every group is done."""
        if self.experts_sharded:
            while parallel.expert_idle() is not None:
                for moe in self.moe_layers().values():
                    moe.serve()

    def set_taps(self, layer_ids: list[int], stream: str | None = None) -> None:
        n = self.num_layers
        if len(set(layer_ids)) != len(layer_ids) or any(not 0 <= i < n for i in layer_ids):
            raise ValueError(f"tap layer ids must be unique and in [0, {n}), got {layer_ids}")
        if (stream or "prefix") not in ("prefix", "attn_res"):
            raise ValueError(f"aux_hidden_stream must be prefix or attn_res, got {stream!r}")
        self.tap_ids, self.tap_stream = sorted(layer_ids), stream or "prefix"

    def allocate_cache(self, num_slots: int, dtype: torch.dtype, device, latent_split: int = 1) -> int:
        """The MLA layers' latent caches of `num_slots` slots (split `latent_split` ways across
        the ranks: backends/latent_split.py); returns their bytes."""
        total = 0
        for layer in self.model.layers:
            if not layer.is_kda:
                attn = layer.self_attn
                attn.cache = torch.zeros(num_slots // latent_split, 1, attn.kl + attn.dr, dtype=dtype, device=device)
                total += attn.cache.nbytes
        return total

    def allocate_state(self, slots: int, batch: int, rows: int, device) -> None:
        """Recurrent state for `slots` sequences, and staging for verifies of `batch` sequences
        of `rows` rows each."""
        for layer in self.model.layers:
            if layer.is_kda:
                layer.self_attn.allocate(slots, batch, rows, device)

    def allocate_staging(self, batch: int, rows: int, device) -> None:
        """Verify staging for `rows` rows a sequence, the recurrent states kept (a bucket that
        stops speculating goes on with one-row rounds)."""
        for layer in self.model.layers:
            if layer.is_kda:
                layer.self_attn.allocate_staging(batch, rows, device)

    def reset_state(self, slot: int) -> None:
        """Zero one sequence's recurrent state (conv window and delta-rule state) before a new
        sequence starts in that slot."""
        for pool in self.state_pools():
            pool[slot] = 0

    def copy_state(self, src: int, dst: int) -> None:
        """Start sequence slot `dst` from slot `src`'s recurrent state (a prompt prefilled once)."""
        for pool in self.state_pools():
            pool[dst] = pool[src]

    def state_pools(self) -> list[torch.Tensor]:
        """The KDA layers' recurrent-state tensors (conv windows, delta-rule states), [slots, ...] each."""
        return [t for layer in self.model.layers if layer.is_kda for t in (layer.self_attn.conv_state,
                                                                           layer.self_attn.state)]

    def save_state(self, slot: int) -> list[torch.Tensor]:
        """A copy of one sequence's recurrent state (a shared head's, at its end: engine/heads.py)."""
        return [pool[slot].clone() for pool in self.state_pools()]

    def restore_state(self, saved: list[torch.Tensor], slot: int) -> None:
        """Start sequence slot `slot` from a state save_state copied."""
        for pool, value in zip(self.state_pools(), saved, strict=True):
            pool[slot] = value

    def commit(self, state_ids: torch.Tensor, kept: torch.Tensor, first: int = 0, rows: int | None = None,
               stagger: Stagger | None = None) -> None:
        for layer in self.model.layers:
            if layer.is_kda:
                layer.self_attn.commit(state_ids, kept, first, rows, stagger)

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """input_ids [T] -> (logits for meta.logits_rows, taps [T, n_taps*hidden] | None); (None, None)
        on a pipeline stage before the last (models/stages.py)."""
        return staged_forward(self, input_ids, meta)

    def embed(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        return [self.model.embed_tokens(input_ids)]

    def _blocks(self, boundary: int) -> int:
        """Attention-residual blocks written before layer `boundary` (one at each layer whose
        index is a multiple of the block size, from layer 0)."""
        return -(-boundary // self.config["attn_res_block_size"])

    def carry_depth(self, boundary: int) -> int:
        """Tensors entering layer `boundary`: the prefix, the blocks and the taps taken before it
        (on the attn_res stream, tap L is taken entering layer L + 1)."""
        taken = boundary if self.tap_stream == "prefix" else boundary - 1
        return 1 + self._blocks(boundary) + sum(i < taken for i in self.tap_ids)

    def run_layers(self, carry: list[torch.Tensor], meta: AttnMeta) -> list[torch.Tensor]:
        nb = self._blocks(self.held.start)
        prefix, blocks, taps = carry[0], carry[1:1 + nb], carry[1 + nb:]
        if self.experts_sharded:  # every data-parallel group's forward begins together
            parallel.expert_step(prefix.shape[0])
        for i, layer in zip(self.held, self.model.layers):
            if self.tap_stream == "attn_res" and i - 1 in self.tap_ids:
                taps.append(layer.attn_mix(prefix, blocks))  # tap L = the mix entering layer L+1
            prefix = layer(prefix, blocks, meta)
            if self.tap_stream == "prefix" and i in self.tap_ids:
                taps.append(prefix)
        return [prefix, *blocks, *taps]

    def head(self, carry: list[torch.Tensor], meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        nb = self._blocks(self.num_layers)
        prefix, blocks, taps = carry[0], carry[1:1 + nb], carry[1 + nb:]
        m = self.model
        h = attn_res_mix(prefix, blocks, m.output_attn_res_norm, m.output_attn_res_proj)
        if self.tap_stream == "attn_res" and self.num_layers - 1 in self.tap_ids:
            taps.append(h)  # the output mix, before the final norm
        logits = wide(self.lm_head(self.model.norm(h)[meta.logits_rows], meta.gather_logits))
        return logits, torch.cat(taps, dim=-1) if taps else None
