"""Resume: killed runs, resumed, give exactly the rows of an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import yaml

from dflash_batch.io.progress import read_progress
from dflash_batch.plan.shards import Shard, shard_of
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
VOLATILE = {"ttft_s", "latency_s"}


def _start(job_file: Path, delay: float, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.run_fake_job", str(job_file), str(delay)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def _comparable(rows: list[dict]) -> dict:
    keys = Counter((r["row_id"], r["sample_index"]) for r in rows)
    assert max(keys.values()) == 1, "duplicate rows"
    return {(r["row_id"], r["sample_index"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in rows}


def _job(tmp_path: Path, model_dir: Path, out: str) -> Path:
    rows = [{"id": f"r{i}", "prompt": f"prompt number {i} " + "fox " * (i % 9)} for i in range(40)]
    rows[7] = {"id": "r7", "prompt": ""}  # an error row must survive resumes too
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(model_dir, ["p.jsonl"], sampling={"n": 2, "max_new_tokens": 8},
                   output={"dir": out, "rows_per_part": 3},
                   buckets=[{"max_tokens": 24}, {"max_tokens": 256}])
    write_job(tmp_path, doc, f"{out}.yaml")
    return tmp_path / f"{out}.yaml"


@pytest.mark.slow
def test_sigkill_five_times_then_resume_equals_uninterrupted_run(tmp_path, model_dir):
    reference = _job(tmp_path, model_dir, "ref")
    from dflash_batch.job import load_job
    run_job(load_job(reference), fake_factory(), Shard(0, 1), progress=False)
    expected = _comparable(read_out(tmp_path / "ref"))
    assert len(expected) == 80

    job_file = _job(tmp_path, model_dir, "killed")
    rng = random.Random(1234)
    progress = []
    for _ in range(5):
        proc = _start(job_file, delay=0.02)
        # wait for the child to commit something new, then kill it at a random moment
        seen = len(read_out(tmp_path / "killed"))
        deadline = time.monotonic() + 60
        while len(read_out(tmp_path / "killed")) == seen and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        progress.append(len(read_out(tmp_path / "killed")))
    assert progress[-1] < 80, f"the runs finished before being killed: {progress}"
    assert progress == sorted(progress) and progress[0] > 0
    final = _start(job_file, delay=0.0)
    assert final.wait(timeout=120) == 0, final.stderr.read().decode()
    assert _comparable(read_out(tmp_path / "killed")) == expected
    assert not list((tmp_path / "killed").rglob("*.tmp"))


def test_sigterm_commits_finished_rows_and_exits_nonzero(tmp_path, model_dir):
    job_file = _job(tmp_path, model_dir, "term")
    proc = _start(job_file, delay=0.05)
    deadline = time.monotonic() + 60
    while not read_out(tmp_path / "term") and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    done = read_out(tmp_path / "term")
    assert 0 < len(done) < 80
    final = _start(job_file, delay=0.0)
    assert final.wait(timeout=120) == 0
    rows = read_out(tmp_path / "term")
    assert len(_comparable(rows)) == 80 and os.path.exists(tmp_path / "term" / "stats" / "shard-00000.json")


def test_kubernetes_pod_eviction_commits_exits_143_and_the_restarted_pod_finishes_its_shard(tmp_path, model_dir):
    """A pod of an indexed Job: its shard from JOB_COMPLETION_INDEX and DFLASH_SHARDS; eviction's
    SIGTERM commits and exits 143; the pod Kubernetes starts again for that index finishes
    exactly that shard's rows, once each."""
    job_file = _job(tmp_path, model_dir, "pod")
    pod = {"JOB_COMPLETION_INDEX": "1", "DFLASH_SHARDS": "2"}
    for key in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN"):
        pod[key] = ""  # (a suite run inside a Slurm array must not look like one here)
    proc = _start(job_file, delay=0.05, env=pod)
    deadline = time.monotonic() + 60
    while not read_out(tmp_path / "pod") and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    mine = {(f"r{i}", s) for i in range(40) if shard_of(f"r{i}", 2) == 1 for s in range(2)}
    assert 0 < len(read_out(tmp_path / "pod")) < len(mine)
    assert _start(job_file, delay=0.0, env=pod).wait(timeout=120) == 0
    rows = read_out(tmp_path / "pod")
    assert set(_comparable(rows)) == mine and {r["shard_index"] for r in rows} == {1}
    assert orjson.loads((tmp_path / "pod" / "run.json").read_bytes())["num_shards"] == 2


