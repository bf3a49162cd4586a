"""jobs/slurm/array.sbatch on a real one-node Slurm 22.05 (../shared/slurm/local-slurm.sh): the demo
job (3 samples a prompt) as an array of 4 tasks on a CPU partition, one CPU each, submitted as
the README says; one
task preempted (`scontrol requeue`: SIGTERM, requeue, restart) while it decodes. Every row ends
up committed once, the preempted task says it committed and stopped, restarts and finishes, a
finished task requeued again exits before loading a model, and `status` calls every shard
complete against the rows the inputs give it. Skipped, saying why, without slurm-wlm (.ci/run
installs it where it can) or the cluster script."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from dflash_batch.io.progress import read_progress
from dflash_batch.parallel import first_host
from dflash_batch.job import load_job
from tests.jobs_util import read_out

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [os.environ.get("LOCAL_SLURM_SCRIPT", ""), ROOT.parent / "shared/slurm/local-slurm.sh"]
DEMO_ROWS, SAMPLES = 72, 3


def _script() -> Path:
    for s in SCRIPTS:
        if s and Path(s).is_file():
            return Path(s)
    pytest.skip(f"no local-slurm.sh among {[str(s) for s in SCRIPTS if s]}")


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("sbatch") is None or shutil.which("slurmctld") is None:
        pytest.skip("slurm-wlm is not installed (apt-get install -y slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("the one-node cluster runs its daemons as root")
    script = _script()
    env = {**os.environ, "LOCAL_SLURM_CRED_EXPIRE": "5", "LOCAL_SLURM_GRACE_TIME": "10"}
    with _cluster_users() as users:
        started = subprocess.run(["bash", str(script), "start"], env=env, capture_output=True, text=True)
        if started.returncode:
            pytest.skip(f"the one-node Slurm did not start: {started.stdout[-500:]} {started.stderr[-500:]}")
        users["count"] += 1
        users["ours"] = users["ours"] or "started slurmctld" in started.stdout
    conf = subprocess.run(["bash", str(script), "env"], env=env, capture_output=True, text=True, check=True)
    env["SLURM_CONF"] = conf.stdout.split("=", 1)[1].strip().strip("'\"")
    yield env
    # pytest-xdist may run this module's tests on two workers, each with this fixture: the last to
    # leave stops the cluster if one of them started it (stopping it under the other's job lost it).
    with _cluster_users() as users:
        users["count"] -= 1
        if users["count"] == 0 and users["ours"]:
            subprocess.run(["bash", str(script), "stop"], env=env, capture_output=True)
            users["ours"] = False


@contextmanager
def _cluster_users():
    """{count: fixtures using the cluster now, ours: one of them started it}, under a file lock."""
    path = Path(tempfile.gettempdir()) / "dflash-batch-local-slurm.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        users = json.loads(path.read_text()) if path.exists() else {"count": 0, "ours": False}
        yield users
        path.write_text(json.dumps(users))


def _tasks(env: dict, job: str) -> dict[str, str]:
    """Array task id -> state, for the job's tasks still known to squeue."""
    out = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%K %T"], env=env, capture_output=True, text=True)
    return dict(line.split() for line in out.stdout.splitlines() if line.strip())


