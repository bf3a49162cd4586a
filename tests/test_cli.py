"""The command line: run without an engine, status from committed files, ranks a launcher started
for another tensor-parallel size refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dflash_batch.cli import cpus_given, main
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, write_job, write_jsonl
from tests.test_tp import free_port

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
    expected = {k: int(v[0]) for k, v in shard_rows.items()}
    assert sum(expected.values()) == 20 and expected["2"] > 0  # every input row, by the shard that owns it
    assert shard_rows["2"][1:] == ["0", "0", "not started"]
    for k in "01":  # expected == committed ok + error for the finished shards
        assert shard_rows[k][3] == "complete" and int(shard_rows[k][1]) + int(shard_rows[k][2]) == expected[k]
    total_ok = sum(int(v[1]) for k, v in shard_rows.items() if k in "012")
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


@pytest.mark.slow
def test_threads_follow_what_slurm_gives_the_task():
    """Two tasks on one node each get their --cpus-per-task, not a thread per core."""
    code = ("import os, torch; from dflash_batch.cli import _set_threads; _set_threads(1); "
            "print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    one = subprocess.run([sys.executable, "-c", code], env={**env, "SLURM_CPUS_PER_TASK": "1"},
                         capture_output=True, text=True, check=True)
    assert one.stdout.strip() == "1"
    told = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**env, "SLURM_CPUS_PER_TASK": "1", "OMP_NUM_THREADS": "2"})
    assert told.stdout.strip() == "2"  # an explicit OMP_NUM_THREADS wins
    ranks = code.replace("_set_threads(1)", "_set_threads(2)")  # each of 2 tensor-parallel ranks
    shared = subprocess.run([sys.executable, "-c", ranks], capture_output=True, text=True, check=True,
                            env={**env, "SLURM_CPUS_ON_NODE": "4"})
    assert shared.stdout.strip() == "2"


@pytest.mark.parametrize("files, want", [
    ({"cpu.max": "150000 100000\n"}, 2), ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None), ({}, None)],
    ids=["v2_quota", "v2_none", "v1_quota", "v1_none", "no_cgroup"])
def test_threads_stay_within_a_containers_cpu_quota(tmp_path, monkeypatch, files, want):
    """A pod limited to 1.5 CPUs on a 64-core node sees 64 cores: it runs 2 threads, not 64."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for var in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert cpus_given(tmp_path) == (want or 64)


@pytest.mark.parametrize("launcher, tp, pp", [("torchrun", 1, 1), ("srun", 4, 1), ("torchrun", 2, 2)])
def test_ranks_started_for_another_tensor_parallel_size_are_refused(tmp_path, model_dir, launcher, tp, pp):
    """Two ranks, as torchrun or srun start them (their variables, two processes meeting over
    gloo), of a job whose model.tensor_parallel_size x pipeline_parallel_size is not 2: every rank
    says so in one line and exits 2 before loading a model (this checkpoint could not be loaded)
    or writing a row."""
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    write_job(tmp_path, base_job(model_dir, ["p.jsonl"], model={"tensor_parallel_size": tp,
                                                                "pipeline_parallel_size": pp}))
    launched = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launched and not k.startswith("SLURM_")}
    port = str(free_port())
    if launcher == "torchrun":
        ranks = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": port} for r in range(2)]
    else:  # srun's variables; the port by hand, as a job may set it (else it derives from the job id)
        ranks = [{"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_JOB_ID": "7",
                  "SLURM_STEP_NODELIST": "127.0.0.1", "MASTER_PORT": port} for r in range(2)]
    procs = [subprocess.Popen([*CLI, "run", str(tmp_path / "job.yaml"), "--no-progress"], env={**env, **r},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ranks]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2, err[-2000:]
        stages = f" x pipeline_parallel_size {pp}" if pp > 1 else ""
        assert err.splitlines() == [f"error: started with 2 ranks but the job runs {tp * pp} ranks "
                                    f"(model.tensor_parallel_size {tp}{stages})"], err
    assert not (tmp_path / "out").exists()


def test_run_help_names_the_shard_sources_in_the_order_they_are_taken():
    """The order resolve_shard takes them in: --shard, the job's sharding section, Slurm's array
    variables, a Kubernetes indexed Job's index, else 0/1 (each source beats the next one)."""
    from dflash_batch.job import ShardingSpec
    from dflash_batch.plan.shards import resolve_shard
    text = " ".join(CliRunner().invoke(main, ["run", "--help"]).output.split())
    places = [text.index(s) for s in ("--shard", "sharding section", "SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX",
                                      "else 0/1")]
    assert places == sorted(places)
    both = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "0",
            "JOB_COMPLETION_INDEX": "2", "DFLASH_SHARDS": "4"}
    assert resolve_shard(ShardingSpec(), both) == Shard(1, 3)
    assert resolve_shard(ShardingSpec(), {k: v for k, v in both.items() if "SLURM" not in k}) == Shard(2, 4)
    assert resolve_shard(ShardingSpec(mode="explicit", index=0, count=5), both) == Shard(0, 5)
