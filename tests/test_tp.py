"""Tensor parallelism on gloo: two CPU ranks reproduce the single-process model, in float64 at
1e-10 of the magnitude (the ranks sum partial products in another order: ~1e-16 apart) and in
float32 at 1e-4 of it (tests/numerics.py)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from dflash_batch.parallel import local_gpu
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
