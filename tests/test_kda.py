"""KDA core (dflash_batch/models/layers/kda.py) against transformers' KimiLinear torch KDA, a plain
fp64 loop written from the spec's recurrence, and itself across chunkings and splits.

Tolerances are absolute on inputs of magnitude ~1 (unit q/k, v ~ N(0,1), states of a few
units): 1e-6 where float64 meets float64 or one float32 formula meets another of the same
order, 2e-5 across chunkings in float32 (the chunk's triangular solve reorders sums), 1e-4
against transformers (float32, another order still), 0 where values are copied, not computed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_batch.models.layers.kda import kda_chunked, kda_gate, kda_recurrent, l2norm, short_conv

pytestmark = pytest.mark.numerics

H, K, V = 3, 16, 8  # K != V so a transposed state cannot pass


def make_inputs(*lead: int, T: int, dtype=torch.float32, seed: int = 0):
    """Realistic KDA inputs [*lead, T, H, .]: unit q/k, gate from kda_gate, beta in (0, 1), a state."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = l2norm(rand(*lead, T, H, K)), l2norm(rand(*lead, T, H, K))
    v = rand(*lead, T, H, V)
    # dt_bias around -3 keeps most decays mild (g ~ -0.2) with some strong ones, like a trained model
    g = kda_gate(rand(*lead, T, H, K), 0.5 * rand(H), 2 * rand(H * K) - 3).double()
    beta = torch.sigmoid(rand(*lead, T, H))
    state = rand(*lead, H, K, V)
    return [x.to(dtype) for x in (q, k, v, g, beta, state)]


def hf_kda():
    """transformers' torch KDA, unwrapped so an installed fla (Triton) can never stand in for it.

    Both take q, k [B, T, H, K] L2-normed unless use_qk_l2norm_in_kernel=True, NOT pre-scaled (they
    multiply q by K^-0.5 themselves); v [B, T, H, V]; g [B, T, H, K] log decay per key channel,
    applied as S *= exp(g) before the delta update; beta [B, T, H] after the sigmoid;
    initial_state [B, H, K, V] (key-major) or None; they return (o [B, T, H, V] in q's dtype,
    final state [B, H, K, V] float32 when output_final_state else None). The chunk one pads T up
    to a multiple of chunk_size (64) internally.
    """
    mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    return torch_function(mod.recurrent_kimi_delta_attention), torch_function(mod.chunk_kimi_delta_attention)


def torch_function(wrapper):
    """The torch function transformers wraps with a fallback to fla: its functools.wraps
    __wrapped__; with Hugging Face's `kernels` package installed, that wrapper is itself held in
    a module (its forward's closure) that the hub can swap."""
    held = type(wrapper).forward.__closure__ or () if isinstance(wrapper, torch.nn.Module) else ()
    for f in (wrapper, *(cell.cell_contents for cell in held)):
        if hasattr(f, "__wrapped__"):
            return f.__wrapped__
    raise AssertionError(f"no torch function found inside transformers' {wrapper!r}")


def spec_loop(q, k, v, g, beta, state):
    """The spec's recurrence (kimi_k3_target.md, 'Checked against the official code' item 4), one
    token and one head at a time: S = S*exp(g); S += k ⊗ beta(v - Sᵀk); o = Sᵀ(q K^-0.5)."""
    S = state.clone()
    o = torch.zeros(q.shape[0], H, V, dtype=q.dtype)
    for t in range(q.shape[0]):
        for h in range(H):
            S[h] = S[h] * torch.exp(g[t, h])[:, None]
            err = v[t, h] - S[h].T @ k[t, h]
            S[h] = S[h] + torch.outer(k[t, h], beta[t, h] * err)
            o[t, h] = S[h].T @ (q[t, h] / math.sqrt(K))
    return o, S


def assert_close(actual, expected, atol):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("with_state", [False, True])
def test_matches_transformers(with_state):
    hf_recurrent, hf_chunk = hf_kda()
    q, k, v, g, beta, state = make_inputs(2, T=100, seed=1)  # 100: one full and one partial chunk
    init = state if with_state else None
    ref_o, ref_s = hf_recurrent(q, k, v, g, beta, init, output_final_state=True)
    ref_co, ref_cs = hf_chunk(q, k, v, g, beta, initial_state=init, output_final_state=True)
    for o, s in (kda_recurrent(q, k, v, g, beta, init), kda_chunked(q, k, v, g, beta, init)):
        assert o.dtype == s.dtype == torch.float32
        for ro, rs in ((ref_o, ref_s), (ref_co, ref_cs)):
            assert_close(o, ro, 1e-4)
            assert_close(s, rs, 1e-4)


def test_matches_spec_loop_fp64():
    q, k, v, g, beta, state = make_inputs(T=70, dtype=torch.float64, seed=2)
    ref_o, ref_s = spec_loop(q, k, v, g, beta, state)
    for o, s in (kda_recurrent(q, k, v, g, beta, state), kda_chunked(q, k, v, g, beta, state, chunk_size=16)):
        assert o.dtype == s.dtype == torch.float64
        assert_close(o, ref_o, 1e-6)
        assert_close(s, ref_s, 1e-6)


