"""The speculation schedule (engine/schedule.py): a round may verify any k of the block's drafts
and stays lossless (greedy == target-only greedy at every k and with k changing from round to
round, both families, float64; sampled rows == target-only's at the same coins); the expected
tokens and the decision against brute force from their definitions; auto picks the whole block
where every draft is accepted and turns the drafter off where none is; the job file and the
stats carry it."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from dflash_batch.engine import schedule as schedule_module
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.schedule import Acceptance, Schedule
from dflash_batch.job import JobError, parse_job
from dflash_batch.plan.buckets import Bucket
from dflash_batch.testing import kimi_pair
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, pair_of_each_family, random_prompts, run

LENGTHS = [40, 3, 90, 17, 60, 8]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return pair_of_each_family(tmp_path_factory.mktemp("schedule"))


def vocab_of(family: str) -> int:
    return kimi_pair.VOCAB if family == "kimi" else 8


def target_only(target, prompts, **params):
    return run(Engine(target, None, dtype=F64), prompts, bucket(max_num_seqs=3, max_tokens=256), **params)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_greedy_equals_target_only_at_every_k(pairs, family):
    target, drafter = pairs[family]
    prompts = random_prompts(LENGTHS, vocab=vocab_of(family), seed=4)
    want = [c.token_ids for c in target_only(target, prompts, max_new_tokens=24)]
    engine = Engine(target, drafter, dtype=F64)
    for k in range(8):
        got = run(engine, prompts, bucket(max_num_seqs=3, max_tokens=256, drafts=k), max_new_tokens=24)
        assert [c.token_ids for c in got] == want, k
        kept = [n for c in got for n in c.spec.per_round]
        assert max(kept) <= k and (k == 0 or max(kept) > 0), (k, kept)


CYCLE = [7, 2, 0, 5, 1, 3, 6, 4]  # k of round i: CYCLE[i % 8]


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_k_changing_from_round_to_round_changes_no_token(pairs, family, monkeypatch):
    """Greedy and sampled (the same coins as target-only), sequences joining and leaving."""
    monkeypatch.setattr(schedule_module.Schedule, "plan", lambda self, n: CYCLE[self.total_rounds % 8])
    monkeypatch.setattr(schedule_module.Schedule, "why_stop", lambda *args: None)  # auto, never off
    target, drafter = pairs[family]
    prompts = random_prompts(LENGTHS, vocab=vocab_of(family), seed=5)
    for params in (dict(max_new_tokens=24), dict(max_new_tokens=24, temperature=1.0, top_p=0.9)):
        want = [c.token_ids for c in target_only(target, prompts, **params)]
        engine = Engine(target, drafter, dtype=F64)
        got = run(engine, prompts, bucket(max_num_seqs=3, max_tokens=256, speculation="auto"), **params)
        assert [c.token_ids for c in got] == want, params
        record = engine.schedules["0-256"]
        assert len(record.changes) == record.total_rounds > 8  # k changed every round


def test_expected_tokens_are_the_definition():
    """E(k) = 1 + sum_j P(first j accepted), from per-position rates over each position's trials;
    against rounds drawn from a known law and counted by brute force."""
    acc = Acceptance(drafts=4, window=10_000)
    law = [0.9, 0.7, 0.5, 0.2]  # P(draft j accepted | the ones before were)
    rounds = []
    for i in range(2000):  # deterministic: accepted a with frequency of the law
        a = 0
        while a < 4 and (i * 0.6180339887 * (a + 1)) % 1 < law[a]:
            a += 1
        rounds.append(a)
    for k, a in zip(itertools.cycle([4, 4, 2, 3]), rounds):
        acc.record([min(a, k)], [k])
    for k in range(5):
        # Brute force: each position's rate from the rounds that tried it.
        chain, want = 1.0, 1.0
        for j in range(1, k + 1):
            tried = [min(a, kk) for kk, a in zip(itertools.cycle([4, 4, 2, 3]), rounds) if kk >= j and min(a, kk) >= j - 1]
            chain *= sum(x >= j for x in tried) / len(tried)
            want += chain
        assert math.isclose(acc.expected_tokens(k), want, rel_tol=1e-12), k


def test_each_positions_window_slides():
    """The rates follow the last `window` trials of each position: 50 rounds accepting every
    draft, then 8 accepting none, and the first position's rate is 0 (a window that never slid
    would still say 50/58), while the later positions keep what they last saw."""
    acc = Acceptance(drafts=3, window=8)
    for _ in range(50):
        acc.record([3], [3])
    for _ in range(8):
        acc.record([0], [3])
    assert acc.rates() == [0.0, 1.0, 1.0]
    assert acc.expected_tokens(3) == 1.0


def test_a_window_of_whole_rounds_keeps_the_last_trials_one_by_one():
    """Rounds of many sequences recorded at once: each position's rate is that of its last
    `window` trials, as a list of single trials says (a round's hits taken as its oldest)."""
    rng = random.Random(0)
    acc, window = Acceptance(drafts=5, window=12), 12
    trials = [[] for _ in range(5)]  # the oracle: position j's trials, oldest first
    for _ in range(300):
        k = rng.randint(1, 5)
        accepted = [min(rng.choice([0, 0, 1, 2, 5, 5]), k) for _ in range(rng.randint(1, 9))]
        acc.record(accepted, [k] * len(accepted))
        for j in range(k):
            tried = [a for a in accepted if a >= j]
            trials[j] += sorted((int(a > j) for a in tried), reverse=True)
        # A position never tried has no rate (None); pytest.approx takes no None inside a list
        # from pytest 9.2 on, so each rate is compared alone.
        want = [pytest.approx(sum(t[-window:]) / len(t[-window:]), rel=1e-12) if t else None for t in trials]
        assert acc.rates() == want
        assert acc.samples == min(len(trials[0]), window)


def test_the_decision_is_the_best_rate_by_brute_force():
    s = Schedule(block=4, sizes=[1, 8, 64], window=1000, pinned=None)
    times = {1: [1.0, 1.1, 1.2, 1.3], 8: [2.0, 2.6, 3.2, 3.8], 64: [8.0, 17.0, 20.0, 24.0]}
    s.time_rounds(lambda size, width: times[size][width - 1])
    assert s.drafts(5) == 3  # exploring: the whole block until EXPLORE sequence-rounds
    for _ in range(40):
        s.acceptance.record([1], [3])  # every first draft accepted, no second
    for n, size in ((1, 1), (5, 8), (40, 64), (64, 64)):
        best = max(range(4), key=lambda k: s.acceptance.expected_tokens(k) / times[size][k])
        assert s.drafts(n) == best
    assert [s.drafts(n) for n in (1, 8, 64)] == [1, 1, 0]  # 2/1.1 > 1/1; 2/2.6 > 1/2; 2/17 < 1/8
    assert not s.pays_nowhere()


def test_a_rounds_own_time_moves_its_batch_sizes_costs():
    s = Schedule(block=2, sizes=[4], window=100, pinned=None)
    s.time_rounds(lambda size, width: [1.0, 1.5][width - 1])
    for _ in range(30):
        s.record(4, 1, 2.5, [], [])  # the rounds that run take a second longer than the table
    assert s.cost(4, 1) == pytest.approx(2.5, rel=1e-3) and s.cost(4, 0) == pytest.approx(2.0, rel=1e-3)


@pytest.mark.numerics
def test_auto_verifies_the_whole_block_where_every_draft_is_accepted(constant_pair):
    """The constant-head twin: every round accepts its 7 drafts and auto keeps k = 7."""
    engine = Engine(*constant_pair, dtype=F64)
    got = run(engine, random_prompts(LENGTHS, seed=2), bucket(max_num_seqs=3, max_tokens=256, speculation="auto"),
              max_new_tokens=40)
    assert all(t == 0 for c in got for t in c.token_ids)
    record = engine.schedules["0-256"].stats()
    assert record["acceptance_by_position"] == [1.0] * 7
    assert set(itertools.chain(*(by for by in record["rounds_by_k"].values()))) == {"7"}


@pytest.fixture(scope="module")
def constant_pair(tmp_path_factory):
    """The constant-head twin: the target's head is zero, so it always picks token 0 and so does
    the drafter, which borrows the head."""
    from safetensors.torch import load_file, save_file
    d = tmp_path_factory.mktemp("const")
    target_dir = make_target(d / "const")
    weights = load_file(target_dir / "model.safetensors")
    weights["lm_head.weight"].zero_()
    save_file(weights, target_dir / "model.safetensors", metadata={"format": "pt"})
    make_drafter(d / "drafter", 1)  # v1 drafts the argmax (v2's selector breaks the tie its own way)
    return load_pair(target_dir, d / "drafter", F64)


@pytest.mark.numerics
@pytest.mark.parametrize("k", [2, 7])
@pytest.mark.parametrize("agree", [True, False])
def test_a_rows_record_counts_the_drafts_its_rounds_verified(constant_pair, k, agree):
    """With k drafts pinned, every round verifies k; the round that ends a sample counts the
    drafts up to its last token. Where the drafter always agrees (the constant-head twin) every
    verified draft is accepted, the last round cut by max_new_tokens inside its drafts too: the
    proposal acceptance is exactly 1. Where it never agrees (the target's token 0, which the
    drafter always proposes, biased away), the last round's one token is the target's own after
    rejecting d_1: k a round, 1 in the last, none accepted."""
    engine = Engine(*constant_pair, dtype=F64)
    bias = {} if agree else {"logit_bias": ((0, -100.0),)}
    got = run(engine, random_prompts(LENGTHS, seed=2), bucket(max_num_seqs=3, max_tokens=256, drafts=k),
              max_new_tokens=39, **bias)  # 38 tokens after the first: no k + 1 divides it
    for c in got:
        spec = c.spec
        assert 1 + spec.rounds + spec.accepted == len(c.token_ids) == 39
        assert spec.verified[:-1] == [k] * (spec.rounds - 1)
        if agree:
            assert spec.per_round == spec.verified and spec.per_round[-1] == 38 % (k + 1) - 1
            assert spec.accepted / spec.drafts_verified == 1.0
        else:
            assert spec.accepted == 0 and spec.verified[-1] == 1
        assert spec.verified_histogram[k] == spec.rounds - (spec.verified[-1] != k)


@pytest.mark.numerics
def test_auto_turns_off_a_drafter_that_never_agrees(tmp_path):
    """A target without the peaked head over 64 tokens: its random drafter almost never agrees,
    and auto stops drafting once it has measured that; outputs stay target-only's."""
    log = []
    target_dir = make_target(tmp_path / "t64", vocab=64, peaked=False)
    make_drafter(tmp_path / "d64", 2, vocab=64)
    target, drafter = load_pair(target_dir, tmp_path / "d64", F64)
    prompts = random_prompts(LENGTHS, vocab=64, seed=3)
    want = [c.token_ids for c in target_only(target, prompts, max_new_tokens=30)]
    engine = Engine(target, drafter, dtype=F64, log=log.append)
    got = run(engine, prompts, bucket(max_num_seqs=3, max_tokens=256, speculation="auto"), max_new_tokens=30)
    assert [c.token_ids for c in got] == want
    assert sum("speculation off (auto): the drafts pay at no batch size" in line for line in log) == 1, log
    assert engine.schedules["0-256"].off


@pytest.mark.parametrize("bucket_, drafter, message", [
    ({"speculation": {"drafts": 3}}, None, r"speculation: \{drafts: 3\}, which needs model.drafter"),
    ({"speculation": {"drafts": 4}, "block_size": 4}, "d", r"drafts 4 must be below its block_size 4"),
    ({"speculation": {"drafts": -1}}, "d", r"greater than or equal to 0"),
])
def test_the_job_file_refuses_drafts_that_cannot_run(bucket_, drafter, message):
    doc = {"input": {"paths": ["x.jsonl"], "prompt_column": "p"},
           "model": {"target": "t", "drafter": drafter}, "engine": {"max_model_len": 256},
           "buckets": [{"max_tokens": 256, **bucket_}], "output": {"dir": "o"}}
    with pytest.raises(JobError, match=message):
        parse_job(doc, Path("job.yaml"))


def test_a_pinned_bucket_keeps_its_drafts():
    from dflash_batch.plan.buckets import plan_buckets
    doc = {"input": {"paths": ["x.jsonl"], "prompt_column": "p"},
           "model": {"target": "t", "drafter": "d"}, "engine": {"max_model_len": 256},
           "buckets": [{"max_tokens": 256, "speculation": {"drafts": 3}}], "output": {"dir": "o"}}
    (b,) = plan_buckets(parse_job(doc, Path("job.yaml")))
    assert b == Bucket(0, "0-256", 256, 64, True, None, 3)
