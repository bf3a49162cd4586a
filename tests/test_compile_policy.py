"""Start-up paid once (engine/compile_policy.py, build.use_compile_cache): a bucket whose requests
fit few rounds runs uncompiled, with the same tokens as the eager engine and a log line saying
why; compiled code goes to the cache directory the job or the environment names."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest

import torch

from dflash_batch.build import build_engine, resolve_engine, use_compile_cache
from dflash_batch.engine import compile_policy
from dflash_batch.engine.compile_policy import CompileWhenItPays
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.round import Round
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.job import parse_job
from tests.eager_engine import EagerEngine
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, random_prompts


def _requests(n: int, max_new_tokens: int) -> list[Request]:
    prompts = random_prompts([5 + i % 7 for i in range(n)], vocab=8, seed=3)
    return [Request((str(i), 0), p, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
            for i, p in enumerate(prompts)]


def test_compiling_waits_for_the_first_rounds_and_pays_only_for_long_work():
    """Eight eager rounds are timed; then the rounds the requests may still need, at the measured
    tokens a round and seconds a round, decide (here: 4 rows of 1000 tokens, 4 tokens a round)."""
    def verdicts(round_s: float):
        pays = CompileWhenItPays(_requests(4, 1000))
        seen = []
        for _ in range(compile_policy.TIMED_ROUNDS):
            seen.append(pays.verdict())
            pays.record(round_s, 4)
        return seen, pays.verdict()

    seen, (compile, why) = verdicts(0.010)  # ~992 rounds of 10 ms save ~2 s: not worth 41 s
    assert seen == [None] * compile_policy.TIMED_ROUNDS and not compile
    assert why == "at most ~992 rounds left of 10.0 ms would save ~2 s, compiling costs ~41 s"
    assert verdicts(0.5)[1][0]  # ~992 rounds of half a second save ~104 s: compile
    assert not verdicts(0.19)[1][0] and verdicts(0.2)[1][0]  # the break-even: 992 x 0.2 x 0.21 = 41.7 s
    stream = CompileWhenItPays(iter(_requests(4, 1000)))
    assert stream.verdict() == (True, "the requests came as a stream (not counted)")


def _engine(tmp_path, lines):
    make_drafter(tmp_path / "v2", 2, sliding=True, window=6)
    target, draft = load_pair(make_target(tmp_path / "target"), tmp_path / "v2", F64)
    engine = Engine(target, draft, compile=True, compile_if_it_pays=True, dtype=F64, log=lines.append)
    return engine, EagerEngine(target, draft, dtype=F64)


def test_a_bucket_of_few_rounds_runs_uncompiled_and_says_why(tmp_path):
    """Nothing is traced (the round's compiled step is never made), the tokens are the eager
    engine's, and the log names the bucket and the reason."""
    lines: list[str] = []
    engine, eager = _engine(tmp_path, lines)
    b = bucket(max_num_seqs=4, max_tokens=256)
    reqs = _requests(6, 24)
    got = {c.key: c.token_ids for c in engine.generate(reqs, b)}
    assert got == {c.key: c.token_ids for c in eager.generate(iter(reqs), b)}
    assert engine.rounds[8].step is None and not engine.rounds[8].compiled
    said = [line for line in lines if "rounds run uncompiled" in line]
    assert len(said) == 1 and re.fullmatch(
        rf"bucket {b.name}: rounds run uncompiled: at most ~\d+ rounds left of [\d.]+ ms would save ~0 s, "
        r"compiling costs ~41 s", said[0]), said


def test_a_bucket_compiles_once_it_pays(tmp_path, monkeypatch):
    """With compiling free, the ninth round is the first compiled one (torch.compile is replaced
    by a wrapper that counts its calls: the policy is under test, not inductor); the tokens are
    still the eager engine's, and the next bucket compiles from its first round."""
    monkeypatch.setattr(compile_policy, "COMPILE_SECONDS", 0.0)
    runs, calls = [], []
    run = Round.run
    monkeypatch.setattr(Round, "run", lambda self, *args: runs.append(1) or run(self, *args))
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic: lambda *args: calls.append(1) or fn(*args))
    lines: list[str] = []
    engine, eager = _engine(tmp_path, lines)
    b = bucket(max_num_seqs=4, max_tokens=256)
    reqs = _requests(6, 24)
    got = {c.key: c.token_ids for c in engine.generate(reqs, b)}
    assert engine.rounds[8].compiled and len(runs) - len(calls) == compile_policy.TIMED_ROUNDS and calls
    assert got == {c.key: c.token_ids for c in eager.generate(iter(reqs), b)}
    assert [line.split(": ")[1] for line in lines if line.startswith(f"bucket {b.name}: compiling")] == \
        ["compiling the round"]
    calls.clear(), runs.clear()
    list(engine.generate(_requests(2, 12), b))
    assert runs and len(calls) == len(runs), "a later bucket runs the round compiled from its first round"


