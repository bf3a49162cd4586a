"""Samples of one prompt admitted together prefill it once: the others copy its cache slots
(target K/V or latents, the drafter's context) and recurrent state, then draw their own first
token from its logits; a sample admitted while another decodes its prompt copies all but the
last prompt token (attention-only targets). Outputs must be exactly those of prefilling each sample itself, on both
model families (float64, so "exactly" is exact), with fewer prompt tokens run."""

from __future__ import annotations

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


def outputs(engine: Engine, reqs: list[Request], max_num_seqs: int) -> tuple[dict, dict, int]:
    """Tokens and acceptance by key; logprobs (generated, then prompt) flattened; prompt tokens run."""
    before = engine.prefill_tokens
    done = list(engine.generate(iter(reqs), bucket(max_num_seqs=max_num_seqs)))
    scores = {c.key: [x for lp in (c.logprobs, c.prompt_logprobs) if lp is not None
                      for x in (*lp.token, *(v for top in lp.top if top for v in top)) if x is not None]
              for c in done}
    tokens = {c.key: (c.token_ids, c.spec.per_round if c.spec else None,
                      [lp.top_ids for lp in (c.logprobs, c.prompt_logprobs) if lp is not None]) for c in done}
    return tokens, scores, engine.prefill_tokens - before


def shared_and_alone(shared: Engine, alone: Engine, reqs: list[Request], rows: int) -> tuple[dict, int, int]:
    """Both engines decode `reqs`: the same tokens and acceptance, logprobs to 1e-12 (a copied or
    forked prompt's logits come from a batch of other neighbours: float64 rounding apart, as
    any change of batch). Returns the outputs and the prompt tokens each ran."""
    got, got_scores, ran = outputs(shared, reqs, rows)
    want, want_scores, ran_alone = outputs(alone, reqs, rows)
    assert got == want
    for key in want_scores:
        assert got_scores[key] == pytest.approx(want_scores[key], abs=1e-12, rel=0)
    assert ran_alone == sum(len(r.prompt_ids) for r in reqs)
    return got, ran, ran_alone


def check_sharing(models: tuple, reqs: list[Request], recurrent: bool) -> None:
    """12 rows admit every sample at once (each prompt runs once); 8 admit two prompts' samples,
    and the third's join its prefill while it lasts; later ones copy all but the last prompt
    token from a sample decoding it, or, past a recurrent state, prefill it again."""
    shared, alone = (Engine(*models, dtype=F64, max_num_batched_tokens=32, share_prompts=s) for s in (True, False))
    for rows in (12, 8):
        got, ran, ran_alone = shared_and_alone(shared, alone, reqs, rows)
        once = sum(len(r.prompt_ids) for r in reqs if r.key[1] == 0)
        if rows == 12:
            assert ran == once
        elif not recurrent:
            assert once < ran <= once + 3, ran  # a late sample runs its last prompt token only
        else:
            assert once + 33 <= ran < ran_alone, ran
    assert len({tuple(v[0]) for v in got.values()}) > len(got) // 2, "samples should differ"


@pytest.mark.numerics
def test_shared_prompts_decode_as_unshared_qwen3(tmp_path):
    target = make_target(tmp_path / "target")
    make_drafter(tmp_path / "v2", 2, block_size=8)
    models = load_pair(target, tmp_path / "v2", F64)
    check_sharing(models, requests(8), recurrent=False)


@pytest.mark.numerics
def test_shared_prompts_decode_as_unshared_kimi(tmp_path):
    """The KDA layers' recurrent state is copied with the MLA latents and the drafter's context."""
    models = kimi_pair.load_pair(*kimi_pair.make_kimi_pair(tmp_path / "k"), F64)
    check_sharing(models, requests(kimi_pair.VOCAB), recurrent=True)


@pytest.mark.numerics
def test_shared_prefixes_decode_as_unshared(tmp_path):
    """Prompts that share a 150-token head (a system prompt, a few-shot block): each one after
    the first copies the head's first 128 tokens (two index blocks) and prefills the rest;
    outputs equal prefilling everything (Qwen3: attention only). A Kimi-K3 target copies
    nothing (its KDA state has moved past the head), and decodes the same."""
    head = random_prompts([150], seed=21)[0]
    tails = random_prompts([30, 1, 90, 64, 7], seed=22)
    reqs = [Request((str(i), 0), head + t, SamplingParams(temperature=1.0, max_new_tokens=10, seed=i, logprobs=1))
            for i, t in enumerate(tails)]
    target = make_target(tmp_path / "target")
    make_drafter(tmp_path / "v2", 2, block_size=8)
    shared, alone = (Engine(*load_pair(target, tmp_path / "v2", F64), dtype=F64, share_prompts=s) for s in (True, False))
    # All admitted at once (the others wait while the first prefills the head), and two at a
    # time (later ones copy the head from a sequence decoding).
    for rows in (5, 2):
        _, ran, ran_alone = shared_and_alone(shared, alone, reqs, rows)
        assert ran == ran_alone - 128 * (len(reqs) - 1), (rows, ran, ran_alone)

    kimi = kimi_pair.load_pair(*kimi_pair.make_kimi_pair(tmp_path / "k"), F64)
    head = random_prompts([150], vocab=kimi_pair.VOCAB, seed=21)[0]
    reqs = [Request(r.key, head + t, r.params) for r, t in zip(reqs, random_prompts([30, 1, 90, 64, 7],
                                                                                    vocab=kimi_pair.VOCAB, seed=22))]
    shared, alone = (Engine(*kimi, dtype=F64, share_prompts=s) for s in (True, False))
    _, ran, ran_alone = shared_and_alone(shared, alone, reqs, 2)
    assert ran == ran_alone
