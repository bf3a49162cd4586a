"""Samples of one prompt admitted together prefill it once: the others copy its cache slots
(target K/V or latents, the drafter's context) and recurrent state, then draw their own first
token from its logits. Prompts that share a head (plan/heads.py) prefill it once: the others
start from its kept state (KDA states, the drafter's rings) and its shared pages, and prefill
only their tails (engine/heads.py). Outputs must be exactly those of prefilling each sample
itself, on both model families (float64, so "exactly" is exact), with fewer prompt tokens run."""

from __future__ import annotations

import random

import pytest

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.testing import kimi_pair
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, random_prompts


def requests(vocab: int, n: int = 4) -> list[Request]:
    """Three prompts (one long enough to take several prefill chunks), n samples each, sampled,
    with logprobs; the last prompt's samples ask for prompt logprobs."""
    prompts = random_prompts([70, 9, 33], vocab=vocab, seed=11)
    return [Request((str(i), j), p, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=100 * i + j,
                                                   logprobs=2, prompt_logprobs=3 if i == 2 else None))
            for i, p in enumerate(prompts) for j in range(n)]


def outputs(engine: Engine, reqs: list[Request], max_num_seqs: int, speculation: bool | str = True
            ) -> tuple[dict, dict, int]:
    """Tokens and acceptance by key; logprobs (generated, then prompt) flattened; prompt tokens run."""
    before = engine.prefill_tokens
    done = list(engine.generate(iter(reqs), bucket(max_num_seqs=max_num_seqs, speculation=speculation)))
    engine.cached = {c.key: c.cached_tokens for c in done}
    scores = {c.key: [x for lp in (c.logprobs, c.prompt_logprobs) if lp is not None
                      for x in (*lp.token, *(v for top in lp.top if top for v in top)) if x is not None]
              for c in done}
    tokens = {c.key: (c.token_ids, c.spec.per_round if c.spec else None,
                      [lp.top_ids for lp in (c.logprobs, c.prompt_logprobs) if lp is not None]) for c in done}
    return tokens, scores, engine.prefill_tokens - before


def shared_and_alone(shared: Engine, alone: Engine, reqs: list[Request], rows: int,
                     speculation: bool | str = True) -> tuple[dict, int, int]:
    """Both engines decode `reqs`: the same tokens and acceptance, logprobs to 1e-12 (a copied or
    forked prompt's logits come from a batch of other neighbours and other chunks: float64
    rounding apart, as any change of batch). Returns the outputs and the prompt tokens each ran."""
    got, got_scores, ran = outputs(shared, reqs, rows, speculation)
    want, want_scores, ran_alone = outputs(alone, reqs, rows, speculation)
    if speculation == "auto":  # when a bucket stops speculating depends on its timed rounds
        got, want = ({k: (v[0], v[2]) for k, v in d.items()} for d in (got, want))
    assert got == want
    for key in want_scores:
        assert got_scores[key] == pytest.approx(want_scores[key], abs=1e-12, rel=0)
    assert ran_alone == sum(len(r.prompt_ids) for r in reqs)
    return got, ran, ran_alone


def check_samples(models: tuple, reqs: list[Request]) -> None:
    """12 rows admit every sample at once (each prompt runs once); 8 admit two prompts' samples,
    and the third's join its prefill while it lasts. The 70-token prompt's samples share a
    69-token head besides; the others are too short for a head (plan/heads.py's MIN_HEAD_TOKENS),
    so the 33-token prompt's samples admitted after its prefill (one or two: it depends on when
    rows free up) run it again."""
    shared, alone = (Engine(*models, dtype=F64, max_num_batched_tokens=32, share_prompts=s) for s in (True, False))
    once = sum(len(r.prompt_ids) for r in reqs if r.key[1] == 0)
    for rows, again in ((12, [0]), (8, [33, 66])):
        got, ran, ran_alone = shared_and_alone(shared, alone, reqs, rows)
        assert ran - once in again, (rows, ran, once)
        assert sum(shared.cached.values()) == ran_alone - ran
    assert len({tuple(v[0]) for v in got.values()}) > len(got) // 2, "samples should differ"


@pytest.mark.numerics
def test_shared_prompts_decode_as_unshared_qwen3(tmp_path):
    target = make_target(tmp_path / "target")
    make_drafter(tmp_path / "v2", 2, block_size=8)
    models = load_pair(target, tmp_path / "v2", F64)
    check_samples(models, requests(8))


@pytest.mark.numerics
def test_shared_prompts_decode_as_unshared_kimi(tmp_path):
    """The KDA layers' recurrent state is copied with the MLA latents and the drafter's context."""
    models = kimi_pair.load_pair(*kimi_pair.make_kimi_pair(tmp_path / "k"), F64)
    check_samples(models, requests(kimi_pair.VOCAB))


def head_requests(vocab: int) -> list[Request]:
    """Rows over three heads, page size 16 and prefill chunks of 64 tokens: 150 tokens (its end
    mid-page, inside a chunk), 128 (at a page's and a chunk's end) and 100, whose first row
    is the head and nothing more (so the head shared is 99 tokens: each row computes the
    logits of its own last token). Sampled with seeds and logprobs; the 150-token head's rows
    ask for prompt logprobs; row 9 has n = 2."""
    heads = random_prompts([150, 128, 100], vocab=vocab, seed=21)
    tails = random_prompts([30, 1, 90, 64, 7, 12, 40, 5, 3, 20, 1], vocab=vocab, seed=22)
    prompts = [(heads[0] + t, 0) for t in tails[:4]] + [(heads[1] + t, 0) for t in tails[4:8]]
    prompts += [(heads[2], 0), (heads[2] + tails[8], 1), (heads[2] + tails[9], 0), (heads[2] + tails[10], 0)]
    return [Request((str(i), j), p, SamplingParams(temperature=1.0, max_new_tokens=10, seed=10 * i + j, logprobs=1,
                                                   prompt_logprobs=2 if i < 4 else None))
            for i, (p, n) in enumerate(prompts) for j in range(n + 1)]


