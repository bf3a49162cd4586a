"""Retry runs: `dflash-batch retry` makes a run of exactly the chosen samples of a finished run
with changed settings; each retried sample equals what a whole run with those settings gives it
(same id, prompt and seed), and `export` merges the retry over its parent, the retry winning."""

from __future__ import annotations

import orjson
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dflash_batch.cli import main
from dflash_batch.io.export import export_dataset, export_openai_batch
from dflash_batch.job import load_job
from dflash_batch.plan.shards import Shard
from dflash_batch.retry import make_retry
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

VOLATILE = {"config_hash", "ttft_s", "latency_s"}


def keyed(rows: list[dict]) -> dict:
    return {(r["row_id"], r["sample_index"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in rows}


@pytest.fixture()
def parent(tmp_path, model_dir):
    rows = [{"id": f"r{i}", "prompt": f"row {i} says " + "hello " * (i % 5), "group": i % 3} for i in range(30)]
    rows[3]["prompt"] = "long " * 400  # over 256 tokens: prompt_too_long until max_model_len grows
    rows[4]["prompt"] = ""             # empty: an error no setting fixes
    write_jsonl(tmp_path / "p.jsonl", rows)
    stops = list(range(10, 40))  # the fake engine's tokens: about half the samples stop, half reach the length
    doc = base_job(model_dir, ["p.jsonl"], sampling={"n": 2, "max_new_tokens": 6, "stop_token_ids": stops},
                   input={"passthrough_columns": ["group"]}, output={"dir": "parent"})
    run_job(write_job(tmp_path, doc, "parent.yaml"), fake_factory(), Shard(0, 1), progress=False)
    return tmp_path / "parent", doc


def test_a_retry_reruns_exactly_the_chosen_samples_and_merges(tmp_path, parent):
    parent_dir, doc = parent
    before = keyed(read_out(parent_dir))
    chosen = {k for k, r in before.items() if r["status"] == "error" or r["finish_reason"] == "length"}
    assert 0 < len(chosen) < len(before) and ("r3", 0) in chosen and ("r4", 1) in chosen
    assert any(before[(i, 0)]["finish_reason"] != before[(i, 1)]["finish_reason"] for i, _ in before)  # per sample

    samples, rows = make_retry(parent_dir, ["error", "length"], ["sampling.max_new_tokens=40",
                                                                 "engine.max_model_len=2048"], tmp_path / "retry")
    assert samples == len(chosen) and rows == len({i for i, _ in chosen})
    job = load_job(tmp_path / "retry" / "job.yaml")
    run_job(job, fake_factory(), Shard(0, 1), progress=False)
    retried = keyed(read_out(tmp_path / "retry"))
    assert set(retried) == chosen

    # The oracle: a whole run with the retry's settings, from the start.
    whole = {**doc, "sampling": {**doc["sampling"], "max_new_tokens": 40},
             "engine": {**doc["engine"], "max_model_len": 2048}, "output": {**doc["output"], "dir": "whole"}}
    run_job(write_job(tmp_path, whole, "whole.yaml"), fake_factory(), Shard(0, 1), progress=False)
    want = keyed(read_out(tmp_path / "whole"))
    assert retried == {k: want[k] for k in chosen}
    assert retried[("r3", 0)]["status"] == "ok" and retried[("r4", 0)]["error_type"] == "empty_prompt"

    record = orjson.loads((tmp_path / "retry" / "run.json").read_bytes())
    parent_hash = orjson.loads((parent_dir / "run.json").read_bytes())["config_hash"]
    assert record["job"]["retry"]["parent_hash"] == parent_hash != record["config_hash"]
    assert record["job"]["retry"]["changes"] == {"sampling.max_new_tokens": 40, "engine.max_model_len": 2048}

    assert export_dataset(tmp_path / "retry", tmp_path / "hf", rows_per_file=17) == len(before)
    merged = keyed(pq.read_table(tmp_path / "hf" / "data").to_pylist())
    assert merged == {k: retried.get(k, r) for k, r in before.items()}
    assert sorted(p.name for p in (tmp_path / "hf" / "data").iterdir()) == [
        f"train-{i:05d}-of-00004.parquet" for i in range(4)]
    # The card: the first run's settings, the retry's changes beside them, no path of this machine.
    card = (tmp_path / "hf" / "README.md").read_text()
    assert f"max_new_tokens {doc['sampling']['max_new_tokens']}" in card and str(tmp_path) not in card
    assert "retry 1 (its rows replace those of the run before it): sampling.max_new_tokens 40, engine.max_model_len 2048" in card

    assert export_openai_batch(tmp_path / "retry", tmp_path / "merged.jsonl") == 30
    lines = {x["custom_id"]: x for x in map(orjson.loads, (tmp_path / "merged.jsonl").read_bytes().splitlines())}
    assert [c["text"] for c in lines["r3"]["response"]["body"]["choices"]] == [
        retried[("r3", i)]["response"] for i in range(2)]
    assert lines["r4"]["response"]["status_code"] == 400


def test_a_retry_of_a_retry_chains(tmp_path, parent):
    parent_dir, _ = parent
    make_retry(parent_dir, ["length"], ["sampling.max_new_tokens=8"], tmp_path / "r1")
    run_job(load_job(tmp_path / "r1" / "job.yaml"), fake_factory(), Shard(0, 1), progress=False)
    make_retry(tmp_path / "r1", ["length"], ["sampling.max_new_tokens=50"], tmp_path / "r2")
    run_job(load_job(tmp_path / "r2" / "job.yaml"), fake_factory(), Shard(0, 1), progress=False)
    layers = [keyed(read_out(d)) for d in (parent_dir, tmp_path / "r1", tmp_path / "r2")]
    assert 0 < len(layers[2]) < len(layers[1]) < len(layers[0])
    assert export_dataset(tmp_path / "r2", tmp_path / "hf") == len(layers[0])
    merged = keyed(pq.read_table(tmp_path / "hf" / "data").to_pylist())
    assert merged == {k: layers[2].get(k, layers[1].get(k, r)) for k, r in layers[0].items()}


@pytest.mark.parametrize("args, message", [
    (["--where", "error", "--set", "input.paths=[x.jsonl]"], "input.paths cannot change"),
    (["--where", "error", "--set", "output.dir=elsewhere"], "output.dir cannot change"),
    (["--where", "error", "--set", "input={paths: [x.jsonl]}"], "not a section"),
    (["--where", "error", "--set", "sampling.n=1"], "sampling.n cannot change"),
    (["--where", "error", "--set", "sampling.seed=3"], "sampling.seed cannot change"),
    (["--where", "errors"], "expected error, length or error_type=NAME"),
    (["--where", "error", "--set", "sampling.temperature=-1"], "sampling.temperature"),
    (["--where", "error", "--set", "sampling.max_new_tokens"], "expected FIELD=VALUE"),
])
def test_retry_refuses_what_it_cannot_do(tmp_path, parent, args, message):
    result = CliRunner().invoke(main, ["retry", str(parent[0]), *args, "--output-dir", str(tmp_path / "new")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "new").exists()


def test_retry_wants_a_finished_run_and_says_when_nothing_matches(tmp_path, parent):
    parent_dir, _ = parent
    result = CliRunner().invoke(main, ["retry", str(parent_dir), "--where", "error_type=no_such_error",
                                       "--output-dir", str(tmp_path / "new")])
    assert result.exit_code == 0 and "nothing to retry" in result.output and not (tmp_path / "new").exists()
    for f in (parent_dir / "stats").iterdir():  # as if the shard had been preempted
        f.unlink()
    result = CliRunner().invoke(main, ["retry", str(parent_dir), "--where", "error",
                                       "--output-dir", str(tmp_path / "new")])
    assert result.exit_code == 2 and "have not finished" in result.output


def test_a_retry_setting_replaces_the_rows_own_value(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"row {i}", "budget": 3} for i in range(12)])
    doc = base_job(model_dir, ["p.jsonl"], input={"sampling_columns": {"max_new_tokens": "budget"}},
                   sampling={"stop_token_ids": list(range(10, 40))}, output={"dir": "parent"})
    run_job(write_job(tmp_path, doc, "parent.yaml"), fake_factory(), Shard(0, 1), progress=False)
    make_retry(tmp_path / "parent", ["length"], ["sampling.max_new_tokens=30"], tmp_path / "retry")
    run_job(load_job(tmp_path / "retry" / "job.yaml"), fake_factory(), Shard(0, 1), progress=False)
    retried = keyed(read_out(tmp_path / "retry"))
    assert retried and max(r["completion_tokens"] for r in retried.values()) > 3
    whole = {**doc, "input": {**doc["input"], "sampling_columns": {}}, "output": {"dir": "whole"},
             "sampling": {**doc["sampling"], "max_new_tokens": 30}}
    run_job(write_job(tmp_path, whole, "whole.yaml"), fake_factory(), Shard(0, 1), progress=False)
    want = keyed(read_out(tmp_path / "whole"))
    assert retried == {k: want[k] for k in retried}


def test_a_retry_chooses_from_its_parents_merged_rows_and_an_error_keeps_the_parents_answer(tmp_path, parent):
    parent_dir, _ = parent
    before = keyed(read_out(parent_dir))
    make_retry(parent_dir, ["error"], ["engine.max_model_len=2048"], tmp_path / "r1")
    run_job(load_job(tmp_path / "r1" / "job.yaml"), fake_factory(), Shard(0, 1), progress=False)
    # r1 holds no length row of its own: r2 chooses the parent's, through the merge
    samples, _ = make_retry(tmp_path / "r1", ["length"], ["sampling.max_new_tokens=3000"], tmp_path / "r2")
    lengths = {k for k, r in {**before, **keyed(read_out(tmp_path / "r1"))}.items() if r["finish_reason"] == "length"}
    assert samples == len(lengths) > 0
    # 3000 new tokens do not fit r1's max_model_len of 2048: every retried sample fails at preparation
    run_job(load_job(tmp_path / "r2" / "job.yaml"), fake_factory(), Shard(0, 1), progress=False)
    r2 = keyed(read_out(tmp_path / "r2"))
    failed = {k for k, r in r2.items() if r["status"] == "error"}
    assert failed == set(r2) == lengths and {r["error_type"] for r in r2.values()} == {"max_new_tokens_too_large"}
    export_dataset(tmp_path / "r2", tmp_path / "hf")
    merged = keyed(pq.read_table(tmp_path / "hf" / "data").to_pylist())
    for k in failed:  # the partial answers stay
        assert merged[k]["status"] == "ok" and merged[k]["finish_reason"] == "length"


def test_mixed_passthrough_types_export(tmp_path, model_dir):
    rows = [{"id": f"r{i}", "prompt": f"row {i}", "meta": i} for i in range(5)]
    rows += [{"id": f"s{i}", "prompt": f"row {i}", "meta": [i] if i % 2 else "x"} for i in range(5)]
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(model_dir, ["p.jsonl"], input={"passthrough_columns": ["meta"]})  # parts of 5 rows
    run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    assert export_openai_batch(tmp_path / "out", tmp_path / "out.jsonl") == 10
