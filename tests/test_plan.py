"""Bucket edges and shard assignment (Slurm arrays)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dflash_batch.job import JobError, ShardingSpec
from dflash_batch.plan.buckets import assign_bucket
from dflash_batch.plan.shards import Shard, parse_shard, resolve_shard, shard_of


def test_bucket_edges_are_inclusive_upper_bounds():
    edges = [2048, 8192, 131072]
    assert assign_bucket(1, edges) == 0
    assert assign_bucket(2048, edges) == 0
    assert assign_bucket(2049, edges) == 1
    assert assign_bucket(8192, edges) == 1
    assert assign_bucket(8193, edges) == 2
    assert assign_bucket(131072, edges) == 2
    assert assign_bucket(131073, edges) is None


def test_shards_are_disjoint_complete_stable_and_balanced():
    ids = [f"row-{i}" for i in range(100_000)]
    for n in (1, 3, 16):
        owner = [shard_of(i, n) for i in ids]
        assert owner == [shard_of(i, n) for i in ids]         # stable across calls
        counts = Counter(owner)
        assert set(counts) == set(range(n))                     # complete
        assert sum(counts.values()) == len(ids)                 # disjoint: one owner each
        mean = len(ids) / n
        assert max(abs(c - mean) for c in counts.values()) <= 0.05 * mean
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    assert {i: shard_of(i, 7) for i in shuffled} == {i: shard_of(i, 7) for i in ids}  # order-free
    # Pinned to blake2b-64 (little-endian) mod n: a change here would reshuffle existing runs.
    assert shard_of("row-1", 16) == 12


SLURM = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "1",
         "SLURM_ARRAY_TASK_MAX": "8"}


def test_slurm_array_maps_task_ids_to_shards():
    auto = ShardingSpec()
    assert resolve_shard(auto, {}) == Shard(0, 1)
    assert resolve_shard(auto, SLURM) == Shard(4, 8)  # --array=1-8: task 5 is the 5th shard
    stepped = {"SLURM_ARRAY_TASK_ID": "20", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0",
               "SLURM_ARRAY_TASK_MAX": "30", "SLURM_ARRAY_TASK_STEP": "10"}
    assert resolve_shard(auto, stepped) == Shard(2, 4)
    assert resolve_shard(auto, SLURM, parse_shard("3/4")) == Shard(3, 4)  # --shard wins
    assert resolve_shard(ShardingSpec(mode="explicit", index=1, count=2), SLURM) == Shard(1, 2)
    assert resolve_shard(ShardingSpec(mode="none"), SLURM) == Shard(0, 1)


@pytest.mark.parametrize("env,needle", [
    ({"SLURM_ARRAY_TASK_ID": "3"}, "SLURM_ARRAY_TASK_COUNT, SLURM_ARRAY_TASK_MIN not set"),
    ({"SLURM_ARRAY_TASK_ID": "", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0"},
     "SLURM_ARRAY_TASK_ID not set"),
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "12"}, "inconsistent Slurm array"),
    ({**SLURM, "SLURM_ARRAY_TASK_ID": "0"}, "inconsistent Slurm array"),
    ({**SLURM, "SLURM_ARRAY_TASK_MAX": "30"}, "evenly spaced"),  # --array=1,2,30-style list
    ({**SLURM, "SLURM_ARRAY_TASK_COUNT": "x"}, "not integers"),
])
def test_half_set_or_inconsistent_slurm_env_is_an_error(env, needle):
    with pytest.raises(JobError, match=needle):
        resolve_shard(ShardingSpec(), env)


def test_slurm_mode_without_array_env_is_an_error():
    with pytest.raises(JobError, match="not set"):
        resolve_shard(ShardingSpec(mode="slurm"), {})


def test_kubernetes_indexed_job_maps_its_index_to_a_shard():
    auto = ShardingSpec()
    assert resolve_shard(auto, {"JOB_COMPLETION_INDEX": "3", "DFLASH_SHARDS": "8"}) == Shard(3, 8)
    # the job's count wins over the environment's; Slurm's variables over Kubernetes'
    assert resolve_shard(ShardingSpec(count=4), {"JOB_COMPLETION_INDEX": "3", "DFLASH_SHARDS": "8"}) == Shard(3, 4)
    assert resolve_shard(ShardingSpec(mode="kubernetes", count=4), {"JOB_COMPLETION_INDEX": "0"}) == Shard(0, 4)
    assert resolve_shard(auto, {**SLURM, "JOB_COMPLETION_INDEX": "0", "DFLASH_SHARDS": "8"}) == Shard(4, 8)
    assert resolve_shard(auto, {"JOB_COMPLETION_INDEX": "3", "DFLASH_SHARDS": "8"}, parse_shard("1/2")) == Shard(1, 2)
    assert resolve_shard(ShardingSpec(mode="none"), {"JOB_COMPLETION_INDEX": "3", "DFLASH_SHARDS": "8"}) == Shard(0, 1)


@pytest.mark.parametrize("spec,env,needle", [
    (ShardingSpec(), {"JOB_COMPLETION_INDEX": "3"}, "no shard count: set sharding.count"),
    (ShardingSpec(), {"JOB_COMPLETION_INDEX": "8", "DFLASH_SHARDS": "8"}, "is not a shard of 8"),
    (ShardingSpec(count=2), {"JOB_COMPLETION_INDEX": "2"}, "is not a shard of 2"),
    (ShardingSpec(), {"JOB_COMPLETION_INDEX": "one", "DFLASH_SHARDS": "8"}, "must be integers"),
    (ShardingSpec(mode="kubernetes"), {"DFLASH_SHARDS": "8"}, "JOB_COMPLETION_INDEX is not set"),
])
def test_kubernetes_env_that_names_no_shard_is_an_error(spec, env, needle):
    with pytest.raises(JobError, match=needle):
        resolve_shard(spec, env)


def test_sharding_count_belongs_to_modes_that_read_it():
    with pytest.raises(ValueError, match="count is only used"):
        ShardingSpec(mode="slurm", count=4)
    with pytest.raises(ValueError, match="index is only used"):
        ShardingSpec(mode="kubernetes", index=1, count=4)


@pytest.mark.parametrize("text", ["3", "4/4", "-1/4", "a/b"])
def test_bad_shard_option(text):
    with pytest.raises(JobError):
        parse_shard(text)
