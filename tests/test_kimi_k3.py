"""Kimi-K3 target: the engine's model against an fp64 reference written from the spec, and the
cache invariants (chunked prefill == one shot; verify + commit == token by token).

Each runs the model in float64, compared at 1e-10 of the magnitude (rounding is ~1e-15 there, so
an invariant that holds only approximately fails), and in float32 as the engine runs it,
compared at 1e-4 of the magnitude (rounding differs between CPUs and thread counts: taps of
magnitude ~14 differ by ~4e-4 between chunked and one-shot on an AMD EPYC; see tests/numerics.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_batch.engine.cache import SeqRows, build_meta
from dflash_batch.kernels import _triton
from dflash_batch.kernels import kda as fla_kda
from dflash_batch.models import kimi_k3
from dflash_batch.models.layers.kda import kda_chunked
from dflash_batch.models.loader import load_model
from tests.kimi_reference import reference_forward
from tests.numerics import assert_close
from dflash_batch.testing.kimi import make_kimi_checkpoint

pytestmark = pytest.mark.numerics

PAGE = 4
PAGES = list(range(40))[::-1]  # a scattered page table
DTYPES = [torch.float64, torch.float32]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_kimi_checkpoint(tmp_path_factory.mktemp("kimi"))


def load(checkpoint, taps=(), stream="prefix", rows=8, dtype=torch.float32):
    model = load_model(checkpoint, dtype)
    model.allocate_cache(len(PAGES) * PAGE, dtype, "cpu")
    model.allocate_state(2, 1, rows, "cpu")
    if taps:
        model.set_taps(list(taps), stream)
    return model


def forward(model, ids: list[int], start: int, stage: bool = False):
    meta = build_meta([SeqRows(PAGES, start, len(ids), start + len(ids))], PAGE, None, "cpu", [0], stage)
    return model(torch.tensor(ids), meta)


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kda_and_mla_taps(model) -> list[int]:
    layers = model.model.layers
    kda = [i for i, layer in enumerate(layers) if layer.is_kda]
    mla = [i for i, layer in enumerate(layers) if not layer.is_kda]
    assert kda and mla and not layers[-1].is_kda, "the tiny config must mix KDA and MLA, MLA last"
    return sorted({kda[1], mla[0], len(layers) - 1})


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("stream", ["prefix", "attn_res"])
def test_logits_and_taps_match_fp64_reference(checkpoint, stream, dtype):
    model = load(checkpoint, dtype=dtype)
    taps = kda_and_mla_taps(model)
    model.set_taps(taps, stream)
    ids = prompt(23, model.vocab_size)
    logits, got_taps = forward(model, ids, 0)
    want_logits, want_taps = reference_forward(checkpoint, ids, taps, stream)
    assert_close(logits.double(), want_logits, rel=1e-10 if dtype == torch.float64 else 1e-4)
    assert_close(got_taps.double(), want_taps, rel=1e-10 if dtype == torch.float64 else 1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(checkpoint, chunk, dtype):
    one = load(checkpoint, dtype=dtype)
    ids = prompt(40, one.vocab_size, seed=1)
    taps = kda_and_mla_taps(one)
    one.set_taps(taps, "prefix")
    want, want_taps = forward(one, ids, 0)
    model = load(checkpoint, taps, dtype=dtype)
    got, got_taps = [], []
    for s in range(0, len(ids), chunk):
        logits, t = forward(model, ids[s:s + chunk], s)
        got.append(logits)
        got_taps.append(t)
    assert_close(torch.cat(got), want)
    assert_close(torch.cat(got_taps), want_taps)


# The verify and replay-commit tests run again with the recurrent KDA through fla's Triton kernel
# (kernels/kda.py; on the CPU under TRITON_INTERPRET=1): float32 only, as on the GPU.
KDA_PATHS = [pytest.param((torch.float64, "torch"), id="f64"), pytest.param((torch.float32, "torch"), id="f32"),
             pytest.param((torch.float32, "fla"), id="f32-fla", marks=pytest.mark.skipif(
                 not (fla_kda.available() and _triton.available()), reason="fla-core or Triton is not installed"))]


@pytest.fixture(params=KDA_PATHS)
def kda_path(request, monkeypatch) -> torch.dtype:
    """The dtype of the case; with "fla", the model's recurrent KDA is fla's kernel."""
    dtype, path = request.param
    if path == "fla":
        monkeypatch.setattr(kimi_k3, "kda_kernels", lambda state: (fla_kda.recurrent, kda_chunked))
    return dtype


@pytest.mark.slow
def test_verify_then_commit_equals_token_by_token(checkpoint, kda_path):
    """For every accepted length n: verify 8 rows from the committed state, commit n, then the
    next forward sees exactly the state that feeding the n tokens one at a time leaves."""
    dtype = kda_path
    ref = load(checkpoint, dtype=dtype)
    ids = prompt(30, ref.vocab_size, seed=2)
    block = prompt(8, ref.vocab_size, seed=3)
    forward(ref, ids, 0)
    stepwise = []
    for j, t in enumerate(block):
        stepwise.append(forward(ref, [t], len(ids) + j)[0])
    probe = 5  # a token fed after the accepted ones: its logits depend on the whole state
    for n in range(1, 9):
        model = load(checkpoint, dtype=dtype)
        forward(model, ids, 0)
        logits, _ = forward(model, block, len(ids), stage=True)
        assert_close(logits, torch.cat(stepwise))
        model.commit(torch.tensor([0]), torch.tensor([n]))
        after, _ = forward(model, [probe], len(ids) + n)
        expect = load(checkpoint, dtype=dtype)
        forward(expect, ids + block[:n], 0)
        assert_close(after, forward(expect, [probe], len(ids) + n)[0])


def staged_states(layer, x: torch.Tensor, rows: torch.Tensor, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The commit before replay, as an oracle: a verify kept (state, conv window) after every
    row, computed one row at a time from the committed state."""
    from dflash_batch.models.layers.kda import kda_gate, kda_recurrent, l2norm, short_conv
    from dflash_batch.models.layers.dtypes import wide

    H, d = layer.heads, layer.d
    raw = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)[rows]
    weight = torch.cat([layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight])[:, 0]
    g = kda_gate(layer.f_b_proj(layer.f_a_proj(x)).view(-1, H, d), layer.A_log, layer.dt_bias, layer.lower_bound)[rows]
    beta = torch.sigmoid(wide(layer.b_proj(x)))[rows]
    conv_in, S = layer.conv_state[slot].clone(), layer.state[slot].clone()
    mixed, _ = short_conv(raw, weight, conv_in)
    q, k, v = (t.view(-1, H, d) for t in mixed.split(H * d, dim=-1))
    q, k = l2norm(q), l2norm(k)
    out = []
    for j in range(len(rows)):
        _, S = kda_recurrent(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1], beta[j:j + 1], S)
        window = torch.cat([conv_in, raw[:j + 1].T.to(conv_in.dtype)], dim=-1)
        out.append((S, window[:, -(layer.kernel - 1):]))
    return out