@pytest.mark.parametrize("T", [1, 7, 64, 65, 200])
def test_chunked_equals_recurrent(T):
    q, k, v, g, beta, state = make_inputs(T=T, seed=T)
    ref_o, ref_s = kda_recurrent(q, k, v, g, beta, state)
    for chunk in (16, 64):
        o, s = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk)
        assert o.shape == (T, H, V) and s.shape == (H, K, V)
        assert_close(o, ref_o, 2e-5)
        assert_close(s, ref_s, 2e-5)


def test_chunked_saturated_decay():
    """g at the -5 floor: a 64-token chunk decays by e^-320, which must not overflow to inf/nan."""
    q, k, v, g, beta, state = make_inputs(T=130, seed=6)
    g = torch.full_like(g, -5.0)
    ref_o, ref_s = kda_recurrent(q, k, v, g, beta, state)
    o, s = kda_chunked(q, k, v, g, beta, state)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close(o, ref_o, 2e-5)
    assert_close(s, ref_s, 2e-5)


def test_zero_initial_state_is_none():
    q, k, v, g, beta, state = make_inputs(T=20, seed=3)
    zero = torch.zeros_like(state)
    for fn in (kda_recurrent, kda_chunked):
        for a, b in zip(fn(q, k, v, g, beta, None), fn(q, k, v, g, beta, zero)):
            assert_close(a, b, 0)


@pytest.mark.parametrize("split", [1, 37, 64, 100])
def test_split_prefill_equals_one_shot(split):
    """Chunked prefill passing the state == one call; so does handing the tail to the decode path."""
    q, k, v, g, beta, state = make_inputs(T=150, seed=4)
    full_o, full_s = kda_chunked(q, k, v, g, beta, state)
    head = [x[:split] for x in (q, k, v, g, beta)]
    tail = [x[split:] for x in (q, k, v, g, beta)]
    o1, s1 = kda_chunked(*head, state)
    for second in (kda_chunked, kda_recurrent):
        o2, s2 = second(*tail, s1)
        assert_close(torch.cat([o1, o2]), full_o, 2e-5)
        assert_close(s2, full_s, 2e-5)


def test_short_conv_pieces_and_conv1d():
    T, C, W = 30, 5, 4
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    ref = F.silu(F.conv1d(F.pad(x.T, (W - 1, 0)), weight[:, None, :], groups=C)).T
    one_shot, final = short_conv(x, weight, torch.zeros(C, W - 1))
    assert_close(one_shot, ref, 1e-6)
    assert_close(final, x[-(W - 1) :].T, 0)  # the last W-1 raw inputs, oldest first
    conv_state, outs = torch.zeros(C, W - 1), []
    for piece in x.split([1, 7, T - 8]):
        out, conv_state = short_conv(piece, weight, conv_state)
        outs.append(out)
    assert_close(torch.cat(outs), one_shot, 1e-6)
    assert_close(conv_state, final, 0)


def test_gate_hand_computed():
    f = torch.tensor([[1.0, -1.0], [0.5, 0.0]])  # [H=2, D=2]
    A_log = torch.tensor([0.0, math.log(2.0), 7.0])  # padded past num_heads: the 7.0 must be ignored
    dt_bias = torch.tensor([0.0, 1.0, -1.0, 0.5])
    s1 = 1 / (1 + math.exp(-1))  # sigmoid(1)
    # head 0: exp(0) * (f + dt) = [1, 0]; head 1: exp(ln 2) * (f + dt) = 2 * [-0.5, 0.5] = [-1, 1]
    expected = torch.tensor([[-5 * s1, -2.5], [-5 * (1 - s1), -5 * s1]])
    assert_close(kda_gate(f, A_log, dt_bias), expected, 1e-6)
    assert_close(kda_gate(f, A_log, dt_bias.view(2, 2), lower_bound=-1.0), expected / 5, 1e-6)


def test_l2norm_hand_computed():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    assert_close(l2norm(x), torch.tensor([[0.6, 0.8], [0.0, 0.0]]), 1e-6)


@pytest.mark.parametrize("lengths", [(5, 3, 3, 1), (4, 4, 0), (2,)])
def test_staggered_rows_equal_each_sequence_alone(lengths):
    """A ragged verify's recurrence (running: sequences longest first, step t runs the first
    running[t]): each sequence's outputs and final state are the spec's over its own rows alone;
    a sequence's rows past its length read zeros and its state is its own after its last row."""
    T = max(lengths)
    q, k, v, g, beta, state = make_inputs(len(lengths), T=T, dtype=torch.float64, seed=5)
    running = tuple(sum(n > t for n in lengths) for t in range(T))
    start = state.clone()
    o, S = kda_recurrent(q, k, v, g, beta, state, running=running)
    assert torch.equal(state, start)  # the committed state is read, never written
    for b, n in enumerate(lengths):
        ref_o, ref_s = spec_loop(q[b, :n], k[b, :n], v[b, :n], g[b, :n], beta[b, :n], state[b])
        assert_close(o[b, :n], ref_o, 1e-6)
        assert torch.count_nonzero(o[b, n:]) == 0
        assert_close(S[b], ref_s, 1e-6)
