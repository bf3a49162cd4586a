"""Pipeline stages (model.pipeline_parallel_size) decode exactly what one process decodes: the
same tokens, accepted drafts in every round and logprobs, greedy and sampled, on gloo ranks split
into stages, each stage a tensor-parallel group (tests/engine_tp_worker.py). float64: the ranks
sum partial products in another order than one process does."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import safetensors
import torch

from dflash_batch import parallel
from dflash_batch.models import loader
from dflash_batch.models.loader import load_model
from dflash_batch.models.stages import balanced_spans
from tests import engine_tp_worker
from dflash_batch.testing.kimi_pair import VOCAB, make_kimi_pair
from tests.engine_util import make_drafter, make_target, random_prompts
from tests.test_tp import free_port


RUNS = {
    "greedy": dict(max_new_tokens=24),
    "sampled": dict(max_new_tokens=24, temperature=1.0, top_p=0.95),
    "logprobs": dict(max_new_tokens=12, temperature=0.8, top_k=5, logprobs=2),
}


@pytest.mark.numerics
@pytest.mark.no_rerun
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


@pytest.mark.numerics
@pytest.mark.no_rerun
@pytest.mark.parametrize("stream", ["prefix", "attn_res"])
def test_kimi_k3_over_two_stages_decodes_what_one_process_does(tmp_path, stream):
    # 8 layers (KDA but 3 and 7, attention-residual blocks of 3) split 0-3 | 4-7: the boundary
    # carries the prefix, two blocks and tap 1; on the attn_res stream tap 3 is the mix entering
    # layer 4, taken on the second stage from what the first handed on.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream=stream, moe_intermediate_size=64)
    prompts = random_prompts([1, 37, 20], vocab=VOCAB, seed=6)
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, RUNS, str(tmp_path), free_port(),
                                           ranks=2, stages=2, held=[range(0, 4), range(4, 8)])


@pytest.mark.numerics
@pytest.mark.no_rerun
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


def test_balanced_spans_are_the_best_contiguous_split():
    """Against every contiguous split: the least largest stage (embedding on the first and last,
    head on the last), each stage holding a layer."""
    rng = random.Random(0)
    for _ in range(200):
        n, stages = rng.randint(1, 9), rng.randint(1, 4)
        if stages > n:
            with pytest.raises(ValueError, match="do not split"):
                balanced_spans([1.0] * n, stages)
            continue
        costs = [float(rng.randint(1, 9)) for _ in range(n)]
        first, last = float(rng.randint(0, 5)), float(rng.randint(0, 9))

        def worst(cuts: tuple[int, ...]) -> float:
            bounds = [0, *cuts, n]
            return max(sum(costs[a:b]) + (first if s == 0 else 0) + (last if s == stages - 1 else 0)
                       for s, (a, b) in enumerate(zip(bounds, bounds[1:])))

        best = min(worst(c) for c in itertools.combinations(range(1, n), stages - 1))
        spans = balanced_spans(costs, stages, first, last)
        assert [s.start for s in spans[1:]] == [s.stop for s in spans[:-1]] and spans[0].start == 0
        assert spans[-1].stop == n and all(len(s) for s in spans)
        assert worst(tuple(s.start for s in spans[1:])) == best


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_a_stage_reads_only_its_own_tensors(tmp_path, monkeypatch, family):
    """Each stage reads from the safetensors files only the tensors of the layers it holds (the
    embedding on the first and last stage, the final norm and head on the last), and they are the
    whole model's."""
    if family == "qwen3":
        path = make_target(tmp_path / "t", num_hidden_layers=3)
    else:
        path, _ = make_kimi_pair(tmp_path / "pair", moe_intermediate_size=64)
    whole = load_model(path, torch.float64).state_dict()
    read: list[str] = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.opened = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_slice(self, name):
            read.append(name)
            return self.opened.get_slice(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    layers = json.loads((path / "config.json").read_text()).get("text_config", {}).get("num_hidden_layers") \
        or json.loads((path / "config.json").read_text())["num_hidden_layers"]
    held_by = []
    for stage in range(2):
        monkeypatch.setattr(parallel, "stage", lambda stage=stage: (stage, 2))
        read.clear()
        model = load_model(path, torch.float64)
        held_by.append(model.held)
        names = [re.sub(r"^language_model\.", "", n) for n in read]
        in_layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert in_layers == set(model.held), (stage, sorted(in_layers))
        assert any(n.startswith("model.embed_tokens.") for n in names)
        assert any(n.startswith("lm_head.") for n in names) == (stage == 1)
        for name, value in model.state_dict().items():  # the stage's tensors are the whole model's
            if name.startswith("model.layers."):
                i = int(name.split(".")[2]) + model.held.start
                name = f"model.layers.{i}." + name.split(".", 3)[3]
            torch.testing.assert_close(value, whole[name], rtol=0, atol=0)
    assert held_by[0].stop == held_by[1].start and held_by[1].stop == layers and held_by[0].start == 0
