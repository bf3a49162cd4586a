"""Structured output (sampling.json_schema / regex / choice through xgrammar): each verify row is
masked by its sample's grammar after the drafts before it, so outputs always parse, speculative
== target-only under the grammar, and greedy decoding equals a direct loop (transformers' Qwen3
masked by the grammar token by token); sampled outputs follow the target's law restricted to
the grammar (chi-square over every token path of a small grammar, at a temperature that spreads it)."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.grammar import Grammars
from dflash_batch.job import JobError, SamplingSpec
from dflash_batch.plan.shards import Shard
from dflash_batch.tokenizer import Tokenizer
from dflash_batch.runner import open_tokenizer, run_job
from dflash_batch.testing.tokenizer import make_tokenizer_dir
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, random_prompts
from tests.jobs_util import base_job, read_out, write_job, write_jsonl
from tests.tiny_models import load_hf_model

xgrammar = pytest.importorskip("xgrammar")

VOCAB = 416  # the tokenizer's 400 ids, and 16 the model has past them (a padded head)
FAVOURITES = ["a", "b", "Ġ", ".", "x", "y", "1", "2"]  # what the target mostly writes
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 30]}},
          "required": ["ok", "n"], "additionalProperties": False}
SPECS = [dict(regex="[ab ]{0,30}\\."), dict(choice=["ab ab", "xy", "a b a"]), dict(regex="[a-z12 ]*"),
         dict(json_schema=SCHEMA)]


def parses(spec: dict, text: str) -> bool:
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    if "choice" in spec:
        return text in spec["choice"]
    value = json.loads(text)
    # whitespace fixed as json.dumps writes it (", " and ": ", nothing else): none to spend a budget on
    return text == json.dumps(value) and set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 30)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Qwen3 + DFlash v2 pair beside a 400-id tokenizer. The target decodes like an
    8-token vocabulary moved onto FAVOURITES' ids (so drafts are accepted and grammars both
    allow and refuse them), and its other ids score 0."""
    d = tmp_path_factory.mktemp("structured")
    target = make_target(d / "target", vocab=VOCAB, active=len(FAVOURITES))
    make_tokenizer_dir(target, vocab_size=400)
    tok = Tokenizer(target)
    ids = [tok.token_to_id(t) for t in FAVOURITES]
    weights = load_file(target / "model.safetensors")
    order = list(range(VOCAB))
    for i, j in enumerate(ids):  # a relabelling of the vocabulary: the same model otherwise
        order[i], order[j] = order[j], order[i]
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        weights[name] = weights[name][order].contiguous()
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    make_drafter(d / "v2", 2, vocab=VOCAB)
    return target, d / "v2", tok


def requests(tok: Tokenizer, grammars: Grammars, prompts: list[list[int]], specs: list[dict], **params) -> list:
    stops = (tok.eos_id,)
    return [Request((str(i), 0), p, SamplingParams(stop_token_ids=stops, seed=i, **params),
                    grammars.matcher(grammars.compile(SamplingSpec(**s)), stops))
            for i, (p, s) in enumerate(zip(prompts, specs))]


def masked_greedy(hf, grammars: Grammars, spec: dict, prompt: list[int], stop: int, new: int) -> list[int]:
    """transformers' Qwen3, token by token, its logits masked by a fresh matcher of the grammar."""
    m = grammars.matcher(grammars.compile(SamplingSpec(**spec)), (stop,))()
    bits = xgrammar.allocate_token_bitmask(1, VOCAB)
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < new:
            logits = hf(torch.tensor([ids])).logits[:, -1, :VOCAB].float()
            m.fill_next_token_bitmask(bits)
            xgrammar.apply_token_bitmask_inplace(logits, bits)
            ids.append(int(logits.argmax()))
            assert m.accept_token(ids[-1])
            if ids[-1] == stop:
                break
    return ids[len(prompt):]


@pytest.mark.numerics
def test_greedy_under_grammars_is_the_masked_target_loop(pair):
    target, drafter, tok = pair
    grammars = Grammars(tok, VOCAB, [tok.eos_id])
    engine = Engine(*load_pair(target, drafter, F64), dtype=F64, decode=tok.decode)
    prompts = random_prompts([5, 20, 9, 30], vocab=400, seed=1)
    hf = load_hf_model(target).double()
    got = {}
    for speculation in (True, False):
        done = engine.generate(requests(tok, grammars, prompts, SPECS, max_new_tokens=40), bucket(speculation=speculation))
        got[speculation] = {c.key: c for c in done}
    for i, (prompt, spec) in enumerate(zip(prompts, SPECS)):
        c = got[True][(str(i), 0)]
        assert c.token_ids == got[False][(str(i), 0)].token_ids, spec
        assert c.token_ids == masked_greedy(hf, grammars, spec, prompt, tok.eos_id, 40), spec
        if c.finish_reason == "stop":
            assert parses(spec, c.text), (spec, c.text)
    assert sum(c.finish_reason == "stop" for c in got[True].values()) >= 3
    assert any(n for c in got[True].values() for n in c.spec.per_round), "no draft accepted under a grammar"


