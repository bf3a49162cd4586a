"""Kimi Delta Attention (KDA) in plain torch: gate, short conv, L2 norm and the gated delta rule.

Layouts (any leading batch dims `*B`, e.g. none for one sequence or [B] for a decode batch):
  q, k   [*B, T, H, K]   q and k already L2-normalised per head; q is NOT pre-scaled (K^-0.5 is
                         applied here, as the official model and fla/transformers do)
  v      [*B, T, H, V]
  g      [*B, T, H, K]   log-space decay per key channel, <= 0 (the output of `kda_gate`)
  beta   [*B, T, H]      write strength after the sigmoid (beta = sigmoid(b_proj(x)))
  state  [*B, H, K, V]   key-major, float32 (same as fla/transformers `[B, H, K, V]`); None = zeros
  o      [*B, T, H, V]   float32
Per token, per head (S is [K, V]):
  S = S * exp(g)[:, None]            decay along the key channel
  S = S + k ⊗ (beta * (v - Sᵀk))     delta rule, k read against the decayed S
  o = Sᵀ(q * K^-0.5)                 read from the updated S
Math runs in float32 (float64 inputs stay float64, for exactness tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from dflash_batch.kernels import kda as fla_kda
from dflash_batch.models.layers.dtypes import wide


def _init_state(state: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if state is not None:
        return state.to(k.dtype)
    return k.new_zeros(*k.shape[:-3], k.shape[-2], k.shape[-1], v.shape[-1])


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0) -> torch.Tensor:
    """Log decay g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, d])), in (lower_bound, 0).

    f is [..., H, D] (f_b_proj output split into heads); dt_bias is [H*D] or [H, D]. A_log is per
    head; the checkpoint pads it past num_heads with zeros, so only its first H entries count.
    """
    H, D = f.shape[-2:]
    a = torch.exp(wide(A_log).reshape(-1)[:H])[:, None]
    return lower_bound * torch.sigmoid(a * (wide(f) + wide(dt_bias).reshape(H, D)))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-head L2 norm over the last dim, eps inside the sqrt (as fla's kernel), in float32."""
    x = wide(x)
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over [*B, T, C] raw projections, continuing from conv_state.

    weight is [C, W]; weight[:, -1] multiplies the current token. conv_state is [*B, C, W-1]: the
    last W-1 raw inputs, oldest first (zeros for a fresh sequence), so a prompt fed in pieces
    gives exactly the one-shot result. Returns (silu(conv) in x.dtype, new conv_state).
    """
    width = weight.shape[-1]
    window = torch.cat([conv_state.transpose(-1, -2).to(x.dtype), x], dim=-2)  # [*B, W-1+T, C]
    taps = window.unfold(-2, width, 1)  # [*B, T, C, W]
    ct = torch.promote_types(x.dtype, weight.dtype)
    out = (taps.to(ct) * weight.to(ct)).sum(-1)
    new_state = window[..., window.shape[-2] - (width - 1) :, :].transpose(-1, -2)
    return F.silu(out).to(x.dtype), new_state.to(conv_state.dtype)


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor | None,
    running: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA (decode / verify). Returns (o, new_state); layouts in the module doc.
    `running` (one leading batch dim, sequences of unequal lengths sorted longest first: a ragged
    verify): step t runs only the first running[t] sequences, whose state it advances; the others
    keep theirs and read zeros there (the same state and outputs as zero rows, g = beta = 0, at
    the cost of the rows run)."""
    q, k, v, g, beta = map(wide, (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    S = _init_state(state, k, v)
    if running is not None:
        return _staggered(q, k, v, g, beta, S.clone(), running)
    out = []
    for t in range(q.shape[-3]):
        S = _step(S, q[..., t, :, :], k[..., t, :, :], v[..., t, :, :], g[..., t, :, :], beta[..., t, :])
        out.append(torch.einsum("...hk,...hkv->...hv", q[..., t, :, :], S))
    return torch.stack(out, dim=-3), S


def _step(S: torch.Tensor, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor,
          beta_t: torch.Tensor) -> torch.Tensor:
    """The state after one token: decay, then the delta rule read against the decayed state."""
    S = S * g_t[..., None].exp()
    err = v_t - torch.einsum("...hk,...hkv->...hv", k_t, S)
    return S + k_t[..., :, None] * (beta_t[..., None] * err)[..., None, :]


def _staggered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               S: torch.Tensor, running: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    for t, a in enumerate(running):
        S[:a] = _step(S[:a], q[:a, t], k[:a, t], v[:a, t], g[:a, t], beta[:a, t])
        out[:a, t] = torch.einsum("bhk,bhkv->bhv", q[:a, t], S[:a])
    return out, S


# Tokens a chunk of kda_chunked, as fla's kernels tile: a chunk's pairwise decays are [H, C, C, K],
# so on the CPU 16 ran 5-8x faster than 64 at 70-400 tokens (and 4 or 8 no faster than 16).
CHUNK = 16


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA (prefill), equal to `kda_recurrent` up to rounding; any T, last chunk may be short.

    Inside a chunk with cumulative log decay G_t (inclusive) and entry state S0, the updates
    u_t = beta_t * (v_t - (decayed S before t)ᵀ k_t) satisfy the unit lower-triangular system
      u_t + beta_t * sum_{j<t} <k_t, k_j * exp(G_t - G_j)> u_j = beta_t * (v_t - S0ᵀ(exp(G_t) * k_t))
    (the WY/UT form), so one triangular solve replaces the token loop. Then
      o_t  = S0ᵀ(exp(G_t) * q_t) + sum_{j<=t} <q_t, k_j * exp(G_t - G_j)> u_j
      S_C  = exp(G_C) * S0 + sum_j (k_j * exp(G_C - G_j)) ⊗ u_j
    Decays are taken pairwise as exp(G_t - G_j) <= 1 rather than factored into exp(G_t) / exp(G_j),
    which would overflow once a chunk's decay passes ~-88 in float32.
    """
    q, k, v, g, beta = (wide(x) for x in (q, k, v, g, beta[..., None]))
    S = _init_state(state, k, v)
    q, k, v, g, beta = (x.transpose(-3, -2) for x in (q, k, v, g, beta))  # heads first: [*B, H, T, .]
    q = q * q.shape[-1] ** -0.5
    out = []
    for s in range(0, q.shape[-2], chunk_size):
        c = slice(s, s + chunk_size)
        qc, kc, vc, bc = q[..., c, :], k[..., c, :], v[..., c, :], beta[..., c, :]
        G = g[..., c, :].cumsum(-2)
        n = G.shape[-2]
        causal = torch.ones(n, n, dtype=torch.bool, device=G.device).tril()
        # kd[t, j] = k_j * exp(G_t - G_j) for j <= t, else 0; -inf before exp avoids overflow at j > t
        decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[:, :, None], float("-inf")).exp()
        kd = decay * kc[..., None, :, :]  # [*B, H, t, j, K]
        kk, qk = (kd @ torch.stack([kc, qc], dim=-1)).unbind(-1)  # <k_t, kd[t, j]>, <q_t, kd[t, j]>
        lhs = torch.eye(n, dtype=G.dtype, device=G.device) + (bc * kk).tril(-1)
        rhs = torch.cat([bc * vc, bc * (G.exp() * kc)], dim=-1)
        sol = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
        u = sol[..., : vc.shape[-1]] - sol[..., vc.shape[-1] :] @ S
        out.append((qc * G.exp()) @ S + qk @ u)
        G_last = G[..., -1:, :]
        S = G_last.exp().transpose(-1, -2) * S + (kc * (G_last - G).exp()).transpose(-1, -2) @ u
    return torch.cat(out, dim=-2).transpose(-3, -2), S


KDAFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def kda_kernels(state: torch.Tensor) -> tuple[KDAFunction, KDAFunction]:
    """(recurrent, chunked) for a state pool like `state`: flash-linear-attention's Triton kernels
    (kernels/kda.py) on CUDA when fla is installed and the state is float32, the torch functions
    here otherwise (float64 models: the exactness tests)."""
    if state.is_cuda and state.dtype == torch.float32 and fla_kda.available():
        return _fla_recurrent, fla_kda.chunked
    return kda_recurrent, kda_chunked


def _fla_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor | None, running: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's fused kernel, which runs every row of every sequence: `running` (kda_recurrent's
    saving) is not needed for its result, the rows past a sequence's own being zeros."""
    return fla_kda.recurrent(q, k, v, g, beta, state)
