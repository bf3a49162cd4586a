"""Pipeline stages (model.pipeline_parallel_size) decode exactly what one process decodes: the
same tokens, accepted drafts in every round and logprobs, greedy and sampled, on gloo ranks split
into stages, each stage a tensor-parallel group (tests/engine_tp_worker.py). float64: the ranks
sum partial products in another order than one process does."""

from __future__ import annotations

import pytest

from tests import engine_tp_worker
from dflash_batch.testing.kimi_pair import VOCAB, make_kimi_pair
from tests.engine_util import make_drafter, make_target, random_prompts
from tests.test_tp import free_port

pytestmark = [pytest.mark.numerics, pytest.mark.no_rerun]

RUNS = {
    "greedy": dict(max_new_tokens=24),
    "sampled": dict(max_new_tokens=24, temperature=1.0, top_p=0.95),
    "logprobs": dict(max_new_tokens=12, temperature=0.8, top_k=5, logprobs=2),
}


@pytest.mark.parametrize("speculation", [True, False], ids=["speculative", "target-only"])
def test_two_stages_decode_what_one_process_does(tmp_path, speculation):
    # Qwen3 of 3 layers over 2 stages (uneven: the first holds 2, the last the head), the drafter
    # tapping layers 1 (handed on) and 2 (the last, normed).
    target, drafter = make_target(tmp_path / "target", num_hidden_layers=3), tmp_path / "drafter"
    make_drafter(drafter, 2, block_size=8)
    prompts = random_prompts([1, 37, 120], seed=6)
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, RUNS, str(tmp_path), free_port(),
                                           ranks=2, stages=2, held=[range(0, 2), range(2, 3)],
                                           speculation=speculation)


@pytest.mark.parametrize("stream", ["prefix", "attn_res"])
def test_kimi_k3_over_two_stages_decodes_what_one_process_does(tmp_path, stream):
    # 8 layers (KDA but 3 and 7, attention-residual blocks of 3) split 0-3 | 4-7: the boundary
    # carries the prefix, two blocks and tap 1; on the attn_res stream tap 3 is the mix entering
    # layer 4, taken on the second stage from what the first handed on.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream=stream, moe_intermediate_size=64)
    prompts = random_prompts([1, 37, 20], vocab=VOCAB, seed=6)
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, RUNS, str(tmp_path), free_port(),
                                           ranks=2, stages=2, held=[range(0, 4), range(4, 8)])


@pytest.mark.slow
def test_two_stages_of_two_ranks_split_the_latents_and_share_a_head(tmp_path):
    # PP2 x TP2: each stage's two ranks hold half of every layer's heads and keep every other
    # position's MLA latents; three prompts share a 70-token head (prefilled once, on both stages).
    target, drafter = make_kimi_pair(tmp_path / "pair", stream="attn_res", moe_intermediate_size=64, slices=2)
    head = random_prompts([70], vocab=VOCAB, seed=7)[0]
    prompts = [head + t for t in random_prompts([5, 1, 3], vocab=VOCAB, seed=8)]
    runs = {"greedy": RUNS["greedy"], "logprobs": RUNS["logprobs"]}
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, runs, str(tmp_path), free_port(),
                                           ranks=4, stages=2, latent_split=True, cached=[0, 70, 70],
                                           held=[range(0, 4), range(4, 8)], logprob_atol=1e-9)
