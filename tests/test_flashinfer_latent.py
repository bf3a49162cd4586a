"""The flashinfer backend's MLA path on the CPU, against the torch backend, with flashinfer's MLA
wrapper emulated from its source (tests/fake_flashinfer.py): what is ours (page and slot lists,
rings, the sliding window's edge strip and its log-sum-exp merge, per-size graph wrappers planned
before a replay) is checked here; the kernel itself only on a GPU (tests/test_gpu.py).

- attend_latent == TorchAttention.attend_latent on random latent caches: causal ragged prefill,
  non-causal blocks, sliding windows shorter and longer than the block and than the context,
  windows starting mid-page, float64 (the wrapper's float32 log-sum-exp bounds the window path).
- The tiny Kimi-K3 + DFlash2-MLA pair through the engine on this backend (rings or whole
  caches; eager rounds, and rounds replayed as a graph would be: every wrapper planned by
  plan_round before, none planned during) == the torch backend's tokens and accepted drafts."""

from __future__ import annotations

import pytest
import torch

from dflash_batch.backends.meta import AttnMeta
from dflash_batch.backends.torch_attention import TORCH
from dflash_batch.engine import engine as engine_module
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.testing import kimi_pair
from tests import fake_flashinfer
from tests.paged_layouts import scattered_meta
from tests.emulated_graphs import EmulatedGraphs
from tests.engine_util import bucket, random_prompts
from tests.numerics import assert_close

pytestmark = pytest.mark.numerics
F64 = torch.float64
KL, DR, HEADS, PAGE = 16, 8, 3, 4


@pytest.fixture()
def backend(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    from dflash_batch.backends.flashinfer_attention import FlashInferAttention

    return lambda rings=False: FlashInferAttention("cpu", latent_rings=rings, workspace_bytes=1024)


def case(seqs: list[tuple[int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
    gen = torch.Generator().manual_seed(seed)
    meta = scattered_meta(seqs, PAGE, "cpu", seed)
    cache = torch.randn(64 * PAGE, 1, KL + DR, generator=gen, dtype=F64)
    q = torch.randn(meta.num_rows, HEADS, KL + DR, generator=gen, dtype=F64)
    return q, cache, meta


@pytest.mark.parametrize("seqs, causal, window", [
    ([(37, 0), (1, 70), (9, 100), (8, 5)], True, None),   # ragged prefill chunks and a verify
    ([(8, 0), (8, 70), (8, 13), (8, 31)], False, None),   # the drafter's full layer
    ([(8, 0), (8, 70), (8, 13), (8, 31)], False, 8),      # window == block: the strip's widest
    ([(8, 3), (8, 70), (8, 13), (8, 29)], False, 21),     # starting mid-page
    ([(8, 2), (8, 5)], False, 40),                        # window > context: no strip
], ids=["prefill_causal", "draft_full", "window_8", "window_21", "window_past_context"])
def test_attend_latent_equals_torch(backend, seqs, causal, window):
    q, cache, meta = case(seqs, seed=len(seqs) + (window or 0))
    fi = backend()
    fi.plan(meta)
    got = fi.attend_latent(q, cache, KL, meta, 0.3, causal, window)
    want = TORCH.attend_latent(q, cache, KL, meta, 0.3, causal, window)
    assert got.dtype == q.dtype and got.shape == want.shape
    assert_close(got, want, rel=1e-12 if window is None else 1e-6)  # float32 log-sum-exp in the merge


def outcomes(engine: Engine, sampling: dict) -> dict:
    """Two buckets of the same batch size and different page tables (their graphs, and their
    wrappers, are captured apart), the engine and its backend kept between them."""
    got = {}
    # The smaller tables first: their wrappers hold fewer pages than the longer prompts need.
    for max_tokens, lengths in ((128, [1, 37, 5, 23, 9, 14]), (1024, [300, 7, 180, 260])):
        prompts = random_prompts(lengths, vocab=kimi_pair.VOCAB, seed=max_tokens)
        reqs = [Request((str(i), max_tokens), p, SamplingParams(max_new_tokens=6 + 3 * i, seed=i, **sampling))
                for i, p in enumerate(prompts)]
        b = bucket(max_num_seqs=4, max_tokens=max_tokens)
        got |= {c.key: (c.token_ids, c.spec.per_round) for c in engine.generate(iter(reqs), b)}
    return got


def test_a_window_shorter_than_the_block_is_refused(backend):
    q, cache, meta = case([(8, 20)], seed=0)
    fi = backend()
    fi.plan(meta)
    with pytest.raises(ValueError, match="no longer than the window"):
        fi.attend_latent(q, cache, KL, meta, 0.3, False, 7)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    # A window of 10 (the default 6 is shorter than the block): prompts and outputs pass it.
    return kimi_pair.load_pair(*kimi_pair.make_kimi_pair(tmp_path_factory.mktemp("fi_kimi"), window=10), F64)


@pytest.mark.slow
@pytest.mark.parametrize("rings, graphs", [(False, False), (True, True)], ids=["whole-eager", "rings-replayed"])
def test_kimi_pair_on_flashinfer_equals_torch(backend, kimi, monkeypatch, rings, graphs):
    sampling = dict(temperature=1.0, top_p=0.9)
    want = outcomes(Engine(*kimi, dtype=F64), sampling)
    if graphs:
        monkeypatch.setattr(engine_module, "RoundGraphs", EmulatedGraphs)
    fi = backend(rings)
    got = outcomes(Engine(*kimi, dtype=F64, attention=fi, cuda_graphs=graphs, capture_sizes=[2, 4] if graphs else None),
                   sampling)
    assert got == want
    assert any(n for _, rounds in want.values() for n in rounds), "no draft accepted"
    kinds = {(key[0], key[5]) for key in fi.wrappers}  # (forward, ring)
    assert kinds == {("prefill", False), ("verify", False), ("draft", False)} | ({("draft", True)} if rings else set())


def test_split_halves_merge_to_the_whole_on_the_emulated_wrapper():
    """The GPU check's latent-split case (tests/latent_halves.py) on the emulated wrapper: the halves,
    merged by their log-sum-exps, give the whole's attention to bf16's rounding; averaged, they do not."""
    from tests.latent_halves import split_halves_error

    merged, lse, plain = split_halves_error(fake_flashinfer.BatchMLAPagedAttentionWrapper, "cpu", graphs=False)
    assert merged < 2e-2 and lse < 1e-4 and plain > 0.1, (merged, lse, plain)
