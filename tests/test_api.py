"""The Python API (dflash_batch.generate): the rows a job file gives through `run`, yielded as
they finish, from a list of dicts or an Arrow table; a second call resumes and yields every row
of the run; closing the generator stops the run with what finished committed; one call at a time
per output directory."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pyarrow as pa
import pytest
import yaml

import dflash_batch
from dflash_batch.job import JobError
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import FakeEngine, fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

VOLATILE = {"ttft_s", "latency_s", "config_hash"}  # timings, and the hash of a job whose paths differ


def same(rows: list[dict]) -> dict:
    return {(r["row_id"], r["sample_index"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in rows}


def no_model(job, tokenizer):
    raise AssertionError("a finished run loaded a model")


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
    # Finished: no model is loaded, and the caller still gets every row, from the parts.
    assert same(list(dflash_batch.generate(rows, api_job, engine_factory=no_model))) == want

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


def _rows(n: int) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f"prompt {i} " + "fox " * (i % 4)} for i in range(n)]


def _doc(model_dir, **output) -> dict:
    doc = base_job(model_dir, [], input={"workers": 0}, output={"rows_per_part": 1000, **output})
    del doc["input"]["paths"]  # generate gives the rows
    return doc


def test_a_job_for_generate_needs_no_input_paths(tmp_path, model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = list(dflash_batch.generate(_rows(3), _doc(model_dir), engine_factory=fake_factory()))
    assert sorted(r["row_id"] for r in got) == ["r0", "r1", "r2"]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_doc(model_dir, dir="from_file")))
    got = list(dflash_batch.generate(_rows(2), tmp_path / "job.yaml", engine_factory=fake_factory()))
    assert sorted(r["row_id"] for r in got) == ["r0", "r1"]


class HoldsTheLast:
    """The fake engine, holding its last completion until the caller has received a row (for at
    most 10 s: a caller that waits for the whole run fails the test instead of hanging it)."""

    def __init__(self):
        self.received, self.held_out = threading.Event(), False

    def __call__(self, job, tokenizer):
        engine = FakeEngine(tokenizer)
        every = engine.generate

        def generate(requests, bucket):
            done = list(every(requests, bucket))
            for i, c in enumerate(done):
                if i == len(done) - 1 and not self.received.wait(timeout=10):
                    self.held_out = True
                yield c

        engine.generate = generate
        return engine


def test_the_first_row_arrives_before_the_last_request_finishes(tmp_path, model_dir):
    engine = HoldsTheLast()
    rows = dflash_batch.generate(_rows(6), _doc(model_dir, dir=str(tmp_path / "out")), engine_factory=engine)
    first = next(rows)
    engine.received.set()
    rest = list(rows)
    assert not engine.held_out and len([first, *rest]) == 6


def test_a_call_closed_early_commits_what_finished_and_the_next_yields_every_row_once(tmp_path, model_dir):
    """The caller breaks out after 3 of 40 rows (parts hold 1000: nothing was written yet): the
    run stops at once with every finished row committed, the 3 among them; the next call yields
    those first, then the others, every row of the run once."""
    want = same(list(dflash_batch.generate(_rows(40), _doc(model_dir, dir=str(tmp_path / "ref")),
                                           engine_factory=fake_factory())))
    doc = _doc(model_dir, dir=str(tmp_path / "out"))
    gen = dflash_batch.generate(_rows(40), doc, engine_factory=fake_factory(delay_s=0.05))
    got = [next(gen) for _ in range(3)]
    t0 = time.monotonic()
    gen.close()
    assert time.monotonic() - t0 < 5
    assert not [t for t in threading.enumerate() if t.name == "dflash-batch-run"]  # the run has ended
    committed = same(read_out(tmp_path / "out"))
    assert set(same(got)) <= set(committed) and len(committed) < 40

    again = list(dflash_batch.generate(_rows(40), doc, engine_factory=fake_factory()))
    assert max(Counter((r["row_id"], r["sample_index"]) for r in again).values()) == 1
    assert same(again) == want
    assert same(again[:len(committed)]) == committed  # the committed rows first


def test_a_second_call_on_the_same_output_while_one_runs_is_refused(tmp_path, model_dir):
    doc = _doc(model_dir, dir=str(tmp_path / "out"))
    first = dflash_batch.generate(_rows(20), doc, engine_factory=fake_factory(delay_s=0.02))
    got = [next(first)]
    second = dflash_batch.generate(_rows(20), doc, engine_factory=fake_factory())
    with pytest.raises(JobError, match="another generate call of this process is running on this output directory"):
        next(second)
    got += list(first)
    assert sorted(r["row_id"] for r in got) == sorted(f"r{i}" for i in range(20))
    assert len(read_out(tmp_path / "out")) == 20


def test_a_run_whose_rows_mostly_failed_raises_after_yielding_them(tmp_path, model_dir):
    """output.max_error_fraction holds for generate as for `run` (exit 3): every row is yielded
    and committed, then a JobError with the summary by error_type."""
    rows = [{"id": f"r{i}", "prompt": "" if i else "hello"} for i in range(4)]  # 3 empty_prompt rows of 4
    doc = base_job(model_dir, ["p.jsonl"])
    got = []
    with pytest.raises(JobError, match="empty_prompt: 3"):
        for row in dflash_batch.generate(rows, write_job(tmp_path, doc), engine_factory=fake_factory()):
            got.append(row)
    assert len(got) == 4 and len(read_out(tmp_path / "out")) == 4
    lenient = {**doc, "output": {**doc["output"], "dir": "lenient", "max_error_fraction": 0.8}}
    assert len(list(dflash_batch.generate(rows, write_job(tmp_path, lenient, "l.yaml"),
                                          engine_factory=fake_factory()))) == 4


@pytest.mark.parametrize("field, refused", [("tensor_parallel_size", "this process is one of 1 ranks"),
                                            ("pipeline_parallel_size", "generate runs one tensor-parallel group"),
                                            ("data_parallel_size", "generate runs one tensor-parallel group")])
def test_a_job_of_several_ranks_is_refused_outside_their_group(tmp_path, model_dir, field, refused):
    """generate builds the engine in this process: it would run the whole model here, ignoring the
    ranks the job asks for; it says so before loading anything or writing a row."""
    doc = _doc(model_dir, dir=str(tmp_path / "out"))
    doc["model"][field] = 2
    with pytest.raises(JobError, match=refused):
        next(dflash_batch.generate(_rows(2), doc))
    assert not (tmp_path / "out").exists()
