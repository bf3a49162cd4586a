"""Tensor parallelism on gloo: two CPU ranks reproduce the single-process model, in float64 at
1e-10 of the magnitude (the ranks sum partial products in another order: ~1e-16 apart) and in
float32 at 1e-4 of it (tests/numerics.py)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from dflash_batch.parallel import first_host, local_gpu, slurm_rendezvous
from tests import tp_worker
from tests.numerics import assert_close
from tests.tiny_models import make_qwen3_checkpoint

pytestmark = pytest.mark.numerics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_tp2_matches_tp1(tmp_path, dtype):
    # Tied head and attention biases: the shared vocab-parallel parameter and the row-parallel
    # bias (added once, after the all-reduce) are the easy places to get TP wrong.
    path = make_qwen3_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True, attention_bias=True)
    expected = tp_worker.forward_steps(path, dtype)
    mp.spawn(tp_worker.run, args=(2, free_port(), str(path), str(tmp_path), dtype), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, value in expected.items():
            assert_close(got[key], value, msg=f"rank {rank} {key}")
        assert torch.equal(got["prefill"].argmax(-1), expected["prefill"].argmax(-1))
        assert torch.equal(got["decode"].argmax(-1), expected["decode"].argmax(-1))


@pytest.mark.parametrize("env, gpus, want", [
    ({"LOCAL_RANK": "3", "RANK": "11"}, 8, 3),                 # torchrun
    ({"SLURM_LOCALID": "5", "RANK": "13"}, 8, 5),              # srun
    ({"RANK": "13"}, 8, 5),                                    # neither: the global rank modulo the node's GPUs
    ({"LOCAL_RANK": "0", "SLURM_LOCALID": "2"}, 8, 0),         # torchrun under srun: torchrun's word
], ids=["torchrun", "srun", "rank", "both"])
def test_each_rank_takes_its_nodes_gpu(env, gpus, want):
    assert local_gpu(env, gpus) == want


# Host lists as Slurm writes them; the first host is the one `scontrol show hostnames` prints
# first (tests/test_slurm_real.py asks the real scontrol the same).
HOST_LISTS = {"gpu[07-08,11],login2": "gpu07", "login2,gpu[07-08]": "login2", "x[3]y[5-6]": "x3y5",
              "rack[2-3]-n[010-011]": "rack2-n010", "solo": "solo", "a-b.c,d": "a-b.c"}


@pytest.mark.parametrize("nodelist", HOST_LISTS)
def test_first_host_of_a_slurm_host_list(nodelist):
    assert first_host(nodelist) == HOST_LISTS[nodelist]


def test_ranks_srun_started_meet_at_the_first_host_on_the_job_s_port():
    srun = {"SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "h200-[03-04]", "SLURM_STEP_NODELIST": "h200-[03-04]"}
    assert slurm_rendezvous(srun) == {"WORLD_SIZE": "16", "RANK": "9", "MASTER_ADDR": "h200-03", "MASTER_PORT": "24242"}
    other_job = slurm_rendezvous({**srun, "SLURM_JOB_ID": "4243"})
    assert other_job["MASTER_PORT"] != "24242"
    # a step on part of the allocation: its own tasks and nodes, not the job's
    step = slurm_rendezvous({**srun, "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NODELIST": "h200-04"})
    assert (step["WORLD_SIZE"], step["MASTER_ADDR"]) == ("8", "h200-04")
    # a hand-set address or port wins
    assert slurm_rendezvous({**srun, "MASTER_ADDR": "ib0-h200-03"})["MASTER_ADDR"] == "ib0-h200-03"
    # not srun's tasks: a batch script asked for 16 tasks (it spawns its own ranks), torchrun's workers
    assert slurm_rendezvous({k: v for k, v in srun.items() if not k.startswith("SLURM_STEP")}) == {}
    assert slurm_rendezvous({**srun, "WORLD_SIZE": "4", "RANK": "1"}) == {}