def _wait(env: dict, job: str, until, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not until(_tasks(env, job)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {_tasks(env, job)}"
        time.sleep(0.5)


def _demo_job(tmp_path: Path) -> Path:
    """jobs/demo.yaml with 3 samples a prompt, two at a time: a task decodes for long enough
    (tens of seconds on one CPU) to be preempted in the middle."""
    job = load_job(ROOT / "jobs/demo.yaml")
    doc = job.model_dump(mode="json", exclude={"retry"})
    doc["sampling"].update(n=SAMPLES, temperature=0.8)
    doc["engine"]["max_num_seqs"] = 2
    doc["buckets"] = [{**b, "max_num_seqs": 2} for b in doc["buckets"]]
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path / "demo.yaml"


def test_array_with_a_preempted_task_commits_every_row_once(slurm, tmp_path):
    env = slurm
    out = tmp_path / "out"
    (tmp_path / "logs").mkdir()  # the README's `mkdir -p logs`: Slurm does not create it
    submit = ["sbatch", "--parsable", "--array=0-3", "--gpus-per-node=0", "--cpus-per-task=1",
              str(ROOT / "jobs/slurm/array.sbatch"), str(_demo_job(tmp_path)), "--output-dir", str(out)]
    job = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
    log = tmp_path / "logs" / f"dflash-batch-{job}_1.out"
    # Preempt task 1 while it decodes: once its progress record says its rows began (the models
    # loaded), however long a busy machine takes to get there.
    _wait(env, job, lambda t: (read_progress(out, 1) or {}).get("state") == "running", 300, "task 1's rows")
    assert _tasks(env, job).get("1") == "RUNNING", "task 1 finished before it could be preempted"
    subprocess.run(["scontrol", "requeue", f"{job}_1"], env=env, check=True, capture_output=True)
    _wait(env, job, lambda t: not t, 600, "every task to finish")
    text = log.read_text()
    assert "terminated: finished rows are committed" in text and "(restart 1)" in text, text

    rows = read_out(out)
    keys = Counter((r["row_id"], r["sample_index"]) for r in rows)
    assert len(keys) == DEMO_ROWS * SAMPLES and max(keys.values()) == 1
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows if r["status"] != "ok"]
    status = subprocess.run(["dflash-batch", "status", str(out)], env=env, capture_output=True, text=True, check=True)
    assert "4 shard(s), 4 complete" in status.stdout, status.stdout
    # Each task recorded the script as submitted (Slurm runs a copy): status resubmits with it.
    record = json.loads((out / "progress" / "shard-00001.json").read_text())
    assert record["slurm"]["script"] == str(ROOT / "jobs/slurm/array.sbatch"), record

    # One task resubmitted alone, as status's rerun line does it: a finished shard loads nothing.
    again = subprocess.run([*submit[:2], "--array=2", "--export=ALL,DFLASH_SHARDS=4", *submit[3:]], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    _wait(env, again, lambda t: not t, 120, "the resubmitted task")
    assert "already complete for these inputs" in (tmp_path / "logs" / f"dflash-batch-{again}_2.out").read_text()


# -- one TP group started by srun: jobs/slurm/multinode.sbatch -------------------------------------
def test_first_host_is_scontrol_s(slurm):
    from tests.test_tp import HOST_LISTS

    for nodelist, first in HOST_LISTS.items():
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=slurm, capture_output=True,
                               text=True, check=True).stdout.split()
        assert hosts[0] == first == first_host(nodelist), (nodelist, hosts)


def test_srun_ranks_of_one_run_requeued_mid_decode_write_tp1_s_rows_once(slurm, tmp_path):
    """The multi-node template on this one node: `srun` starts 2 tasks, two pipeline stages of one
    rank (two tasks as two nodes: the rendezvous, stop and requeue are those of a TP group's
    ranks, which tests/test_multinode.py runs under torchrun), which find each other from Slurm's
    variables alone; a requeue while they decode stops both at one row, and the restarted task
    writes the rest: every row once, equal to one process's."""
    from tests.test_multinode import assert_rows_equal_tp1, kimi_job, make_cli_kimi_pair, run_tp1, stable_rows

    env = {k: v for k, v in slurm.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    pair = make_cli_kimi_pair(tmp_path / "pair")
    run_tp1(kimi_job(tmp_path, pair, "tp1", rows=24, rows_per_part=1))
    job_file = kimi_job(tmp_path, pair, "out", rows=24, pp=2, rows_per_part=1)
    (tmp_path / "logs").mkdir()
    submit = ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
              str(ROOT / "jobs/slurm/multinode.sbatch"), str(job_file)]
    job = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
    out = tmp_path / "out"
    _wait(env, job, lambda t: len(read_out(out)) >= 2 or not t, 600, "the group's first rows")
    assert _tasks(env, job), "the job finished before it could be requeued"
    subprocess.run(["scontrol", "requeue", job], env=env, check=True, capture_output=True)
    _wait(env, job, lambda t: not t, 900, "the requeued job to finish")
    logs = list((tmp_path / "logs").glob(f"dflash-batch-{job}*.out"))
    text = "".join(p.read_text() for p in logs)
    assert "(restart 1)" in text and "2 ranks on" in text, text[-3000:]
    assert "1: rank 1 of 2 (stage 1 of 2) on" in text, text[-3000:]  # the stage's line, srun-labelled
    assert "0: terminated: finished rows are committed" in text, text[-3000:]  # srun --label: rank 0's line
    rows = stable_rows(out)
    keys = Counter((r["row_id"], r["sample_index"]) for r in rows)
    assert len(keys) == 48 and max(keys.values()) == 1
    assert_rows_equal_tp1(rows, stable_rows(tmp_path / "tp1"))
