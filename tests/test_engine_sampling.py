"""The engine's output law and its invariances.

Sampled tokens follow the target's own filtered distribution (speculative or not); outputs do not
depend on the batch size, on chunked prefill or, at temperature 0, on the drafter; stop strings
cut the output where they complete. The invariances run the engine in float64: in float32 a
logit near-tie can resolve two ways between two batch shapes on some CPU, which is rounding, not
a broken invariant (the README's figures measure how often on the demo pair)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare
from transformers import RepetitionPenaltyLogitsProcessor

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.engine.sampling import filtered_probs
from tests.test_row_drafts import ragged_rounds
from tests.engine_util import F64, VOCAB, after_first, bucket, load_pair, make_drafter, make_target, random_prompts, run
from tests.tiny_models import load_hf_model

TOP_K, TOP_P, MIN_P = 5, 0.9, 0.3  # min-p removes 30% of the mass the others leave


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    make_drafter(d / "v1", 1, block_size=8)
    make_drafter(d / "v2", 2, block_size=8)
    # The default peaked head makes the target near-deterministic at temperature 1 (p ~ 0.9 on
    # one token); a third of it leaves four tokens with real mass after top-k/top-p.
    soft = make_target(d / "soft", seed=0)
    weights = load_file(soft / "model.safetensors")
    weights["lm_head.weight"] *= 0.3
    save_file(weights, soft / "model.safetensors", metadata={"format": "pt"})
    return dict(target=make_target(d / "target"), soft=soft, v1=d / "v1", v2=d / "v2")


# -- filtering -------------------------------------------------------------------------------------
def filtered_by_definition(logits: list[float], temperature: float, top_k: int, top_p: float,
                           min_p: float = 0.0) -> list[float]:
    """Softmax at temperature; keep the top_k most likely; of those, keep the shortest prefix in
    descending order whose mass before each kept token is < top_p; of those, the tokens at least
    min_p times as likely as the most likely; renormalise."""
    m = max(logits)
    p = [math.exp((x - m) / temperature) for x in logits]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept = order[:top_k] if top_k > 0 else order
    total = sum(p[i] for i in kept)
    out, before = [0.0] * len(p), 0.0
    for i in kept:
        if before >= top_p:
            break
        out[i] = p[i] / total
        before += out[i]
    out = [x if x >= min_p * max(out) else 0.0 for x in out]
    s = sum(out)
    return [x / s for x in out]


@pytest.mark.numerics
def test_filtered_probs_matches_definition():
    gen = torch.Generator().manual_seed(0)
    cases = [(t, k, p, m) for t in (0.5, 1.0, 2.0) for k in (-1, 1, 3, 8, 20) for p in (1.0, 0.9, 0.5, 0.05)
             for m in (0.0, 0.05, 0.3, 1.0)]
    logits = 2 * torch.randn(len(cases), 12, generator=gen, dtype=torch.float64)
    temperature, top_k, top_p, min_p = (torch.tensor(c) for c in zip(*cases))
    got = filtered_probs(logits, temperature, top_k, top_p, min_p)
    for row, (t, k, p, m) in enumerate(cases):
        want = filtered_by_definition(logits[row].tolist(), t, k, p, m)
        torch.testing.assert_close(got[row], torch.tensor(want, dtype=torch.float64),
                                   msg=f"temperature {t} top_k {k} top_p {p} min_p {m}")


# -- the output law --------------------------------------------------------------------------------
PROMPT = [1, 4, 2, 6]
NEW = 3
SAMPLES = 20_000


def exact_joint(target_dir) -> torch.Tensor:
    """[V, V, V]: p(t1, t2, t3 | PROMPT) of the filtered target, from the transformers model: one
    batch holds every continuation PROMPT + (t1, t2), whose last three rows give the factors."""
    model = load_hf_model(target_dir)
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))        # [V*V, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[:, len(PROMPT) - 1:].double()                   # [V*V, 3, V]

    def f(rows: torch.Tensor) -> torch.Tensor:
        return torch.tensor([filtered_by_definition(r.tolist(), 1.0, TOP_K, TOP_P, MIN_P) for r in rows],
                            dtype=torch.float64)

    p1 = f(logits[:1, 0])[0]                                  # [V]
    p2 = f(logits[::VOCAB, 1])                                # [t1, V]: rows with t2 == 0
    p3 = f(logits[:, 2]).view(VOCAB, VOCAB, VOCAB)            # [t1, t2, V]
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_tuples(engine: Engine, speculation: bool, drafts: int | None = None) -> tuple[Counter, list[int]]:
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P, max_new_tokens=NEW, seed=s)
              for s in range(SAMPLES)]
    reqs = (Request((str(i), 0), PROMPT, p) for i, p in enumerate(params))
    counts, per_round = Counter(), []
    # Blocks of 4 cover every acceptance 3 new tokens allow, at half the verify rows of 8.
    spec_bucket = bucket(block_size=4, max_num_seqs=256, max_tokens=16, speculation=speculation, drafts=drafts)
    for c in engine.generate(reqs, spec_bucket):
        counts[tuple(c.token_ids)] += 1
        per_round += c.spec.per_round if c.spec else []
    return counts, per_round


@pytest.mark.slow
@pytest.mark.parametrize("speculation, drafts", [(True, None), (True, 0), (True, 1), ("auto", None), (False, None)],
                         ids=["spec", "spec_k0", "spec_k1", "spec_per_row", "target_only"])
def test_sampled_tokens_follow_target_distribution(models, speculation, drafts, monkeypatch):
    """spec_k0, spec_k1: rounds verify none or 1 of the block's 3 drafts (engine/schedule.py;
    with 2 tokens after the first, a round can keep at most 1 draft anyway). spec_per_row: each
    row of a round verifies its own number, scattered (tests/test_row_drafts.py's stand-in for
    the choice), in one ragged verify (engine/row_drafts.py)."""
    joint = exact_joint(models["soft"]).flatten()
    # The test means something only if the law is spread out: several likely outcomes per step.
    assert (joint > 0.01).sum() >= 20, joint.sort(descending=True).values[:20]
    if speculation == "auto":
        ragged_rounds(monkeypatch)
    engine = Engine(*load_pair(models["soft"], models["v2"]))
    counts, per_round = sample_tuples(engine, speculation, drafts)
    if drafts is not None:
        assert max(per_round) == drafts
    if speculation == "auto":  # with 2 tokens left after the first, a row may verify 0 or 1 draft
        (schedule,) = engine.schedules.values()
        assert set(schedule.verified["per row"]) == {0, 1} and not schedule.verified["one k"], schedule.verified
    if speculation and drafts != 0:
        # Drafts accepted: the accept rule (not only the bonus token) shaped the sample.
        assert sum(per_round) > SAMPLES // 20, Counter(per_round)

    observed = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    for (a, b, c), n in counts.items():
        observed[(a * VOCAB + b) * VOCAB + c] = n
    impossible = observed[joint == 0].sum()
    assert impossible == 0, f"{int(impossible)} samples that top-k/top-p/min-p exclude"
    expected = joint * SAMPLES
    big, rare = expected >= 5, (expected > 0) & (expected < 5)
    obs, exp = observed[big], expected[big]
    if rare.any():  # pool the cells too rare for the chi-square approximation into one
        obs = torch.cat([obs, observed[rare].sum()[None]])
        exp = torch.cat([exp, expected[rare].sum()[None]])
    result = chisquare(obs.numpy(), exp.numpy() * SAMPLES / exp.sum().item())
    assert result.pvalue > 0.01, (result, int(big.sum()))


# -- invariances -----------------------------------------------------------------------------------
MIXED = [1, 200, 3, 17, 64, 2, 150, 9, 33, 120, 5, 80]


@pytest.mark.numerics
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_outputs_do_not_depend_on_max_num_seqs(models, sampling):
    engine = Engine(*load_pair(models["soft"], models["v2"], F64), dtype=F64)
    prompts = random_prompts(MIXED, seed=1)
    alone = run(engine, prompts, bucket(max_num_seqs=1), max_new_tokens=24, **sampling)
    batched = run(engine, prompts, bucket(max_num_seqs=16), max_new_tokens=24, **sampling)
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert any(n for c in batched for n in c.spec.per_round), "no draft accepted"


@pytest.mark.numerics
@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_speculative_greedy_equals_target_greedy(models, version, batch):
    engine = Engine(*load_pair(models["target"], models[version], F64), dtype=F64)
    lengths = [1, 300, 7, 64, 2, 150, 33, 9, 120, 17, 250, 4, 80, 3, 45, 200][:batch]
    prompts = random_prompts(lengths, seed=batch)
    spec = run(engine, prompts, bucket(), max_new_tokens=32)
    plain = run(engine, prompts, bucket(speculation=False), max_new_tokens=32)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert all(c.spec is None for c in plain)
    assert any(n for c in spec for n in c.spec.per_round), "no draft accepted"


@pytest.mark.numerics
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_chunked_prefill_matches_one_shot(models, sampling):
    target, drafter = load_pair(models["soft"], models["v2"], F64)
    # Chunks of 7 split prompts mid-page and mid-prompt, and several prompts share one chunk.
    prompts = random_prompts([300, 1, 6, 7, 8, 50, 3], seed=2)
    one_shot = run(Engine(target, drafter, dtype=F64), prompts, bucket(), max_new_tokens=16, **sampling)
    chunked = run(Engine(target, drafter, max_num_batched_tokens=7, dtype=F64), prompts, bucket(),
                  max_new_tokens=16, **sampling)
    assert [c.token_ids for c in chunked] == [c.token_ids for c in one_shot]
    assert [c.spec.per_round for c in chunked] == [c.spec.per_round for c in one_shot]


def test_prefill_chunks_of_a_sequence_do_not_depend_on_its_neighbours(models, monkeypatch):
    """Where a prompt's prefill is cut decides which rows share a matmul, so it must not move with
    the batch: each prompt's chunks are the same alone, beside others, and in any order."""
    seen: dict[tuple, list[tuple[int, int]]] = {}

    def spy(self, chunks, block, caches, heads):
        for seq, n in chunks:
            seen.setdefault(tuple(seq.prompt), []).append((seq.prefilled, n))
        return original(self, chunks, block, caches, heads)

    original = Engine._prefill
    monkeypatch.setattr(Engine, "_prefill", spy)
    engine = Engine(*load_pair(models["target"], models["v2"]), max_num_batched_tokens=16)
    prompts = random_prompts([40, 5, 17, 16, 3, 33, 9], seed=3)
    splits = []
    for order, seqs in [(prompts, 1), (prompts, 16), (prompts[::-1], 4)]:
        seen.clear()
        run(engine, order, bucket(max_num_seqs=seqs), max_new_tokens=2)
        splits.append({p: seen[tuple(p)] for p in map(tuple, prompts)})
    assert splits[0] == splits[1] == splits[2]
    assert splits[0][tuple(prompts[0])] == [(0, 16), (16, 16), (32, 8)]


