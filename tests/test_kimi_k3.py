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
from dflash_batch.models.loader import load_model
from tests.kimi_reference import reference_forward
from tests.numerics import assert_close
from tests.tiny_kimi import make_kimi_checkpoint

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


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_verify_then_commit_equals_token_by_token(checkpoint, dtype):
    """For every accepted length n: verify 8 rows from the committed state, commit n, then the
    next forward sees exactly the state that feeding the n tokens one at a time leaves."""
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
