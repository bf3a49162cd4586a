"""Different sampling settings in one batch: every request decodes exactly as it does alone, on
both model families (the settings are per row all the way down: a row's temperature, top-k,
top-p, min-p, penalties, budget and stop ids never leak to its neighbours), and through `dflash-batch run` with
per-row overrides from sampling_columns. float64, so "exactly" is exact."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from dflash_batch.testing.tokenizer import make_tokenizer_dir
from dflash_batch.testing import kimi_pair
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, random_prompts
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

SETTINGS = [dict(), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8),
            dict(temperature=1.0, repetition_penalty=1.4), dict(temperature=0.5, top_k=2, top_p=0.9),
            dict(frequency_penalty=0.6, presence_penalty=0.9),
            dict(temperature=2.0, top_k=5, min_p=0.2), dict(temperature=1.5, min_p=0.5)]


def requests(vocab: int) -> list[Request]:
    prompts = random_prompts([5, 31, 12, 2, 47, 9, 20, 14], vocab=vocab, seed=8)
    return [Request((str(i), 0), p, SamplingParams(max_new_tokens=8 + 5 * (i % 3), seed=900 + i,
                                                   stop_token_ids=(3,) if i % 2 else (), **s))
            for i, (p, s) in enumerate(zip(prompts, SETTINGS))]


def decoded(engine: Engine, reqs: list[Request], max_num_seqs: int) -> dict:
    return {c.key: (c.token_ids, c.spec.per_round if c.spec else None)
            for c in engine.generate(iter(reqs), bucket(max_num_seqs=max_num_seqs))}


def each_alone(engine: Engine, reqs: list[Request]) -> dict:
    return {k: v for r in reqs for k, v in decoded(engine, [r], 1).items()}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    target = make_target(d / "target", vocab=8)
    make_drafter(d / "v2", 2)
    return target, d / "v2"


def test_mixed_settings_in_one_batch_qwen3(qwen3):
    engine = Engine(*load_pair(*qwen3, F64), dtype=F64)
    reqs = requests(8)
    together = decoded(engine, reqs, 8)
    assert together == each_alone(engine, reqs)
    assert len({tuple(v[0]) for v in together.values()}) > 3, "the settings should make outputs differ"


def test_mixed_settings_in_one_batch_kimi(tmp_path):
    engine = Engine(*kimi_pair.load_pair(*kimi_pair.make_kimi_pair(tmp_path / "k"), F64), dtype=F64)
    reqs = requests(kimi_pair.VOCAB)
    assert decoded(engine, reqs, 8) == each_alone(engine, reqs)


def _model_dir(tmp_path, target):
    """The tiny target beside a tokenizer (261 ids; the model has 8: prompts come as ids, and the
    engine is built by the test rather than by build_engine, which would refuse the pairing)."""
    tokdir = tmp_path / "model"
    make_tokenizer_dir(tokdir, vocab_size=256)
    (tokdir / "config.json").write_text((target / "config.json").read_text())
    for f in target.iterdir():
        if f.name.endswith(".safetensors"):
            (tokdir / f.name).symlink_to(f)
    return tokdir


def _run(tmp_path, qwen3, rows: list[dict], sampling_columns: dict, sampling: dict | None = None) -> tuple:
    target, drafter = qwen3
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(_model_dir(tmp_path, target), ["p.jsonl"], sampling={"ignore_eos": True, **(sampling or {})},
                   input={"prompt_column": None, "input_ids_column": "ids", "workers": 0,
                          "sampling_columns": sampling_columns},
                   engine={"max_num_seqs": 8, "compile": False}, output={"include_token_ids": True})
    doc["model"].update(drafter=str(drafter), dtype="float64")
    engine = Engine(*load_pair(*qwen3, F64), dtype=F64)
    run_job(write_job(tmp_path, doc), lambda j, tok: engine, Shard(0, 1), progress=False)
    out = {r["row_id"]: r for r in read_out(tmp_path / "out")}
    assert all(r["status"] == "ok" for r in out.values()), [r["error"] for r in out.values()]
    return engine, out


def test_per_row_overrides_through_run(tmp_path, qwen3):
    """sampling_columns give each row its own temperature, top-k, top-p and budget; the job's
    rows equal the engine decoding each request alone with those settings."""
    prompts = random_prompts([5, 31, 12, 2, 47, 9, 20, 14], seed=8)
    rows = [{"id": f"r{i}", "ids": p, "t": s.get("temperature"), "k": s.get("top_k"), "p": s.get("top_p"),
             "mp": s.get("min_p"), "rp": s.get("repetition_penalty"), "fp": s.get("frequency_penalty"),
             "pp": s.get("presence_penalty"), "m": 8 + 5 * (i % 3)} for i, (p, s) in enumerate(zip(prompts, SETTINGS))]
    engine, out = _run(tmp_path, qwen3, rows, {"temperature": "t", "top_k": "k", "top_p": "p", "min_p": "mp",
                                               "repetition_penalty": "rp", "frequency_penalty": "fp",
                                               "presence_penalty": "pp", "max_new_tokens": "m"})
    for i, (row, s) in enumerate(zip(rows, SETTINGS)):
        got = out[row["id"]]
        alone = Request((row["id"], 0), row["ids"], SamplingParams(max_new_tokens=row["m"], seed=got["seed"], **s))
        assert got["response_token_ids"] == decoded(engine, [alone], 1)[alone.key][0], row["id"]


def test_logprob_columns_through_run(tmp_path, qwen3):
    """sampling.logprobs for every row, prompt_logprobs for the rows whose column asks: the
    Parquet list columns hold what the engine computes for the request alone, aligned with
    response_token_ids and the prompt (null at its first token, and where a row did not ask)."""
    prompts = random_prompts([5, 31, 12], seed=8)
    rows = [{"id": f"r{i}", "ids": p, "plp": [None, 2, 0][i]} for i, p in enumerate(prompts)]
    engine, out = _run(tmp_path, qwen3, rows, {"prompt_logprobs": "plp"},
                       sampling={"logprobs": 3, "temperature": 0.9, "max_new_tokens": 10})
    for row in rows:
        got = out[row["id"]]
        alone = engine.generate([Request((row["id"], 0), row["ids"], SamplingParams(
            temperature=0.9, max_new_tokens=10, seed=got["seed"], logprobs=3, prompt_logprobs=row["plp"]))],
            bucket(max_num_seqs=1))
        c = next(alone)
        assert got["response_token_ids"] == c.token_ids
        assert got["logprobs"] == pytest.approx(c.logprobs.token, abs=1e-6)
        assert got["top_logprob_ids"] == c.logprobs.top_ids and len(got["top_logprob_ids"][0]) == 3
        assert np.allclose(got["top_logprobs"], c.logprobs.top, atol=1e-6)
        if row["plp"] is None:
            assert got["prompt_logprobs"] is None and got["prompt_top_logprobs"] is None
        else:
            assert len(got["prompt_logprobs"]) == len(row["ids"]) and got["prompt_logprobs"][0] is None
            assert got["prompt_logprobs"][1:] == pytest.approx(c.prompt_logprobs.token[1:], abs=1e-6)
            assert got["prompt_top_logprob_ids"][1:] == c.prompt_logprobs.top_ids[1:]
            assert [len(x) for x in got["prompt_top_logprob_ids"][1:]] == [row["plp"]] * (len(row["ids"]) - 1)


def test_shared_heads_through_run(tmp_path, qwen3):
    """Rows that share an 80-token head: each row's cached_tokens is what it took from the head
    (all but the head's first row), summed per bucket by the run's stats and by `status`; the
    outputs equal each row decoded alone."""
    from click.testing import CliRunner

    from dflash_batch.cli import main
    from dflash_batch.io.ledger import write_shard_stats

    head = random_prompts([80], seed=5)[0]
    rows = [{"id": f"r{i}", "ids": head + t} for i, t in enumerate(random_prompts([3, 20, 1, 9], seed=6))]
    rows.append({"id": "alone", "ids": random_prompts([30], seed=7)[0]})
    engine, out = _run(tmp_path, qwen3, rows, {}, sampling={"max_new_tokens": 6})
    assert sorted(r["cached_tokens"] for r in out.values()) == [0, 0, 80, 80, 80]
    for row in rows:
        alone = Request((row["id"], 0), row["ids"], SamplingParams(max_new_tokens=6, seed=out[row["id"]]["seed"]))
        assert out[row["id"]]["response_token_ids"] == decoded(engine, [alone], 1)[alone.key][0], row["id"]
    stats = write_shard_stats(tmp_path / "out", 0, complete=False)
    (bucket_stats,) = stats.values()
    prompt = sum(len(r["ids"]) for r in rows)
    assert (bucket_stats["prompt_tokens"], bucket_stats["cached_tokens"]) == (prompt, 240)
    status = CliRunner().invoke(main, ["status", str(tmp_path / "out")])
    assert re.search(rf"0-256 +5 +0 +{prompt} +{240 / prompt:.0%}", status.output), status.output


def close(a, b, atol: float = 1e-9) -> bool:
    """Equal values, floats within atol, nested lists compared item by item."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, atol) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= atol
    return a == b


def test_heads_score_prompts_at_each_rows_temperature_through_run_and_the_api(tmp_path, qwen3):
    """Rows on one 80-token head asking prompt logprobs at two temperatures and two counts, and
    rows asking none (one of them admitted first): through `run` and through the Python API,
    every row's outputs, logprobs and prompt logprobs equal a run that shares nothing. Rows
    share a head only with rows asking the same (the head's scores are computed once): three
    heads, each computed once (240 cached tokens)."""
    import dflash_batch

    head = random_prompts([80], seed=5)[0]
    asks = [(None, 1.0), (2, 0.5), (2, 1.5), (2, 0.5), (3, 1.5), (None, 1.0), (2, 1.5)]
    rows = [{"id": f"r{i}", "ids": head + t, "plp": plp, "t": t_}
            for i, (t, (plp, t_)) in enumerate(zip(random_prompts([3, 20, 1, 9, 5, 2, 7], seed=6), asks))]
    sampling = {"logprobs": 2, "max_new_tokens": 6}
    columns = {"prompt_logprobs": "plp", "temperature": "t"}
    outputs = {}
    for share in (True, False):
        engine = Engine(*load_pair(*qwen3, F64), dtype=F64, share_prompts=share)
        target, drafter = qwen3
        write_jsonl(tmp_path / "p.jsonl", rows)
        doc = base_job(_model_dir(tmp_path / str(share), target), ["p.jsonl"], sampling={"ignore_eos": True,
                                                                                           **sampling},
                       input={"prompt_column": None, "input_ids_column": "ids", "workers": 0,
                              "sampling_columns": columns},
                       engine={"max_num_seqs": 8, "compile": False}, output={"include_token_ids": True})
        doc["model"].update(drafter=str(drafter), dtype="float64")
        doc["output"]["dir"] = f"run-{share}"
        run_job(write_job(tmp_path, doc), lambda j, tok: engine, Shard(0, 1), progress=False)
        outputs["run", share] = read_out(tmp_path / f"run-{share}")
        doc["output"]["dir"] = str(tmp_path / f"api-{share}")
        del doc["input"]["paths"]
        outputs["api", share] = list(dflash_batch.generate(rows, doc, engine_factory=lambda j, tok: engine))
    volatile = {"ttft_s", "latency_s", "cached_tokens"}
    for way in ("run", "api"):
        got, want = ({r["row_id"]: {k: v for k, v in r.items() if k not in volatile} for r in outputs[way, s]}
                     for s in (True, False))
        assert all(r["status"] == "ok" for r in got.values()), [r["error"] for r in got.values()]
        assert got.keys() == want.keys() and len(got) == len(rows)
        for row_id in want:
            for column, value in want[row_id].items():
                assert close(got[row_id][column], value), (way, row_id, column)
        cached = {r["row_id"]: r["cached_tokens"] for r in outputs[way, True]}
        assert sum(cached.values()) == 240 and cached["r4"] == 0, (way, cached)