@pytest.mark.numerics
@pytest.mark.parametrize("speculation", [True, False], ids=["spec", "target_only"])
def test_min_tokens_holds_stop_ids_back_as_a_direct_loop_does(models, speculation):
    """float64 on both sides. The oracle: transformers' Qwen3 decoding greedily token by token,
    the stop ids' logits at -inf while fewer than min_tokens tokens are out."""
    hf = load_hf_model(models["target"]).double()
    stops, least, new = (0, 3), 6, 16  # unheld, these stop ids end every prompt here within 9 tokens
    prompts = random_prompts([5, 40, 13, 70], seed=6)
    engine = Engine(*load_pair(models["target"], models["v2"], F64), dtype=F64)
    got = run(engine, prompts, bucket(speculation=speculation), max_new_tokens=new, stop_token_ids=stops,
              min_tokens=least)
    free = run(engine, prompts, bucket(speculation=speculation), max_new_tokens=new, stop_token_ids=stops)
    assert all(len(c.token_ids) < least for c in free[1:]), [c.token_ids for c in free]
    for prompt, c in zip(prompts, got):
        ids, want = list(prompt), []
        with torch.no_grad():
            while len(want) < new:
                logits = hf(torch.tensor([ids])).logits[0, -1]
                if len(want) < least:
                    logits[list(stops)] = float("-inf")
                want.append(int(logits.argmax()))
                ids.append(want[-1])
                if want[-1] in stops:
                    break
        assert c.token_ids == want
    if speculation:
        assert any(n for c in got for n in c.spec.per_round), "no draft accepted"
    # Sampled: spec == target-only at the same coins, and no stop id among the first min_tokens.
    sampled = [run(engine, prompts, bucket(speculation=s), max_new_tokens=new, stop_token_ids=stops,
                   min_tokens=least, temperature=1.0) for s in (True, False)]
    assert [c.token_ids for c in sampled[0]] == [c.token_ids for c in sampled[1]]
    assert not any(t in stops for c in sampled[0] for t in c.token_ids[:least])