def token_paths(hf, grammars: Grammars, spec: dict, prompt: list[int], stop: int,
                temperature: float) -> dict[tuple, float]:
    """Every token sequence the grammar allows, ending at the stop token, with its probability
    under the target at `temperature` restricted to the grammar (float64)."""
    compiled = grammars.compile(SamplingSpec(**spec))
    bits = xgrammar.allocate_token_bitmask(1, VOCAB)
    paths: dict[tuple, float] = {}

    def walk(path: tuple, p: float) -> None:
        m = grammars.matcher(compiled, (stop,))()
        assert all(m.accept_token(t) for t in path)
        m.fill_next_token_bitmask(bits)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(path)])).logits[0, -1, :VOCAB]
        allowed = torch.tensor([(int(bits[0, t // 32]) >> (t % 32)) & 1 for t in range(VOCAB)], dtype=torch.bool)
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")) / temperature, -1)
        for t in allowed.nonzero()[:, 0].tolist():
            if t == stop:
                paths[path + (t,)] = p * float(probs[t])
            else:
                walk(path + (t,), p * float(probs[t]))

    walk((), 1.0)
    return paths


@pytest.mark.numerics
def test_sampled_outputs_follow_the_target_law_under_a_grammar(pair):
    target, drafter, tok = pair
    grammars = Grammars(tok, VOCAB, [tok.eos_id])
    spec = dict(choice=["ab ab", "xy", "a b a", "ba", "1.2"])
    prompt = random_prompts([12], vocab=400, seed=4)[0]
    temperature = 4.0  # the target is sure of its favourites: spread the law over the paths
    law = token_paths(load_hf_model(target).double(), grammars, spec, prompt, tok.eos_id, temperature)
    assert abs(sum(law.values()) - 1) < 1e-9 and len(law) > 4
    engine = Engine(*load_pair(target, drafter))
    n = 2000
    reqs = requests(tok, grammars, [prompt] * n, [spec] * n, temperature=temperature, max_new_tokens=12)
    done = list(engine.generate(reqs, bucket(max_num_seqs=64)))
    counts = Counter(tuple(c.token_ids) for c in done)
    assert set(counts) <= set(law), set(counts) - set(law)
    # Paths expected fewer than 5 times are pooled into one cell.
    common = [p for p in law if law[p] * n >= 5]
    observed = [counts[p] for p in common] + [n - sum(counts[p] for p in common)]
    expected = [law[p] * n for p in common] + [n * (1 - sum(law[p] for p in common))]
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
        expected[-1] += n - sum(expected)
        observed[-1] += n - sum(observed)
    assert len(common) >= 4, {p: law[p] for p in law}
    assert chisquare(observed, expected).pvalue > 1e-3, list(zip(common, observed, expected))
    assert any(n for c in done for n in c.spec.per_round), "no draft accepted"
    # The same coins without the drafter give the same samples.
    alone = {c.key: c.token_ids for c in engine.generate(reqs[:200], bucket(max_num_seqs=64, speculation=False))}
    assert all(alone[c.key] == c.token_ids for c in done if c.key in alone)


def test_grammars_through_run(tmp_path, pair):
    """The job's choice for every row, a regex or a JSON schema from a row's column, and a row
    whose regex does not compile: that row alone is an error row, the rest parse."""
    target, drafter, tok = pair
    prompts = random_prompts([5, 20, 9, 30], vocab=400, seed=1)
    rows = [{"id": "r0", "ids": prompts[0]}, {"id": "r1", "ids": prompts[1], "re": "[ab ]{0,30}\\."},
            {"id": "r2", "ids": prompts[2], "js": SCHEMA}, {"id": "r3", "ids": prompts[3], "re": "(ab"}]
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(target, ["p.jsonl"], sampling={"max_new_tokens": 40, "choice": ["ab ab", "xy", "a b a"]},
                   input={"prompt_column": None, "input_ids_column": "ids", "workers": 0,
                          "sampling_columns": {"regex": "re", "json_schema": "js"}},
                   engine={"compile": False}, output={"include_token_ids": True})
    job = write_job(tmp_path, doc)
    engine = Engine(*load_pair(target, drafter), decode=tok.decode)
    run_job(job, lambda j, t: engine, Shard(0, 1), progress=False)
    out = {r["row_id"]: r for r in read_out(tmp_path / "out")}
    assert out["r3"]["status"] == "error" and out["r3"]["error_type"] == "bad_grammar"
    assert "sampling.regex" in out["r3"]["error"]
    specs = {"r0": doc["sampling"], "r1": {"regex": rows[1]["re"]}, "r2": {"json_schema": SCHEMA}}
    for row_id, spec in specs.items():
        r = out[row_id]
        assert r["status"] == "ok" and r["finish_reason"] == "stop", r
        assert parses({k: v for k, v in spec.items() if k in ("regex", "choice", "json_schema")}, r["response"])


@pytest.mark.parametrize("sampling, message", [
    ({"regex": "(ab"}, "sampling.regex"),
    ({"json_schema": {"type": "no-such-type"}}, "sampling.json_schema"),
    ({"regex": "a", "choice": ["a"]}, "at most one of json_schema, regex and choice"),
    ({"choice": ["a"], "ignore_eos": True}, "needs a stop token"),
    ({"choice": []}, "choice"),
])
def test_bad_grammars_are_refused_before_any_work(tmp_path, pair, sampling, message):
    doc = base_job(pair[0], ["p.jsonl"], sampling=sampling)
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    with pytest.raises(JobError, match=re.escape(message)):
        open_tokenizer(write_job(tmp_path, doc))


def test_structured_output_without_xgrammar_is_refused(tmp_path, pair, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    doc = base_job(pair[0], ["p.jsonl"], input={"sampling_columns": {"json_schema": "schema"}})
    with pytest.raises(JobError, match=r"needs xgrammar: pip install 'dflash-batch\[structured\]'"):
        open_tokenizer(write_job(tmp_path, doc))
