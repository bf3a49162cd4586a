"""The command line: run without an engine, status from committed files."""

from __future__ import annotations

import re
import subprocess
import sys

from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, write_job, write_jsonl

CLI = [sys.executable, "-m", "dflash_batch.cli"]


def test_run_with_an_unsupported_checkpoint_fails_before_writing_rows(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    write_job(tmp_path, base_job(model_dir, ["p.jsonl"]))
    out = subprocess.run([*CLI, "run", str(tmp_path / "job.yaml"), "--no-progress"], capture_output=True, text=True)
    assert out.returncode == 2
    assert f"model.target {model_dir}: unsupported architecture 'FakeForTests'" in out.stderr
    assert not list(tmp_path.rglob("part-*.parquet"))


def test_status_counts_per_shard_and_bucket(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": "hi there" if i % 4 else ""} for i in range(20)])
    doc = base_job(model_dir, ["p.jsonl"], buckets=[{"max_tokens": 32}, {"max_tokens": 256}])
    job = write_job(tmp_path, doc)
    for i in range(3):  # shard 2 of 3 is left undone
        if i < 2:
            run_job(job, fake_factory(), Shard(i, 3), progress=False)
    out = subprocess.run([*CLI, "status", str(tmp_path / "out")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    table = lines[2:lines.index("")]  # the shard table: header, rule, one line a shard
    shard_rows = {c[0]: c[1:] for c in (re.split(r"\s{2,}", ln.strip()) for ln in table)}
    assert shard_rows["2"] == ["0", "0", "not started"]
    assert shard_rows["0"][2] == shard_rows["1"][2] == "complete"
    total_ok = sum(int(v[0]) for k, v in shard_rows.items() if k in "012")
    assert f"total: {total_ok} ok" in out.stdout
    assert "0-32" in out.stdout and "3 shard(s)" in out.stdout


def test_dry_run_prints_the_first_rows_and_runs_nothing(tmp_path, model_dir):
    """The checkpoint is one no engine can load: a dry run never loads it, nor writes anything."""
    rows = [{"id": "a", "prompt": "hi there"}, {"id": "b", "prompt": ""}, {"id": "c", "prompt": "x " * 30}]
    rows += [{"id": f"r{i}", "prompt": "more"} for i in range(10)]
    write_jsonl(tmp_path / "p.jsonl", rows)
    write_job(tmp_path, base_job(model_dir, ["p.jsonl"], buckets=[{"max_tokens": 32}, {"max_tokens": 256}]))
    out = subprocess.run([*CLI, "run", str(tmp_path / "job.yaml"), "--dry-run"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    blocks = out.stdout.split("--- row ")[1:]
    assert len(blocks) == 5 and [b.split(":")[0] for b in blocks] == ["a", "b", "c", "r0", "r1"]
    assert re.match(r"a: \d+ prompt tokens \+ max_new_tokens 16 x n 1 -> bucket 0-32\nhi there\n", blocks[0])
    assert blocks[1].startswith("b: error empty_prompt")
    assert "-> bucket 32-256" in blocks[2]
    assert not (tmp_path / "out").exists()