@pytest.mark.numerics
@pytest.mark.parametrize("speculation", [True, False], ids=["spec", "target_only"])
def test_logit_bias_moves_tokens_as_a_direct_loop_does(models, speculation):
    """float64 on both sides. The oracle: transformers' Qwen3 decoding greedily token by token
    with the biases added to its logits; an id past the vocabulary is ignored by the round."""
    hf = load_hf_model(models["target"]).double()
    bias, new = {0: -100.0, 5: 2.5, 3: 1.0}, 16
    prompts = random_prompts([5, 40, 13, 70], seed=6)
    engine = Engine(*load_pair(models["target"], models["v2"], F64), dtype=F64)
    got = run(engine, prompts, bucket(speculation=speculation), max_new_tokens=new,
              logit_bias=(*bias.items(), (VOCAB + 3, 50.0)))
    free = run(engine, prompts, bucket(speculation=speculation), max_new_tokens=new)
    assert [c.token_ids for c in got] != [c.token_ids for c in free]
    for prompt, c in zip(prompts, got):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new):
                logits = hf(torch.tensor([ids])).logits[0, -1]
                logits[list(bias)] += torch.tensor(list(bias.values()), dtype=torch.float64)
                ids.append(int(logits.argmax()))
        assert c.token_ids == ids[len(prompt):]
        assert 0 not in c.token_ids
    if speculation:
        assert any(n for c in got for n in c.spec.per_round), "no draft accepted"
    sampled = [run(engine, prompts, bucket(speculation=s), max_new_tokens=new, logit_bias=tuple(bias.items()),
                   temperature=1.0) for s in (True, False)]
    assert [c.token_ids for c in sampled[0]] == [c.token_ids for c in sampled[1]]