@pytest.mark.slow
def test_replay_commit_equals_the_staged_states(checkpoint, kda_path):
    """Two sequences verify 8 rows at once; for every pair of accepted lengths the replayed
    commit leaves each KDA layer's state and conv window the staged commit kept for that row:
    to the bit in float64, to float32 rounding in float32."""
    dtype = kda_path
    model = load_model(checkpoint, dtype)
    model.allocate_cache(len(PAGES) * PAGE, dtype, "cpu")
    model.allocate_state(3, 2, 8, "cpu")
    prompts = [prompt(11, model.vocab_size, seed=4), prompt(17, model.vocab_size, seed=5)]
    for slot, ids in enumerate(prompts):
        pages = PAGES[slot * 20:(slot + 1) * 20]
        model(torch.tensor(ids), build_meta([SeqRows(pages, 0, len(ids), len(ids))], PAGE, None, "cpu", [slot], False))
    blocks = [prompt(8, model.vocab_size, seed=6), prompt(8, model.vocab_size, seed=7)]
    seqs = [SeqRows(PAGES[s * 20:(s + 1) * 20], len(p), 8, len(p) + 8) for s, p in enumerate(prompts)]
    meta = build_meta(seqs, PAGE, None, "cpu", [0, 1], True)
    inputs = {}
    kda = [layer.self_attn for layer in model.model.layers if layer.is_kda]
    hooks = [a.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m, args[0])) for a in kda]
    model(torch.tensor(blocks[0] + blocks[1]), meta)
    for h in hooks:
        h.remove()
    staged = {a: [staged_states(a, inputs[a], meta.q_index[b][meta.q_index[b] < 16], b) for b in range(2)]
              for a in kda}
    saved = {a: (a.state.clone(), a.conv_state.clone()) for a in kda}
    for kept in [(n, 9 - n) for n in range(1, 9)]:  # every accepted length 0..7 (kept = accepted + 1)
        for a in kda:
            a.state.copy_(saved[a][0])
            a.conv_state.copy_(saved[a][1])
        model.commit(torch.tensor([0, 1]), torch.tensor(kept))
        for a in kda:
            for b in range(2):
                state, conv = staged[a][b][kept[b] - 1]
                if dtype == torch.float64:
                    assert torch.equal(a.state[b], state) and torch.equal(a.conv_state[b], conv), (kept, b)
                else:
                    assert_close(a.state[b], state, rel=1e-6)
                    assert torch.equal(a.conv_state[b], conv)
