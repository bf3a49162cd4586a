"""dflash_batch.ray: the engine as a Ray Data stage.

Without Ray: a batch's bad rows become error rows; a batch seen again generates nothing, on the
same actor or a fresh one (its engine is handed no request); a commit leaves out rows another
writer committed meanwhile; a stage that would commit needs row ids.
With a local Ray cluster (2 CPUs, 2 actors): the demo pair over demo prompts through
map_batches gives every (row, sample) once, equal to `dflash-batch run` on the same rows; the
pipeline run again generates nothing; an actor killed (`ray.kill`) right after committing a
batch, before returning it, is replaced and the batch retried: every row still once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet  # noqa: F401 - pa.parquet
import pytest
from click.testing import CliRunner

from dflash_batch.build import build_engine
from dflash_batch.cli import main
from dflash_batch.io.inputs import Record
from dflash_batch.job import JobError, load_job
from dflash_batch.plan.shards import Shard
from dflash_batch.ray import DFlashStage
from dflash_batch.runner import EngineFactory, run_job
from tests.jobs_util import read_out, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "jobs" / "demo.yaml"
COMPARED = ("row_id", "sample_index", "status", "response", "finish_reason", "completion_tokens", "dataset")


def _prompts(count: int) -> list[dict]:
    rows = [orjson.loads(line) for line in (ROOT / "jobs/demo/prompts.jsonl").read_bytes().splitlines()]
    return [r for r in rows if r["dataset"] != "few-shot"][:count]


def _keys(rows: list[dict]) -> Counter:
    return Counter((r["row_id"], r["sample_index"]) for r in rows)


def _by_key(rows: list[dict]) -> dict:
    return {(r["row_id"], r["sample_index"]): {c: r.get(c) for c in COMPARED} for r in rows}


def counting_engines(handed: list) -> EngineFactory:
    """build_engine, whose engines append the key of each request they are handed to `handed`:
    what a stage generated, whatever its commit then kept."""

    def factory(job, tokenizer):
        engine = build_engine(job, tokenizer)
        generate = engine.generate
        engine.generate = lambda requests, bucket: generate((handed.append(r.key) or r for r in requests), bucket)
        return engine

    return factory


def test_bad_rows_are_error_rows_and_a_batch_seen_again_generates_nothing(tmp_path):
    stage = DFlashStage(DEMO, output_dir=tmp_path / "out")
    good = _prompts(3)
    bad = [{"id": "no-messages", "dataset": "x", "answer": "1", "messages": None},
           {"id": "too-long", "dataset": "x", "answer": "1",  # past the last bucket, and overflow: error
            "messages": [{"role": "user", "content": "one two three " * 1000}]}]
    out = stage(pa.Table.from_pylist(good + bad)).to_pylist()
    assert _keys(out) == _keys([{"row_id": r["id"], "sample_index": 0} for r in good + bad])
    status = {r["row_id"]: r["status"] for r in out}
    assert [status[r["id"]] for r in good] == ["ok"] * 3
    assert status["no-messages"] == status["too-long"] == "error"
    assert all(r["error"] for r in out if r["status"] == "error")
    assert _by_key(read_out(tmp_path / "out")) == _by_key(out)
    status = CliRunner().invoke(main, ["status", str(tmp_path / "out")])
    assert status.exit_code == 0 and "3 ok, 2 error" in status.output
    assert "rows from a Ray Data pipeline, not marked finished: run it again" in status.output
    assert "dflash-batch run" not in status.output
    report = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert report.exit_code == 0 and "## Acceptance" in report.output

    # The same rows again (a Ray retry, a restarted pipeline): read back, nothing generated.
    generated = []
    stage.rows.commit = generated.append
    again = stage(pa.Table.from_pylist(list(reversed(good + bad)))).to_pylist()
    assert not generated and _by_key(again) == _by_key(out)
    assert len(list((tmp_path / "out" / "data" / "shard-00000").glob("part-*.parquet"))) == 1

    # A fresh actor (Ray retries a batch on a new one; a pipeline restarts) reads what is committed
    # before it generates: its engine is handed no request. Its output and the parts cannot tell,
    # as its commit would leave out rows generated again; only the requests counted can.
    handed = []
    fresh = DFlashStage(DEMO, output_dir=tmp_path / "out", engine_factory=counting_engines(handed))
    assert _by_key(fresh(pa.Table.from_pylist(good + bad)).to_pylist()) == _by_key(out)
    assert handed == []
    new = _prompts(4)[3]  # and the count sees generation: a new row is handed over once
    fresh(pa.Table.from_pylist(good + [new]))
    assert handed == [(new["id"], 0)]


def test_a_pipeline_marked_finished_is_complete_until_more_rows_come(tmp_path):
    """ray.finish: status says complete (not "run it again") and export takes the output whole;
    before it, and once another pipeline commits rows after it, export refuses without --partial."""
    from dflash_batch.ray import finish
    stage = DFlashStage(DEMO, output_dir=tmp_path / "out")
    rows = _prompts(3)
    stage(pa.Table.from_pylist(rows[:2]))

    def export(dest: str, *flags: str):
        return CliRunner().invoke(main, ["export", str(tmp_path / "out"), str(tmp_path / dest), *flags])

    refused = export("early")
    assert refused.exit_code == 2 and "not finished" in refused.output and "--partial" in refused.output
    finish(tmp_path / "out")
    status = CliRunner().invoke(main, ["status", str(tmp_path / "out")]).output
    assert "1 complete" in status and "run it again" not in status
    assert export("whole").exit_code == 0 and "Partial" not in (tmp_path / "whole" / "README.md").read_text()
    stage(pa.Table.from_pylist(rows[2:]))  # a later pipeline into the same directory
    status = CliRunner().invoke(main, ["status", str(tmp_path / "out")]).output
    assert "0 complete" in status and "not marked finished" in status
    assert export("later").exit_code == 2
    partial = export("partial", "--partial")
    assert partial.exit_code == 0 and "**Partial**" in (tmp_path / "partial" / "README.md").read_text()


def test_a_commit_leaves_out_rows_another_writer_committed(tmp_path):
    first, second = DFlashStage(DEMO, output_dir=tmp_path / "out"), DFlashStage(DEMO, output_dir=tmp_path / "out")
    rows = _prompts(4)
    second.new_rows.clear()
    second.rows.run_window(second.preparer.prepare([Record("s", i, r) for i, r in enumerate(rows[:2])]))
    made = list(second.new_rows)  # generated, not yet committed, when the first commits the same rows
    out = first(pa.Table.from_pylist(rows))
    written, part = second.commit(made)
    assert written == [] and part is None
    assert _keys(read_out(tmp_path / "out")) == _keys(out.to_pylist())
    assert max(_keys(read_out(tmp_path / "out")).values()) == 1


def test_committing_needs_row_ids_a_retry_or_ranks_are_refused_and_flowing_on_needs_neither(tmp_path):
    doc = load_job(DEMO).model_dump(mode="json")
    doc["input"]["id_column"] = None
    with pytest.raises(JobError, match="input.id_column"):
        DFlashStage(doc, output_dir=tmp_path / "out")
    retry = {**load_job(DEMO).model_dump(mode="json"), "retry": {"parent": "p", "parent_hash": "h", "samples": "s",
                                                                  "where": ["error"]}}
    with pytest.raises(JobError, match="retry"):
        DFlashStage(retry, output_dir=tmp_path / "out")
    for field in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):  # one actor, one rank
        ranks = load_job(DEMO).model_dump(mode="json")
        ranks["model"][field] = 2
        with pytest.raises(JobError, match=f"model.{field} > 1 is not supported in a Ray stage"):
            DFlashStage(ranks, output_dir=tmp_path / "out")
    stage = DFlashStage(doc)  # rows only flow on: nothing is written
    rows = [{k: v for k, v in r.items() if k != "id"} for r in _prompts(2)]
    out = stage(pa.Table.from_pylist(rows)).to_pylist()
    assert [r["status"] for r in out] == ["ok", "ok"] and not (tmp_path / "out").exists()


# -- through Ray ---------------------------------------------------------------------------

ray = pytest.importorskip("ray", reason="pip install -e '.[ray]'")


class DiesAfterItsFirstCommit(DFlashStage):
    """The first commit of the whole pipeline (a marker file decides) kills its own actor with
    ray.kill before the batch is returned: Ray restarts the actor and retries the batch."""

    def commit(self, rows: list[dict]) -> tuple[list[dict], Path | None]:
        written = super().commit(rows)
        try:
            os.close(os.open(self.out_dir.parent / "killed", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return written
        ray.kill(ray.get_runtime_context().current_actor, no_restart=False)
        time.sleep(120)  # killed before this returns
        raise AssertionError("ray.kill did not end the actor")


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}})
    try:
        yield
    finally:
        ray.shutdown()


def _pipeline(rows: list[dict], out_dir: Path, stage: type = DFlashStage) -> list[dict]:
    ds = ray.data.from_items(rows, override_num_blocks=4)
    ds = ds.map_batches(stage, fn_constructor_kwargs={"job": str(DEMO), "output_dir": str(out_dir), "threads": 1},
                        batch_size=6, batch_format="pyarrow", concurrency=2, num_cpus=1)
    return ds.take_all()


def _reference(tmp_path: Path, rows: list[dict]) -> list[dict]:
    """`dflash-batch run` on the same rows (the same job, the rows in a file)."""
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = load_job(DEMO)
    job = job.model_copy(update={"input": job.input.model_copy(update={"paths": [str(tmp_path / "rows.jsonl")]}),
                                 "output": job.output.model_copy(update={"dir": str(tmp_path / "ref")})})
    run_job(job, build_engine, Shard(0, 1), progress=False)
    return read_out(tmp_path / "ref")


@pytest.mark.slow
def test_a_ray_pipeline_equals_dflash_batch_run_and_a_rerun_generates_nothing(tmp_path, local_ray):
    rows = _prompts(24)
    out = _pipeline(rows, tmp_path / "out")
    expected = _by_key(_reference(tmp_path, rows))
    assert len(expected) == 24 and max(_keys(out).values()) == 1
    assert _by_key(out) == expected
    assert _by_key(read_out(tmp_path / "out")) == expected and max(_keys(read_out(tmp_path / "out")).values()) == 1
    parts = sorted((tmp_path / "out" / "data").rglob("part-*.parquet"))
    assert _by_key(_pipeline(rows, tmp_path / "out")) == expected  # rows read back, none generated
    assert sorted((tmp_path / "out" / "data").rglob("part-*.parquet")) == parts


@pytest.mark.slow
def test_an_actor_killed_after_committing_is_replaced_and_every_row_is_once(tmp_path, local_ray):
    rows = _prompts(24)
    out = _pipeline(rows, tmp_path / "out", DiesAfterItsFirstCommit)
    assert (tmp_path / "killed").exists()
    committed = read_out(tmp_path / "out")
    assert set(_keys(out)) == set(_keys(committed)) == {(r["id"], 0) for r in rows}
    assert max(_keys(out).values()) == 1 and max(_keys(committed).values()) == 1
    assert _by_key(out) == _by_key(committed)


@pytest.mark.slow
def test_the_manuals_example_runs_as_written_on_a_cpu_only_host(tmp_path):
    """docs/pipelines.md's Ray example, its text unchanged, in a process of its own where Ray
    starts its own cluster on this host's CPUs (2 here): with the actors resources() asks for,
    the read tasks keep a CPU and every row comes back (asking for a GPU, or an actor a CPU,
    it would wait forever: the timeout would fail the test)."""
    text = (ROOT / "docs" / "pipelines.md").read_text()
    lines = text.split("\n")
    start = lines.index("      import ray")
    end = next(i for i in range(start, len(lines)) if lines[i].strip() and not lines[i].startswith("      "))
    example = "\n".join(line[6:] for line in lines[start:end])
    assert "resources()" in example and "num_gpus" not in example
    rows = _prompts(6)
    (tmp_path / "prompts").mkdir()
    pa.parquet.write_table(pa.Table.from_pylist(rows), tmp_path / "prompts" / "part-0.parquet")
    job = load_job(DEMO).model_dump(mode="json")  # its paths made absolute by load_job
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "x.yaml").write_text(orjson.dumps(job).decode())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "RAY_DEDUP_LOGS": "0"}
    out = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    written = pa.parquet.read_table(tmp_path / "downstream").to_pylist()
    assert _keys(written) == _keys([{"row_id": r["id"], "sample_index": 0} for r in rows])
    status = CliRunner().invoke(main, ["status", str(tmp_path / "out" / "x")]).output
    assert "1 complete" in status
