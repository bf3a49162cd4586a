"""The Python API (dflash_batch.generate): the rows a job file gives through `run`, yielded as
they finish, from a list of dicts or an Arrow table; a second call resumes."""

from __future__ import annotations

import pyarrow as pa

import dflash_batch
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

VOLATILE = {"ttft_s", "latency_s", "config_hash"}  # timings, and the hash of a job whose paths differ


def same(rows: list[dict]) -> dict:
    return {(r["row_id"], r["sample_index"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in rows}


def test_generate_gives_the_rows_run_gives(tmp_path, model_dir):
    rows = [{"id": f"r{i}", "prompt": "hello " * i, "group": i % 3} for i in range(12)]  # r0: an error row
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(model_dir, ["p.jsonl"], sampling={"n": 2}, input={"passthrough_columns": ["group"]})
    run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    want = same(read_out(tmp_path / "out"))
    assert len(want) == 24 and want[("r0", 0)]["status"] == "error"

    api_job = write_job(tmp_path, {**doc, "output": {**doc["output"], "dir": "api"}}, "api.yaml")
    got = list(dflash_batch.generate(rows, api_job, engine_factory=fake_factory()))
    assert same(got) == want
    assert same(read_out(tmp_path / "api")) == want  # committed as `run` commits them
    assert list(dflash_batch.generate(rows, api_job, engine_factory=fake_factory())) == []  # resumed: all done

    table_job = write_job(tmp_path, {**doc, "output": {**doc["output"], "dir": "table"}}, "table.yaml")
    got = list(dflash_batch.generate(pa.Table.from_pylist(rows), table_job, engine_factory=fake_factory()))
    assert same(got) == want


def test_generate_takes_openai_request_lines(tmp_path, model_dir):
    requests = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": f"row {i}", "max_tokens": 3 + i, "n": 1 + i % 2}} for i in range(5)]
    doc = base_job(model_dir, ["unused.jsonl"], input={"format": "openai_batch", "prompt_column": None,
                                                       "id_column": None})
    job = write_job(tmp_path, doc)
    got = list(dflash_batch.generate(pa.Table.from_pylist(requests), job, engine_factory=fake_factory()))
    assert sorted((r["row_id"], r["sample_index"], r["completion_tokens"]) for r in got) == sorted(
        (f"c{i}", s, 3 + i) for i in range(5) for s in range(1 + i % 2))