PENALTIES = [dict(repetition_penalty=1.6), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
             dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.8), {}]


def penalised_greedy(hf, prompt: list[int], new: int, repetition_penalty: float = 1.0,
                     frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> list[int]:
    """transformers' Qwen3 decoding token by token: its RepetitionPenaltyLogitsProcessor over
    prompt + output, then frequency and presence penalties over the output as the OpenAI API
    defines them; argmax."""
    repeat = RepetitionPenaltyLogitsProcessor(repetition_penalty) if repetition_penalty != 1 else None
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = hf(torch.tensor([ids])).logits[:, -1]
            if repeat is not None:
                logits = repeat(torch.tensor([ids]), logits)
            for token, times in Counter(ids[len(prompt):]).items():
                logits[0, token] -= frequency_penalty * times + presence_penalty
            ids.append(int(logits[0].argmax()))
    return ids[len(prompt):]


@pytest.mark.numerics
@pytest.mark.parametrize("speculation", [True, False], ids=["spec", "target_only"])
def test_penalties_match_a_direct_loop(models, speculation):
    """float64 on both sides; each row its own penalties in one batch. In a verify, row j is
    penalised as if the drafts before it were generated (the oracle knows nothing of drafts)."""
    hf = load_hf_model(models["target"]).double()
    new = 24
    prompts = random_prompts([5, 40, 13, 70, 9], seed=6)
    engine = Engine(*load_pair(models["target"], models["v2"], F64), dtype=F64)

    def generate(spec: bool = speculation, **common) -> list:
        reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=new, seed=i, **pen, **common))
                for i, (p, pen) in enumerate(zip(prompts, PENALTIES))]
        done = {c.key: c for c in engine.generate(reqs, bucket(speculation=spec))}
        return [done[r.key] for r in reqs]

    got = generate()
    free = run(engine, prompts, bucket(speculation=speculation), max_new_tokens=new)
    for prompt, pen, c, f in zip(prompts, PENALTIES, got, free):
        assert c.token_ids == penalised_greedy(hf, prompt, new, **pen), pen
    # The tiny target repeats itself: the three penalties alone each change what it writes (the
    # fourth row encourages repetition, the last has none).
    assert [c.token_ids != f.token_ids for c, f in zip(got, free)][:3] == [True] * 3
    assert got[-1].token_ids == free[-1].token_ids
    if speculation:
        assert any(n for c in got[:-1] for n in c.spec.per_round), "no draft accepted under penalties"
        # Sampled: spec == target-only at the same coins.
        sampled = [[c.token_ids for c in generate(spec, temperature=1.0)] for spec in (True, False)]
        assert sampled[0] == sampled[1]


