"""Rows prepared in worker processes: the same rows as one process, errors reach the runner,
and no worker outlives a killed runner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_batch.io.inputs import read_records
from dflash_batch.job import JobError
from dflash_batch.plan.ahead import prepare_ahead, prepared_batches
from dflash_batch.plan.shards import Shard
from dflash_batch.tokenizer import Tokenizer
from dflash_batch.runner import run_job
from dflash_batch.testing.procs import alive, children
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

ROOT = Path(__file__).resolve().parent.parent


def _inputs(tmp_path: Path) -> list[str]:
    rows = [{"id": f"a{i}", "prompt": f"row {i} " + "fox " * (i % 7), "topic": i % 3,
             "temp": 0.5 if i % 5 == 0 else None} for i in range(37)]
    rows[4] = {"id": "a4", "prompt": ""}                       # error row: empty prompt
    write_jsonl(tmp_path / "a.jsonl", [*rows[:20], b"{not json", *rows[20:]])
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(23)], "prompt": [f"parquet {i}" for i in range(23)],
                             "topic": [i % 3 for i in range(23)], "temp": [None] * 23}), tmp_path / "b.parquet")
    return ["a.jsonl", "b.parquet"]


def _job(tmp_path: Path, model_dir: Path, workers: int):
    doc = base_job(model_dir, _inputs(tmp_path),
                   input={"batch_rows": 4, "window_rows": 9, "workers": workers, "passthrough_columns": ["topic"],
                          "sampling_columns": {"temperature": "temp"}},
                   sampling={"n": 2, "max_new_tokens": 8}, output={"dir": f"out-{workers}"})
    return write_job(tmp_path, doc, f"w{workers}.yaml")


def _run(tmp_path: Path, model_dir: Path, workers: int) -> dict:
    run_job(_job(tmp_path, model_dir, workers), fake_factory(), Shard(1, 2), progress=False)
    rows = read_out(tmp_path / f"out-{workers}")
    keyed = {(r["row_id"], r["sample_index"]): {k: v for k, v in r.items() if k not in ("ttft_s", "latency_s")}
             for r in rows}
    assert len(keyed) == len(rows), "duplicate rows"
    return keyed


def test_workers_write_the_rows_of_one_process(tmp_path, model_dir):
    one = _run(tmp_path, model_dir, 0)
    assert len(one) > 20 and any(r["status"] == "error" for r in one.values())
    assert _run(tmp_path, model_dir, 1) == one
    assert _run(tmp_path, model_dir, 3) == one


def _ids(batches) -> list[list[tuple]]:
    return [[(r.row_id, r.prompt_ids, r.bucket, r.error_type) for r in b] for b in batches]


def test_workers_hand_back_batches_in_input_order(tmp_path, model_dir):
    job = _job(tmp_path, model_dir, 3)
    tok = Tokenizer(model_dir)
    one = _ids(prepared_batches(job, tok, Shard(0, 1), frozenset(), None))
    assert len(one) > 10
    assert _ids(prepare_ahead(job, tok, Shard(0, 1), frozenset(), None)) == one


def test_an_input_with_fewer_batches_than_workers(tmp_path, model_dir):
    (tmp_path / "blank.jsonl").write_text("\n\n")
    write_jsonl(tmp_path / "one.jsonl", [{"id": "x", "prompt": "only row"}])
    for name, rows in (("blank.jsonl", 0), ("one.jsonl", 1)):
        job = write_job(tmp_path, base_job(model_dir, [name], input={"workers": 3, "allow_empty": True},
                                           output={"dir": f"out-{name}"}))
        assert run_job(job, fake_factory(), Shard(0, 1), progress=False).rows_written == rows


def test_worker_parts_cover_every_batch_once(tmp_path, model_dir):
    job = write_job(tmp_path, base_job(model_dir, _inputs(tmp_path), input={"batch_rows": 4}))
    whole = [[(r.source, r.index) for r in b] for b in read_records(job.input)]
    parts = [[[(r.source, r.index) for r in b] for b in read_records(job.input, (k, 3))] for k in range(3)]
    assert [parts[i % 3][i // 3] for i in range(len(whole))] == whole


def test_a_worker_error_reaches_the_runner(tmp_path, model_dir):
    # The workers load the tokenizer themselves: here from a directory that has none.
    (tmp_path / "empty").mkdir()
    job = write_job(tmp_path, base_job(model_dir, _inputs(tmp_path), input={"workers": 2},
                                       model={"tokenizer": str(tmp_path / "empty")}))
    with pytest.raises(JobError, match="no tokenizer.json or tiktoken.model"):
        list(prepare_ahead(job, Tokenizer(model_dir), Shard(0, 1), frozenset(), None))


def test_workers_ignore_modules_in_the_working_directory(tmp_path, model_dir, monkeypatch):
    job = _job(tmp_path, model_dir, 2)
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "glob.py").write_text("raise ImportError('the wrong glob')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    assert list(prepare_ahead(job, Tokenizer(model_dir), Shard(0, 1), frozenset(), None))


def test_a_dead_worker_is_an_error_not_a_short_run(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(20000)])
    job = write_job(tmp_path, base_job(model_dir, ["p.jsonl"], input={"batch_rows": 50, "workers": 2}))
    batches = prepare_ahead(job, Tokenizer(model_dir), Shard(0, 1), frozenset(), None)
    next(batches)
    workers = [w for w in children(os.getpid()) if "serve" in Path(f"/proc/{w}/cmdline").read_text()]
    os.kill(workers[1], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="worker 1 died"):
        list(batches)
    assert not any(alive(w) for w in workers)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_worker_outlives_its_runner(tmp_path, model_dir, sig):
    # Enough rows that the workers are still busy (blocked on a full pipe) when the runner dies.
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(20000)])
    doc = base_job(model_dir, ["p.jsonl"], input={"batch_rows": 50, "workers": 2})
    write_job(tmp_path, doc)
    proc = subprocess.Popen([sys.executable, "-m", "tests.run_fake_job", str(tmp_path / "job.yaml"), "0.01"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not read_out(tmp_path / "out") and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = children(proc.pid)
    assert len(workers) == 2, "the runner should have two workers"
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 20
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(w) for w in workers)
