"""Qwen3 dense decoder as a DFlash target: paged-KV forward that also returns tapped hidden states.

Module names mirror the Hugging Face checkpoint (`model.layers.{i}.self_attn.o_proj`, ...) so the
loader maps tensors 1:1, except q|k|v and gate|up, each one matmul here (MergedColumnLinear) and
loaded from their separate checkpoint tensors. Rows of all sequences in a step are packed into one [T, ...] batch;
`AttnMeta` says which rows belong to which sequence and where their K/V live in the paged cache.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_batch.backends.meta import AttnMeta
from dflash_batch.models.layers.activation import silu_and_mul
from dflash_batch.models.layers.dtypes import wide
from dflash_batch.models.layers.linear import (
    MergedColumnLinear,
    ParallelLMHead,
    per_rank,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from dflash_batch.models.layers.norm import RMSNorm, rms_norm
from dflash_batch.models.layers.rope import apply_rope, rope_from_config
from dflash_batch.models.stages import held_layers, module_bytes, staged_forward, stage_name


class Qwen3Attention(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        kv_heads = config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // heads
        self.num_heads = per_rank(heads, "num_attention_heads")
        self.num_kv_heads = per_rank(kv_heads, "num_key_value_heads")
        self.scale = self.head_dim ** -0.5
        bias = bool(config.get("attention_bias", False))
        eps = config["rms_norm_eps"]
        self.qkv_proj = MergedColumnLinear(hidden, {"q_proj": heads * self.head_dim, "k_proj": kv_heads * self.head_dim,
                                                    "v_proj": kv_heads * self.head_dim}, bias)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias)
        # Qwen3 normalises each head's q and k (over head_dim) before RoPE.
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        # Plain attributes, not buffers: the cache is runtime state, not part of the checkpoint.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        T, H, K = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, H + 2 * K, self.head_dim)
        # One norm and one rotation over the q|k heads, each head with its own side's weight.
        weight = torch.cat([self.q_norm.weight.expand(H, -1), self.k_norm.weight.expand(K, -1)])
        qk = apply_rope(rms_norm(qkv[:, :H + K], weight, self.q_norm.eps), cos, sin)
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + K:]
        attention = meta.backend
        attention.write(self.k_cache, meta, k)
        attention.write(self.v_cache, meta, v)
        o = attention.attend(q, self.k_cache, self.v_cache, meta, self.scale, causal=True)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        self.gate_up_proj = MergedColumnLinear(hidden, {"gate_proj": inter, "up_proj": inter})
        self.down_proj = RowParallelLinear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        eps = config["rms_norm_eps"]
        self.self_attn = Qwen3Attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    """Holds the `model.` part of the checkpoint names; Qwen3ForCausalLM.forward drives it. On a
    pipeline stage (models/stages.py): the `held` layers, the embedding on the first and last
    stage (the drafter borrows it there), the final norm on the last."""

    def __init__(self, config: dict, held: range):
        super().__init__()
        n = config["num_hidden_layers"]
        if held.start == 0 or held.stop == n:
            self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config) for _ in held)
        if held.stop == n:
            self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        if config.get("use_sliding_window"):
            raise NotImplementedError("Qwen3 with use_sliding_window=true is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act={config['hidden_act']!r} is not supported")
        self.config = config
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        self.rotary_emb = rope_from_config(config, head_dim)
        self.tap_ids: list[int] = []
        self.tap_stream = "residual"
        self.hidden_size: int = config["hidden_size"]
        self.vocab_size: int = config["vocab_size"]
        self.num_layers: int = config["num_hidden_layers"]
        self.dtype = torch.get_default_dtype()
        self.held = held_layers(self.num_layers, lambda: self._sizes(config))
        self.model = Qwen3Model(config, self.held)
        if self.held.stop < self.num_layers:  # a stage before the last: no head
            return
        self.lm_head = ParallelLMHead(self.hidden_size, self.vocab_size)
        if config.get("tie_word_embeddings", False):
            # Embedding and head are cut the same way (vocab rows), so one shared parameter
            # serves both; the loader fills it from model.embed_tokens.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

    def _sizes(self, config: dict) -> tuple[list[int], int, int]:
        """Bytes of each layer, of the embedding and of the head (models/stages.py balances them)."""
        table = module_bytes(lambda: VocabParallelEmbedding(self.vocab_size, self.hidden_size))
        return [module_bytes(lambda: Qwen3DecoderLayer(config))] * self.num_layers, table, table

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def checkpoint_name(self, name: str) -> str | None:
        # With tied embeddings the head has no tensor of its own; a stored copy is redundant.
        if name == "lm_head.weight" and self.config.get("tie_word_embeddings", False):
            return None
        return stage_name(name, self.held, self.num_layers, ("model.norm.", "lm_head."))

    def allocate_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> int:
        """K and V caches of `num_slots` slots in every layer; returns their bytes."""
        for layer in self.model.layers:
            attn = layer.self_attn
            shape = (num_slots, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        return 2 * len(self.model.layers) * attn.k_cache.nbytes

    def set_taps(self, layer_ids: list[int], stream: str | None = None) -> None:
        """Taps are the residual stream after each layer (transformers' hidden_states[L+1])."""
        if stream not in (None, "residual"):
            raise ValueError(f"aux_hidden_stream {stream!r} is not available on Qwen3 (residual only)")
        n = self.num_layers
        if len(set(layer_ids)) != len(layer_ids) or any(not 0 <= i < n for i in layer_ids):
            raise ValueError(f"tap layer ids must be unique and in [0, {n}), got {layer_ids}")
        self.tap_ids = sorted(layer_ids)

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """input_ids [T] -> (logits [R, vocab] float32 for meta.logits_rows, taps [T, n_taps*hidden] | None);
        (None, None) on a pipeline stage before the last (models/stages.py)."""
        if self.model.layers[0].self_attn.k_cache is None:
            raise RuntimeError("allocate_cache() must be called before forward()")
        return staged_forward(self, input_ids, meta)

    def embed(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        return [self.model.embed_tokens(input_ids)]

    def carry_depth(self, boundary: int) -> int:
        """Tensors entering layer `boundary`: the residual stream and the taps before it."""
        return 1 + sum(i < boundary for i in self.tap_ids)

    def run_layers(self, carry: list[torch.Tensor], meta: AttnMeta) -> list[torch.Tensor]:
        h, taps = carry[0], carry[1:]
        cos, sin = self.rotary_emb(meta.positions)
        for i, layer in zip(self.held, self.model.layers):
            h = layer(h, cos, sin, meta)
            if i in self.tap_ids:
                taps.append(h)
        return [h, *taps]

    def head(self, carry: list[torch.Tensor], meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, taps = self.model.norm(carry[0]), carry[1:]
        # transformers 5.x reports hidden_states[-1] (the last layer's output) AFTER the final
        # norm (capture_outputs swaps in last_hidden_state), and DFlash drafters are trained on
        # those features, so a tap on the last layer takes the normed stream too.
        if self.tap_ids and self.tap_ids[-1] == self.num_layers - 1:
            taps[-1] = h
        logits = wide(self.lm_head(h[meta.logits_rows], meta.gather_logits))
        return logits, torch.cat(taps, dim=-1) if taps else None