def check_heads(models: tuple, vocab: int) -> None:
    """Three rows at a time (a head's rows decode while the next head is prefilled and kept, in
    other pool pages), all of them, and the rows in another order; speculation on and auto.
    Every head is computed once, and each of its other rows' share of it is cached_tokens."""
    reqs = head_requests(vocab)
    shared, alone = (Engine(*models, dtype=F64, max_num_batched_tokens=64, share_prompts=s) for s in (True, False))
    saved = 3 * 150 + 3 * 128 + 4 * 99
    for rows, speculation in ((3, True), (16, True), (3, "auto")):
        got, ran, ran_alone = shared_and_alone(shared, alone, reqs, rows, speculation)
        # The n = 2 row's second sample forks the first's whole prompt where it is admitted
        # while the first prefills (all rows at once, and at 3 rows as rows free up); else it
        # enters the head.
        forked = shared.cached[reqs[10].key] - 99
        assert forked in ((4,) if rows == 16 else (0, 4)), (rows, forked)
        assert ran == ran_alone - saved - forked, (rows, ran, ran_alone)
        assert sum(shared.cached.values()) == ran_alone - ran
        if rows == 3 and speculation is True:
            first = got
    shuffled = random.Random(0).sample(reqs, len(reqs))
    assert outputs(shared, shuffled, 3)[0] == first, "a row's outputs must not depend on the order of rows"


@pytest.mark.numerics
def test_shared_heads_decode_as_unshared_qwen3(tmp_path):
    target = make_target(tmp_path / "target")
    make_drafter(tmp_path / "v2", 2, block_size=8)
    check_heads(load_pair(target, tmp_path / "v2", F64), 8)


@pytest.mark.numerics
def test_shared_heads_decode_as_unshared_kimi(tmp_path):
    """The KDA states kept at each head's exact end, the MLA latents of its pages, the drafter's
    context and its sliding layers' rings (window 6)."""
    check_heads(kimi_pair.load_pair(*kimi_pair.make_kimi_pair(tmp_path / "k"), F64), kimi_pair.VOCAB)


def qwen3_engines(tmp_path, shared_head_tokens: int) -> tuple[Engine, Engine]:
    """Engines on the tiny Qwen3 pair (float64, prefill chunks of 64): sharing prompts with heads
    of up to `shared_head_tokens`, and sharing nothing."""
    target = make_target(tmp_path / "target")
    make_drafter(tmp_path / "v2", 2, block_size=8)
    models = load_pair(target, tmp_path / "v2", F64)
    shared, alone = (Engine(*models, dtype=F64, max_num_batched_tokens=64, share_prompts=s,
                            shared_head_tokens=shared_head_tokens) for s in (True, False))
    return shared, alone


@pytest.mark.numerics
def test_heads_are_shared_as_far_as_shared_head_tokens(tmp_path):
    # engine.shared_head_tokens 120: the 150- and 128-token heads are shared 120 tokens (the pool
    # holds two heads of 120), the 100-token one 99, and the outputs are those of sharing nothing.
    shared, alone = qwen3_engines(tmp_path, 120)
    reqs = head_requests(8)
    _, ran, ran_alone = shared_and_alone(shared, alone, reqs, 3)
    forked = shared.cached[reqs[10].key] - 99  # as in check_heads
    assert ran == ran_alone - (6 * 120 + 4 * 99) - forked, (ran, ran_alone, forked)
    assert max(shared.cached.values()) == 120


def pool_requests(vocab: int) -> list[Request]:
    """Five heads of 100 tokens, three rows each (tails of 1 to 15 tokens); each head's first row
    decodes 40 tokens, the others 2."""
    heads = random_prompts([100] * 5, vocab=vocab, seed=31)
    tails = random_prompts([1 + (7 * i) % 15 for i in range(15)], vocab=vocab, seed=32)
    return [Request((str(i), 0), heads[i // 3] + tails[i], SamplingParams(max_new_tokens=[40, 2, 2][i % 3]))
            for i in range(15)]


@pytest.mark.numerics
def test_a_full_pool_delays_sharing_and_frees_every_head(tmp_path):
    # Four rows at a time and a pool of two heads of 100 tokens. Heads 0 and 1 take the pool, and
    # their first rows decode on: head 2's rows all come while it is full, and prefill their whole
    # prompts themselves; so does head 3's first row, but its next row comes once head 0's pages
    # are back, and leads it. A pool that kept a head it had no room for from counting that
    # row as admitted would never give its pages back, and share nothing more (head 4).
    shared, alone = qwen3_engines(tmp_path, 100)
    reqs = pool_requests(8)
    shared_and_alone(shared, alone, reqs, 4)
    cached = [shared.cached[r.key] for r in reqs]
    assert cached[6:10] == [0] * 4, f"the pool was not full when head 2's rows came: {cached}"
    for h in (0, 1, 3, 4):
        assert sum(cached[3 * h:3 * h + 3]) >= 100, f"head {h} was never shared: {cached}"
    assert not shared.heads.live and len(shared.heads.free) == 14, "a head's pages were never given back"
