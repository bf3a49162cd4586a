"""End to end against the z-lab reference `dflash.model.dflash_generate` at temperature 0:
identical tokens and identical accepted length in every round, DFlash v1 and DFlash2.

Both sides run in float64 (the reference's modules converted with `.double()`): the two sum in
different orders, and in float32 a near-tie in the logits could resolve two ways on some CPU,
which is rounding, not a difference in the algorithm."""

from __future__ import annotations

import time

import pytest
import torch

import dflash.model as zl
from dflash_batch.engine.engine import Engine
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, random_prompts, run
from tests.tiny_models import load_hf_model

pytestmark = pytest.mark.numerics

MAX_NEW = 40
LENGTHS = [1, 5, 37, 300]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target"))


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("version", [1, 2])
def test_matches_dflash_generate(tmp_path, monkeypatch, target_dir, version, block_size, sliding):
    monkeypatch.setattr(zl, "_cuda_time", time.perf_counter)  # its timer calls cuda.synchronize
    ref_drafter = make_drafter(tmp_path / "drafter", version, sliding=sliding, is_causal=False).double()
    ref_target = load_hf_model(target_dir).double()
    target, drafter = load_pair(target_dir, tmp_path / "drafter", F64)
    engine = Engine(target, drafter, dtype=F64)
    prompts = random_prompts(LENGTHS, seed=version * 10 + block_size)
    ours = run(engine, prompts, bucket(block_size=block_size, max_num_seqs=3), max_new_tokens=MAX_NEW)
    accepted_some = False
    for prompt, got in zip(prompts, ours):
        ref = zl.dflash_generate(ref_drafter, ref_target, torch.tensor([prompt]), MAX_NEW, None,
                                 temperature=0.0, block_size=block_size, return_stats=True)
        assert got.token_ids == ref.output_ids[0, len(prompt):].tolist()
        # the reference records tokens produced per round: accepted drafts + 1, cut at the end
        assert [n + 1 for n in got.spec.per_round] == ref.acceptance_lengths
        accepted_some |= any(got.spec.per_round)
    assert accepted_some, "no round accepted a draft: the comparison would not cover acceptance"


def test_causal_sliding_drafter_matches_reference(tmp_path, monkeypatch, target_dir):
    """is_causal: true (the reference's default for sliding layers) is honoured too."""
    monkeypatch.setattr(zl, "_cuda_time", time.perf_counter)
    ref_drafter = make_drafter(tmp_path / "drafter", 2, sliding=True, is_causal=True, window=12).double()
    ref_target = load_hf_model(target_dir).double()
    engine = Engine(*load_pair(target_dir, tmp_path / "drafter", F64), dtype=F64)
    prompts = random_prompts([9, 64], seed=5)
    for prompt, got in zip(prompts, run(engine, prompts, bucket(), max_new_tokens=MAX_NEW)):
        ref = zl.dflash_generate(ref_drafter, ref_target, torch.tensor([prompt]), MAX_NEW, None,
                                 temperature=0.0, return_stats=True)
        assert got.token_ids == ref.output_ids[0, len(prompt):].tolist()
        assert [n + 1 for n in got.spec.per_round] == ref.acceptance_lengths


def test_stop_tokens_match_reference(tmp_path, monkeypatch, target_dir):
    monkeypatch.setattr(zl, "_cuda_time", time.perf_counter)
    ref_drafter = make_drafter(tmp_path / "drafter", 1).double()
    ref_target = load_hf_model(target_dir).double()
    engine = Engine(*load_pair(target_dir, tmp_path / "drafter", F64), dtype=F64)
    prompts = random_prompts([3, 17, 50], seed=9)
    stops = (3, 7)
    for prompt, got in zip(prompts, run(engine, prompts, bucket(), max_new_tokens=MAX_NEW,
                                        stop_token_ids=stops)):
        ref = zl.dflash_generate(ref_drafter, ref_target, torch.tensor([prompt]), MAX_NEW, list(stops),
                                 temperature=0.0, return_stats=True)
        assert got.token_ids == ref.output_ids[0, len(prompt):].tolist()
        assert [n + 1 for n in got.spec.per_round] == ref.acceptance_lengths
        assert got.finish_reason == ("stop" if got.token_ids[-1] in stops else "length")
