"""The static round (engine/round.py on a DecodeBatch) equals the eager round it replaced
(tests/eager_engine.py) token for token and round for round: greedy and sampled, DFlash v1/v2
on Qwen3 and DFlash2-MLA on Kimi-K3, with batches padded to capture sizes, sequences finishing
mid-batch (different budgets, stop tokens) and a queue longer than the batch (rows reused).
Both run in float64: padding changes the batch's shape, and in float32 that can round a logit
near-tie apart on some CPU (rounding, not the round's logic, which these tests check)."""

from __future__ import annotations

import pytest

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.testing import kimi_pair
from tests.eager_engine import EagerEngine
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, random_prompts

pytestmark = pytest.mark.numerics

LENGTHS = [1, 37, 5, 120, 9, 64, 2, 30, 17, 80, 3]
BUDGETS = [24, 3, 17, 1, 30, 8, 24, 12, 5, 20, 2]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("static")
    make_drafter(d / "v1", 1)
    make_drafter(d / "v2", 2, sliding=True, window=6)
    return dict(target=make_target(d / "target"), v1=d / "v1", v2=d / "v2")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return kimi_pair.make_kimi_pair(tmp_path_factory.mktemp("static_kimi"), stream="attn_res")


def requests(vocab: int, sampling: dict, stop_token_ids: tuple[int, ...]) -> list[Request]:
    prompts = random_prompts(LENGTHS, vocab=vocab, seed=11)
    return [Request((str(i), 0), p, SamplingParams(max_new_tokens=n, seed=500 + i, stop_token_ids=stop_token_ids,
                                                   **sampling))
            for i, (p, n) in enumerate(zip(prompts, BUDGETS))]


def outcomes(engine, reqs: list[Request], b) -> dict:
    return {c.key: (c.token_ids, c.spec.per_round if c.spec else None, c.finish_reason, c.stop_reason)
            for c in engine.generate(iter(reqs), b)}


SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, top_p=0.9, top_k=5, min_p=0.05)}


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("drafter", ["v1", "v2", None])
@pytest.mark.parametrize("sizes", [None, [1, 2, 4, 8], [16]], ids=["exact", "ladder", "one_size"])
def test_static_round_equals_eager_round_qwen3(qwen3, drafter, sampling, sizes):
    target, draft = load_pair(qwen3["target"], qwen3[drafter] if drafter else None, F64)
    reqs = requests(8, SAMPLING[sampling], stop_token_ids=(6,))
    b = bucket(max_num_seqs=5, max_tokens=256)
    want = outcomes(EagerEngine(target, draft, dtype=F64), reqs, b)
    got = outcomes(Engine(target, draft, capture_sizes=sizes, dtype=F64), reqs, b)
    assert got == want
    assert {r for _, _, r, _ in want.values()} == {"stop", "length"}, "no sequence hit a stop token"
    if drafter:
        assert any(n for _, rounds, _, _ in want.values() for n in rounds), "no draft accepted"


@pytest.mark.parametrize("sampling", SAMPLING)
def test_static_round_equals_eager_round_kimi(kimi, sampling):
    target, draft = kimi_pair.load_pair(*kimi, F64)
    reqs = requests(kimi_pair.VOCAB, SAMPLING[sampling], stop_token_ids=(7,))
    b = bucket(max_num_seqs=4, max_tokens=256)
    want = outcomes(EagerEngine(target, draft, dtype=F64), reqs, b)
    got = outcomes(Engine(target, draft, capture_sizes=[2, 8], dtype=F64), reqs, b)
    assert got == want
    assert any(n for _, rounds, _, _ in want.values() for n in rounds), "no draft accepted"


@pytest.mark.slow
@pytest.mark.no_rerun  # minutes of torch.compile
def test_compiled_round_equals_eager_round(qwen3):
    """engine.compile (the CPU path): torch.compile of the round gives the eager round's tokens and
    rounds, greedy and sampled, speculative and target-only, across buckets of different lengths
    without compiling again per bucket."""
    import torch._dynamo

    target, draft = load_pair(qwen3["target"], qwen3["v2"], F64)
    eager, compiled = EagerEngine(target, draft, dtype=F64), Engine(target, draft, compile=True, dtype=F64)
    buckets = [bucket(max_num_seqs=4, max_tokens=192), bucket(max_num_seqs=4, max_tokens=256)]
    torch._dynamo.reset()
    for name in SAMPLING:
        reqs = requests(8, SAMPLING[name], stop_token_ids=(6,))
        for b in buckets:
            assert outcomes(compiled, reqs, b) == outcomes(eager, reqs, b), (name, b.max_tokens)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 2, f"{graphs} compilations for greedy + sampled over two buckets (want one each)"
    plain = [bucket(max_num_seqs=4, max_tokens=192, speculation=False)]
    reqs = requests(8, SAMPLING["greedy"], stop_token_ids=(6,))
    assert outcomes(compiled, reqs, plain[0]) == outcomes(eager, reqs, plain[0])
