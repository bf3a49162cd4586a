"""Tensor parallelism on gloo: two CPU ranks reproduce the single-process model."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from tests import tp_worker
from tests.tiny_models import make_qwen3_checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_matches_tp1(tmp_path):
    # Tied head and attention biases: the shared vocab-parallel parameter and the row-parallel
    # bias (added once, after the all-reduce) are the easy places to get TP wrong.
    path = make_qwen3_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True, attention_bias=True)
    expected = tp_worker.forward_steps(path)
    mp.spawn(tp_worker.run, args=(2, free_port(), str(path), str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=1e-4, rtol=0, msg=f"rank {rank} {key}")
        assert torch.equal(got["prefill"].argmax(-1), expected["prefill"].argmax(-1))
        assert torch.equal(got["decode"].argmax(-1), expected["decode"].argmax(-1))
