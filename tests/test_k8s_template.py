"""jobs/k8s/indexed-job.yaml, read as Kubernetes would read its fields (no cluster here): an
Indexed Job whose every index resolves to its own shard of DFLASH_SHARDS = completions, GPUs a
pod = the job file's ranks (tensor_parallel_size x pipeline_parallel_size), every path the job
reads or writes on a mounted volume, evictions not counted as failures, and the exit codes that no rerun can mend failing
their index at once."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import yaml

from dflash_batch.cli import EXIT_PREEMPTED, EXIT_TOO_MANY_ERRORS
from dflash_batch.job import load_job
from dflash_batch.plan.shards import Shard, resolve_shard

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "jobs" / "k8s" / "indexed-job.yaml"
EXIT_REFUSED = 2  # cli._fail: a job that cannot run, refused before any model loads


def _manifest() -> tuple[dict, dict, dict]:
    doc = yaml.safe_load(TEMPLATE.read_text())
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return doc, pod, container


def _job_file(container: dict) -> Path:
    """The job file the pod runs, as it lies in this repository (the template mounts jobs/)."""
    command = container["command"]
    assert command[:2] == ["dflash-batch", "run"]
    return ROOT / "jobs" / PurePosixPath(command[2]).name


def test_an_indexed_job_whose_indices_are_the_shards():
    doc, pod, container = _manifest()
    assert (doc["apiVersion"], doc["kind"]) == ("batch/v1", "Job")
    spec = doc["spec"]
    assert spec["completionMode"] == "Indexed" and 1 <= spec["parallelism"] <= spec["completions"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["DFLASH_SHARDS"]) == spec["completions"]
    job = load_job(_job_file(container))
    shards = [resolve_shard(job.sharding, {**env, "JOB_COMPLETION_INDEX": str(i)}) for i in range(spec["completions"])]
    assert shards == [Shard(i, spec["completions"]) for i in range(spec["completions"])]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == job.model.ranks  # TP x PP x DP, all in the pod


def test_failures_evictions_and_the_grace_to_commit():
    doc, pod, container = _manifest()
    spec = doc["spec"]
    # backoffLimitPerIndex and podFailurePolicy need pods that are not restarted in place
    assert pod["restartPolicy"] == "Never" and spec["backoffLimitPerIndex"] >= 1
    rules = spec["podFailurePolicy"]["rules"]
    ignored = [r for r in rules if r["action"] == "Ignore"]
    assert [c["type"] for r in ignored for c in r["onPodConditions"]] == ["DisruptionTarget"]
    (fail_index,) = [r for r in rules if r["action"] == "FailIndex"]
    codes = fail_index["onExitCodes"]
    assert codes["containerName"] == container["name"] and codes["operator"] == "In"
    assert sorted(codes["values"]) == [EXIT_REFUSED, EXIT_TOO_MANY_ERRORS] and EXIT_PREEMPTED not in codes["values"]
    assert pod["terminationGracePeriodSeconds"] >= 60


def test_every_path_the_job_uses_is_on_a_mounted_volume():
    doc, pod, container = _manifest()
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} <= set(volumes)

    def mount_of(path: str) -> dict:
        found = [m for where, m in mounts.items() if PurePosixPath(path).is_relative_to(where)]
        assert found, f"{path} is on no volume the pod mounts"
        return found[0]

    command = container["command"]
    assert not mount_of(command[command.index("--output-dir") + 1]).get("readOnly")
    assert mount_of(command[2])
    job = load_job(_job_file(container))
    for path in [*job.input.paths, job.model.target, job.model.drafter]:
        mount_of(path)
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
