"""The round's token choice in groups of sequences (engine/choice.py) is the choice over the whole
batch at once: the same tokens, accepted drafts and logprobs for every sampling setting, logit
edits and draft schedules, on both families (float64, so "the same" is exact). TP2 with groups
== TP1 without: tests/test_kimi_engine.py::test_tp2_equals_tp1. What a group holds against the
memory plan: tests/test_sizing.py::test_the_sampler_term_is_one_group."""

from __future__ import annotations

import pytest

from dflash_batch.engine import choice
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.testing import kimi_pair
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, random_prompts
from tests.test_mixed_sampling import SETTINGS

pytestmark = pytest.mark.numerics

# Every setting of tests/test_mixed_sampling.py, with logit bias, held stop ids and logprobs
# beside them: nine sequences, so groups of 2 and 4 leave an uneven last group.
EXTRA = [dict(temperature=0.9, logit_bias=((1, 2.5), (4, -1.0)), min_tokens=6, logprobs=2),
         dict(logprobs=0), dict(temperature=1.1, top_p=0.7, logprobs=3, repetition_penalty=1.2)]


def _requests(vocab: int) -> list[Request]:
    settings = SETTINGS + EXTRA
    prompts = random_prompts([5, 31, 12, 2, 47, 9, 20, 14, 8, 26, 3][:len(settings)], vocab=vocab, seed=8)
    return [Request((str(i), 0), p, SamplingParams(max_new_tokens=10 + 4 * (i % 3), seed=700 + i,
                                                   stop_token_ids=(3,) if i % 2 else (), **s))
            for i, (p, s) in enumerate(zip(prompts, settings))]


def _decoded(engine: Engine, reqs: list[Request], drafts: int | None) -> dict:
    out = {}
    for c in engine.generate(iter(reqs), bucket(max_num_seqs=16, drafts=drafts)):
        lp = c.logprobs
        out[c.key] = (c.token_ids, c.spec.per_round, lp and (lp.token, lp.top_ids, lp.top))
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("choice")
    make_drafter(d / "drafter", 2, block_size=8, vocab=8)
    qwen3 = Engine(*load_pair(make_target(d / "target", vocab=8), d / "drafter", F64), dtype=F64)
    kimi = Engine(*kimi_pair.load_pair(*kimi_pair.make_kimi_pair(d / "kimi"), F64), dtype=F64)
    return {"qwen3": (qwen3, 8), "kimi": (kimi, kimi_pair.VOCAB)}


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
@pytest.mark.parametrize("drafts", [None, 3], ids=["whole block", "3 drafts"])
def test_groups_of_sequences_choose_what_the_whole_batch_chooses(engines, family, drafts, monkeypatch):
    engine, vocab = engines[family]
    reqs = _requests(vocab)
    whole = _decoded(engine, reqs, drafts)
    assert any(t for _, rounds, _ in whole.values() for t in rounds), "no draft accepted"
    assert sum(lp is not None for *_, lp in whole.values()) == 3
    width = 8 if drafts is None else drafts + 1
    calls, grouped = [], choice._in_groups
    monkeypatch.setattr(choice, "_in_groups", lambda *a: calls.append(a[3]) or grouped(*a))
    for per in (1, 2, 4):  # sequences a group
        monkeypatch.setattr(choice, "group_rows", lambda v, per=per: per * width)
        assert _decoded(engine, reqs, drafts) == whole, f"groups of {per}"
    assert set(calls) == {1, 2, 4}, "the rounds ran in one group"