@pytest.fixture()
def env(monkeypatch):
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "DFLASH_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _job(tmp_path, **engine):
    doc = dict(input=dict(paths=["p.jsonl"], prompt_column="p"), output=dict(dir="out"),
               model=dict(target="target", drafter="v2", dtype="float32"), engine=dict(max_num_seqs=4, **engine))
    return parse_job(doc, base_dir=tmp_path)


def test_the_compile_cache_is_where_the_job_or_environment_says(tmp_path, env):
    assert use_compile_cache(_job(tmp_path)) == tmp_path / "out" / ".compile_cache"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "out" / ".compile_cache" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "out" / ".compile_cache" / "triton")
    env.delenv("TORCHINDUCTOR_CACHE_DIR")
    shared = tmp_path / "on-a-shared-filesystem"
    env.setenv("DFLASH_CACHE_DIR", str(shared))
    assert use_compile_cache(_job(tmp_path)) == shared
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(shared / "inductor")
    env.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert use_compile_cache(_job(tmp_path, cache_dir="cache")) == tmp_path / "cache"  # relative to the job
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the environment's own wins
    use_compile_cache(_job(tmp_path, cache_dir="cache"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_compiling_engine_is_built_with_the_jobs_cache(tmp_path, env):
    make_target(tmp_path / "target")
    make_drafter(tmp_path / "v2", 2, sliding=True, window=6)
    job = _job(tmp_path, cache_dir="cache")
    setup = resolve_engine(job, cuda=False, flashinfer=False, triton=False)
    assert setup.compile and setup.compile_if_it_pays  # compile absent: where it pays
    engine = build_engine(job, SimpleNamespace(vocab_size=8, decode=str), setup)
    assert engine.compile and engine.compile_if_it_pays
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")


def test_a_ragged_round_runs_uncompiled_where_one_k_rounds_compile(tmp_path, monkeypatch):
    """With engine.compile on, an auto bucket's per-row rounds (ragged, laid out from a host read:
    each layout would be a graph of its own) run eagerly; its rounds of one k go through the
    compiled step (torch.compile replaced by a wrapper that records what it is called with). The
    tokens are the eager engine's."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic: lambda *args: calls.append(args) or fn(*args))
    engine, eager = _engine(tmp_path, [])
    engine.compile_if_it_pays = False
    b = bucket(max_num_seqs=4, max_tokens=256, speculation="auto")
    reqs = _requests(6, 24)
    got = {c.key: c.token_ids for c in engine.generate(reqs, b)}
    assert got == {c.key: c.token_ids for c in eager.generate(iter(reqs), b)}
    per_row = [args[5] for args in calls]  # run(batch, n, greedy, max_kv, width, per_row, fixed)
    (schedule,) = engine.schedules.values()
    assert schedule.stats()["drafts_verified"]["per row"], "no round went per row"
    assert calls and not any(per_row), per_row
