"""Sampled tokens on Kimi-K3 + DFlash2-MLA follow the target's own filtered distribution,
speculative or not: the chi-square test of test_engine_sampling.py against the exact joint law of
3 new tokens from the fp64 reference."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from tests.engine_util import bucket
from tests.kimi_reference import load_reference, reference_forward
from dflash_batch.testing.kimi_pair import load_pair, make_kimi_pair
from tests.test_engine_sampling import filtered_by_definition

TOP_K, TOP_P = 5, 0.9
PROMPT = [5, 17, 3, 60, 2, 41, 9, 33, 12, 7]  # longer than the drafter's window (6)
NEW = 3
# 20k draws, as the Qwen3 engine's test (about 2 minutes: the KDA layers decode one Python loop
# per sequence); cells too rare for the chi-square approximation are pooled into one.
SAMPLES = 20_000


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # A 4-layer Kimi-K3 (KDA, KDA, MLA, MLA; AttnRes blocks cross at layer 3; MoE from layer 1)
    # halves the cost of a draw. A softer head (1.5, not 3) over 4 active tokens leaves several
    # likely tokens per step, some of them inactive ones, and the drafter still guesses the
    # sample often enough for drafts to be accepted.
    return make_kimi_pair(tmp_path_factory.mktemp("kimi_soft"), head_scale=1.5, active=4,
                          num_hidden_layers=4, linear_attn_config=dict(kda_layers=[1, 2]))


@pytest.fixture(scope="module")
def joint(pair) -> dict[tuple[int, ...], float]:
    return exact_joint(pair[0])


def exact_joint(target_dir) -> dict[tuple[int, ...], float]:
    """p(t1, t2, t3 | PROMPT) of the filtered target on its support, from the fp64 reference:
    one forward per prefix that can occur (top-k keeps at most 5 tokens a step)."""
    ref = load_reference(target_dir)

    def law(seq: list[int]) -> dict[int, float]:
        p = filtered_by_definition(reference_forward(ref, seq, [])[0][-1].tolist(), 1.0, TOP_K, TOP_P)
        return {t: x for t, x in enumerate(p) if x > 0}

    def joint(prefix: tuple[int, ...], mass: float) -> dict[tuple[int, ...], float]:
        if len(prefix) == NEW:
            return {prefix: mass}
        out = {}
        for t, x in law(PROMPT + list(prefix)).items():
            out |= joint(prefix + (t,), mass * x)
        return out

    return joint((), 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("speculation", [True, False], ids=["spec", "target_only"])
def test_sampled_tokens_follow_target_distribution(pair, joint, speculation):
    # The test means something only if the law is spread out: several likely outcomes per step.
    assert sum(p > 0.01 for p in joint.values()) >= 15, sorted(joint.values(), reverse=True)[:15]

    engine = Engine(*load_pair(*pair))
    params = (SamplingParams(temperature=1.0, top_k=TOP_K, top_p=TOP_P, max_new_tokens=NEW, seed=s)
              for s in range(SAMPLES))
    reqs = (Request((str(i), 0), PROMPT, p) for i, p in enumerate(params))
    # Blocks of 3 (anchor + 2 drafts) cover every acceptance 3 new tokens allow.
    counts, per_round = Counter(), []
    for c in engine.generate(reqs, bucket(block_size=3, max_num_seqs=256, max_tokens=16, speculation=speculation)):
        counts[tuple(c.token_ids)] += 1
        per_round += c.spec.per_round if c.spec else []
    if speculation:
        # Drafts accepted: the accept rule (not only the bonus token) shaped the sample.
        assert sum(per_round) > SAMPLES // 20, Counter(per_round)

    impossible = {k: n for k, n in counts.items() if k not in joint}
    assert not impossible, f"{sum(impossible.values())} samples that top-k/top-p exclude: {list(impossible)[:5]}"
    cells = list(joint)
    observed = torch.tensor([counts[k] for k in cells], dtype=torch.float64)
    expected = torch.tensor([joint[k] for k in cells], dtype=torch.float64) * SAMPLES
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if (~big).any():  # pool the cells too rare for the chi-square approximation into one
        obs = torch.cat([obs, observed[~big].sum()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    result = chisquare(obs.numpy(), exp.numpy() * SAMPLES / exp.sum().item())
    assert result.pvalue > 0.01, (result, int(big.sum()))
