"""Which rows this process owns: Slurm array shards by a stable hash of the row id.

Assignment depends only on (row_id, shard count), never on file order, so it is stable across
retries and across changes to how the input is split into files.
"""

from __future__ import annotations

from collections.abc import Mapping

from dflash_batch.job import JobError, ShardingSpec
from dflash_batch.keys import Shard, hash64

SLURM_VARS = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN")
K8S_INDEX = "JOB_COMPLETION_INDEX"  # set in each pod of an Indexed Job: 0 .. completions - 1
COUNT_VAR = "DFLASH_SHARDS"  # the shard count where the launcher gives none (a Job's completions)


def shard_of(row_id: str, count: int) -> int:
    return hash64(row_id) % count


def group_shard(shard: Shard, group: int, groups: int) -> Shard:
    """The shard data-parallel group `group` of `groups` runs for the task's `shard` i/n: shard
    i * groups + group of n * groups (the run's shards: each group commits its own rows)."""
    return Shard(shard.index * groups + group, shard.count * groups)


def parse_shard(text: str) -> Shard:
    """`i/n` from the command line."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise JobError(f"--shard {text!r}: expected INDEX/COUNT, e.g. 3/16") from None
    if not 0 <= i < n:
        raise JobError(f"--shard {text!r}: need 0 <= INDEX < COUNT")
    return Shard(i, n)


def _slurm_shard(env: Mapping[str, str]) -> Shard:
    present = {k: env.get(k) for k in SLURM_VARS}
    missing = [k for k, v in present.items() if not v]
    if missing:
        raise JobError(f"Slurm array environment is incomplete: {', '.join(missing)} not set "
                       f"(set: {', '.join(k for k in SLURM_VARS if k not in missing) or 'none'}). "
                       "Run under `sbatch --array=...`, or pass --shard INDEX/COUNT.")
    try:
        task, count, low = (int(present[k]) for k in SLURM_VARS)
        step = int(env.get("SLURM_ARRAY_TASK_STEP") or 1)
        high = int(env["SLURM_ARRAY_TASK_MAX"]) if env.get("SLURM_ARRAY_TASK_MAX") else None
    except ValueError:
        raise JobError(f"Slurm array variables are not integers: {present}") from None
    offset = task - low
    if count < 1 or step < 1 or offset < 0 or offset % step:
        raise JobError(f"inconsistent Slurm array: task {task}, min {low}, step {step}, count {count}")
    index = offset // step
    if index >= count or (high is not None and high != low + (count - 1) * step):
        raise JobError(f"inconsistent Slurm array: task {task} with min {low}, max {high}, step "
                       f"{step}, count {count}. Only evenly spaced arrays (--array=A-B[:S]) map "
                       "to shards; pass --shard INDEX/COUNT otherwise.")
    return Shard(index, count)


def _kubernetes_shard(env: Mapping[str, str], count: int | None) -> Shard:
    """A Kubernetes indexed Job's pod: its index from JOB_COMPLETION_INDEX, the count from the
    job's sharding.count, else DFLASH_SHARDS (Kubernetes does not tell a pod the completions)."""
    index, given = env.get(K8S_INDEX), env.get(COUNT_VAR)
    if not index:
        raise JobError(f"sharding.mode kubernetes: {K8S_INDEX} is not set; run as a pod of an Indexed Job "
                       "(completionMode: Indexed, jobs/k8s/indexed-job.yaml), or pass --shard INDEX/COUNT")
    if count is None and not given:
        raise JobError(f"{K8S_INDEX}={index} (a Kubernetes indexed Job) but no shard count: set sharding.count "
                       f"in the job or {COUNT_VAR} in the pod's environment to the Job's completions")
    try:
        index_value, count = int(index), count if count is not None else int(given)
    except ValueError:
        raise JobError(f"{K8S_INDEX}={index!r} and {COUNT_VAR}={given!r} must be integers") from None
    if count < 1 or not 0 <= index_value < count:
        raise JobError(f"{K8S_INDEX}={index_value} is not a shard of {count} (sharding.count or {COUNT_VAR}): "
                       "the Job's completions and the shard count must be equal")
    return Shard(index_value, count)


def resolve_shard(spec: ShardingSpec, env: Mapping[str, str], override: Shard | None = None) -> Shard:
    """The shard this process runs: --shard, then the job's sharding section, then Slurm's array
    variables, then a Kubernetes indexed Job's."""
    if override is not None:
        return override
    if spec.mode == "explicit":
        return Shard(spec.index, spec.count)
    if spec.mode == "none":
        return Shard(0, 1)
    if spec.mode == "slurm" or (spec.mode == "auto" and any(env.get(k) for k in SLURM_VARS)):
        return _slurm_shard(env)
    if spec.mode == "kubernetes" or env.get(K8S_INDEX):
        return _kubernetes_shard(env, spec.count)
    return Shard(0, 1)