@pytest.mark.slow
def test_sigterm_commits_what_finished_at_once_even_under_contention(tmp_path, model_dir):
    """Rows finish every 3 s and commit only every 1000 rows; the CPUs are busy with other work.
    SIGTERM arrives while a row is in progress: the run exits 143 within two seconds (not at the
    next finished row) with every finished row committed, and a rerun completes the rest once."""
    job_file = _job(tmp_path, model_dir, "now")
    doc = yaml.safe_load(job_file.read_text())
    doc["output"]["rows_per_part"] = 1000
    job_file.write_text(yaml.safe_dump(doc))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        proc = _start(job_file, delay=3.0)
        deadline = time.monotonic() + 120  # start-up is slow with every CPU busy (and in a loaded suite)
        while (read_progress(tmp_path / "now", 0) or {}).get("state") != "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(7)  # rows begun: a few finish (held in the writer's buffer)
        assert not read_out(tmp_path / "now") and proc.poll() is None
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        took = time.monotonic() - sent
    finally:
        for b in burners:
            b.kill()
            b.wait()
    done = read_out(tmp_path / "now")
    assert took < 2.0 and len(done) >= 1, (took, len(done))
    assert _start(job_file, delay=0.0).wait(timeout=120) == 0
    assert len(_comparable(read_out(tmp_path / "now"))) == 80


def test_a_second_process_on_one_shard_is_refused(tmp_path, model_dir):
    """An OS lock: while one process writes shard 0, another run of the same shard stops before
    any work with a message naming the holder; once the first is gone (killed: the kernel drops
    its lock) the shard runs."""
    import pytest

    from dflash_batch.job import JobError, load_job

    job_file = _job(tmp_path, model_dir, "locked")
    first = _start(job_file, delay=0.05)
    deadline = time.monotonic() + 60
    while not read_out(tmp_path / "locked") and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        with pytest.raises(JobError, match=f"being written by another process \\(pid {first.pid} on "):
            run_job(load_job(job_file), fake_factory(), Shard(0, 1), progress=False)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    run_job(load_job(job_file), fake_factory(), Shard(0, 1), progress=False)
    assert len(_comparable(read_out(tmp_path / "locked"))) == 80


def test_array_spec():
    from dflash_batch.io.ledger import array_spec

    assert array_spec([0]) == "0"
    assert array_spec([1, 3, 5, 6, 7, 9]) == "1,3,5-7,9"
    assert array_spec([2, 3]) == "2-3"


def test_a_finished_shard_loads_no_model_and_a_changed_input_is_refused(tmp_path, model_dir):
    import pytest

    from dflash_batch.job import JobError, load_job

    job = load_job(_job(tmp_path, model_dir, "again"))
    assert run_job(job, fake_factory(), Shard(0, 2), progress=False).rows_written > 0

    def no_model(job, tokenizer):
        raise AssertionError("loaded a model for a finished shard")

    again = run_job(job, no_model, Shard(0, 2), progress=False)
    assert again.already_complete and again.rows_written == 0
    (tmp_path / "p.jsonl").write_bytes((tmp_path / "p.jsonl").read_bytes() + b'{"id": "new", "prompt": "x"}\n')
    with pytest.raises(JobError, match=r"\(changed: input.paths: p.jsonl differs\)"):  # another run's input
        run_job(job, fake_factory(), Shard(0, 2), progress=False)
