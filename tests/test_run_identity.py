"""A run is identified by what it computes from (its models' and inputs' content), not by where
the files lie: a run moved with its job, models and inputs resumes there; a weight or an input
whose bytes changed is refused, naming the file; fingerprints are read once per file and kept
beside the run; a run.json from before keeps resuming where it was."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from dflash_batch.io import fingerprint
from dflash_batch.io.ledger import part_files
from dflash_batch.job import JobError, load_job
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import Preempted, run_job
from tests.fake_engine import FakeEngine
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

BIG = "model-00001-of-00002.safetensors"  # past 8 MiB: fingerprinted by samples, not read whole
VOLATILE = {"ttft_s", "latency_s"}
ROWS = 24


def _tree(root: Path, model_dir: Path) -> Path:
    """A job with relative paths beside its models and inputs (rows without ids: their ids come
    from the input's file name)."""
    shutil.copytree(model_dir, root / "models" / "target")
    (root / "models" / "target" / BIG).write_bytes(bytes(range(256)) * (40 * 1024 + 3))
    (root / "models" / "target" / "model-00002-of-00002.safetensors").write_bytes(b"\x01" * 1000)
    (root / "data").mkdir()
    rows = [{"prompt": f"prompt {i} " + "x " * (i % 5)} for i in range(ROWS)]
    write_jsonl(root / "data" / "p.jsonl", rows)
    doc = base_job(root, ["data/p.jsonl"], input={"id_column": None, "workers": 0},
                   output={"dir": "out", "rows_per_part": 4})
    doc["model"]["target"] = "models/target"
    write_job(root, doc)
    return root / "job.yaml"


class Counting:
    """The fake engine, counting completions, optionally stopped (SIGTERM's way) after `stop_after`."""

    def __init__(self, stop_after: int | None = None):
        self.made, self.stop_after = 0, stop_after

    def __call__(self, job, tokenizer):
        engine = FakeEngine(tokenizer)
        inner = engine.generate

        def generate(requests, bucket):
            for c in inner(requests, bucket):
                if self.made == self.stop_after:
                    raise Preempted()
                self.made += 1
                yield c

        engine.generate = generate
        return engine


def _rows(out: Path) -> dict:
    rows = read_out(out)
    assert max(Counter((r["row_id"], r["sample_index"]) for r in rows).values()) == 1, "a row twice"
    return {(r["row_id"], r["sample_index"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in rows}


@pytest.fixture()
def moved(tmp_path, model_dir):
    """(reference rows, a partial run copied to another directory, rows the partial run committed)."""
    reference = _tree(tmp_path / "ref", model_dir)
    run_job(load_job(reference), Counting(), Shard(0, 1), progress=False)
    want = _rows(tmp_path / "ref" / "out")
    assert len(want) == ROWS

    first = _tree(tmp_path / "a", model_dir)
    with pytest.raises(Preempted):
        run_job(load_job(first), Counting(stop_after=9), Shard(0, 1), progress=False)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")  # nothing of the old place is left to read
    return want, tmp_path / "b", len(read_out(tmp_path / "b" / "out"))


def test_a_run_moved_with_its_files_resumes_there(moved):
    want, root, committed = moved
    assert 0 < committed < ROWS
    engine = Counting()
    run_job(load_job(root / "job.yaml"), engine, Shard(0, 1), progress=False)
    assert _rows(root / "out") == want  # every row once, the same rows (ids from the file's name)
    assert engine.made == ROWS - committed  # resumed: the committed rows were not made again
    hashes = {pq.read_table(f, columns=["config_hash"])["config_hash"][0].as_py() for f in part_files(root / "out")}
    assert len(hashes) == 1  # the parts before and after the move belong to one run


def test_a_finished_run_moved_with_its_files_loads_nothing(tmp_path, model_dir):
    """The already-complete check knows the inputs by content, as the run identity does: after
    a move, a finished task is finished there too (no model loads, nothing is written)."""
    run_job(load_job(_tree(tmp_path / "a", model_dir)), Counting(), Shard(0, 1), progress=False)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")

    def must_not_load(job, tokenizer):
        raise AssertionError("a finished task loaded its model")

    again = run_job(load_job(tmp_path / "b" / "job.yaml"), must_not_load, Shard(0, 1), progress=False)
    assert again.already_complete and again.rows_written == 0
    assert len(_rows(tmp_path / "b" / "out")) == ROWS


def test_a_resume_reads_no_unchanged_file_again(moved, monkeypatch):
    """The first fingerprints of the moved files are cached beside the run; the next resume (a
    new process) finds them there."""
    _, root, _ = moved
    _resume_a_little(root)
    read = []
    real = fingerprint._digest
    monkeypatch.setattr(fingerprint, "_digest", lambda path, size: read.append(path.name) or real(path, size))
    monkeypatch.setattr(fingerprint, "_computed", {})  # a new process: only the cache file knows them
    run_job(load_job(root / "job.yaml"), Counting(), Shard(0, 1), progress=False)
    assert read == []
    assert len(_rows(root / "out")) == ROWS


def _resume_a_little(root: Path) -> int:
    """Resume for two rows: the moved files' fingerprints are then known (cached) at their new
    place. Returns the rows committed."""
    with pytest.raises(Preempted):
        run_job(load_job(root / "job.yaml"), Counting(stop_after=2), Shard(0, 1), progress=False)
    return len(read_out(root / "out"))


@pytest.mark.parametrize("where", [0, -1])
def test_a_changed_weight_is_refused_naming_it(moved, where):
    """One weight file's bytes change after its fingerprint was cached, its size does not (the
    first byte, or the last)."""
    _, root, _ = moved
    committed = _resume_a_little(root)
    weight = root / "models" / "target" / BIG
    data = bytearray(weight.read_bytes())
    data[where] ^= 0xFF
    weight.write_bytes(bytes(data))
    with pytest.raises(JobError, match=f"the job changed since this run started \\(changed: model.target: {BIG} "
                                       "differs\\)"):
        run_job(load_job(root / "job.yaml"), Counting(), Shard(0, 1), progress=False)
    assert len(read_out(root / "out")) == committed


def test_a_changed_input_is_refused_naming_it(moved):
    _, root, _ = moved
    committed = _resume_a_little(root)
    path = root / "data" / "p.jsonl"
    path.write_bytes(path.read_bytes().replace(b"prompt 3 ", b"prompt 3!"))
    with pytest.raises(JobError, match=r"\(changed: input.paths: p.jsonl differs\)"):
        run_job(load_job(root / "job.yaml"), Counting(), Shard(0, 1), progress=False)
    assert len(read_out(root / "out")) == committed


def test_a_run_from_before_resumes_where_it_was_with_its_hash(tmp_path, model_dir):
    """run.json written before runs were hashed by content (no identity, a hash of the paths):
    it resumes in place, and its new parts carry its hash."""
    job_file = _tree(tmp_path, model_dir)
    job = load_job(job_file)
    with pytest.raises(Preempted):
        run_job(job, Counting(stop_after=5), Shard(0, 1), progress=False)
    record = orjson.loads((tmp_path / "out" / "run.json").read_bytes())
    del record["identity"]
    record["config_hash"] = job.output_hash()
    (tmp_path / "out" / "run.json").write_bytes(orjson.dumps(record))
    run_job(job, Counting(), Shard(0, 1), progress=False)
    assert len(_rows(tmp_path / "out")) == ROWS
    last = max(part_files(tmp_path / "out"))
    assert set(pq.read_table(last)["config_hash"].to_pylist()) == {job.output_hash()}