LOGPROB_SETTINGS = [dict(logprobs=5), dict(temperature=0.7, logprobs=3, prompt_logprobs=2), {},
                    dict(logprobs=0, logit_bias=((2, 30.0),)), dict(temperature=1.2, top_k=3, prompt_logprobs=0)]


@pytest.mark.numerics
@pytest.mark.parametrize("speculation", [True, False], ids=["spec", "target_only"])
def test_logprobs_are_the_targets_log_softmax(models, speculation):
    """Each token's logprob and top-k equal log_softmax(logits / temperature) of transformers'
    Qwen3 run over prompt + output (float64), at every generated position whether the token
    came from a draft or not, before logit bias; prompt logprobs likewise along the prompt, with
    prompt chunks split across prefill steps."""
    hf = load_hf_model(models["soft"]).double()
    prompts = random_prompts([5, 40, 13, 70, 29], seed=9)
    engine = Engine(*load_pair(models["soft"], models["v2"], F64), dtype=F64, max_num_batched_tokens=32)
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=20, seed=i, **s))
            for i, (p, s) in enumerate(zip(prompts, LOGPROB_SETTINGS))]
    got = {c.key: c for c in engine.generate(reqs, bucket(speculation=speculation))}
    for req in reqs:
        c, p = got[req.key], req.params
        with torch.no_grad():
            logits = hf(torch.tensor([req.prompt_ids + c.token_ids])).logits[0]
        want = torch.log_softmax(logits / (p.temperature or 1.0), -1)
        n = len(req.prompt_ids)
        for lp, k, at, tokens in ((c.logprobs, p.logprobs, want[n - 1:-1], c.token_ids),
                                  (c.prompt_logprobs, p.prompt_logprobs, want[:n - 1], req.prompt_ids[1:])):
            if k is None:
                assert lp is None
                continue
            if lp is c.prompt_logprobs:
                assert lp.token[0] is None
                lp = after_first(lp)
            assert len(lp.token) == len(tokens) == len(at)
            expected = at.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            # float32 apart: logprobs are kept in float32 and the temperature is the sampler's float32
            torch.testing.assert_close(torch.tensor(lp.token, dtype=F64), expected, atol=1e-6, rtol=1e-6)
            top = at.topk(k, -1)
            assert lp.top_ids == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(lp.top, dtype=F64).view(len(tokens), k), top.values,
                                       atol=1e-6, rtol=1e-6)
    assert got[("3", 0)].token_ids[:3] == [2, 2, 2], "the bias moves tokens, not logprobs"
    if speculation:
        assert any(n for c in got.values() for n in c.spec.per_round), "no draft accepted"


# -- stop strings ----------------------------------------------------------------------------------
def decode(ids: list[int]) -> str:
    return "".join("abcdefgh"[i] for i in ids)


def test_stop_string_cuts_where_it_completes(models):
    engine = Engine(*load_pair(models["target"], models["v2"]), decode=decode)
    prompt = random_prompts([40], seed=4)
    free = run(engine, prompt, bucket(), max_new_tokens=40)[0]
    # Round r emits per_round[r] + 1 tokens after the first (prefill) token; find a 2-character
    # stop string that first completes strictly inside a multi-token round, so the cut falls
    # between accepted drafts, not at a round boundary.
    bounds, end = {1}, 1
    for n in free.spec.per_round:
        end += n + 1
        bounds.add(end)
    text = decode(free.token_ids)
    k = next((k for k in range(3, len(text)) if k not in bounds and text.find(text[k - 2:k]) == k - 2), None)
    assert k, f"no stop string completes inside a round of {free.spec.per_round}: try another prompt"
    stop = text[k - 2:k]

    got = run(engine, prompt, bucket(), max_new_tokens=40, stop=(stop, "zz"))[0]
    assert got.token_ids == free.token_ids[:k]
    assert got.text == text[:k - 2]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    # The last round counts only the tokens kept, as with stop tokens and max_new_tokens.
    assert 1 + sum(n + 1 for n in got.spec.per_round) == len(got.token_ids), got.spec.per_round
