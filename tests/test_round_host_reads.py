"""A decode round reads no tensor value on the host: what CUDA-graph capture needs (a captured
round replays without Python, so a value read on the host would be the capture's forever).

The round (draft, verify, choose, accept, context, commit) runs with every host read of a tensor
(`tolist`, `item`, `bool`, `int`, `float`, `index`) raising, for Qwen3 + DFlash2 and for Kimi-K3 +
DFlash2-MLA with MXFP4 experts. On the CPU the packed experts run through the torch reference,
which groups rows by expert on the host; here it is swapped for a grouping over every expert id
(kernels/moe_mxfp4.py's Triton kernel, the GPU path, groups on the device: nothing to swap).
Prefill is not captured and may read what it likes."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kernels.moe_mxfp4
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.engine.round import Round
from dflash_batch.testing import kimi_pair
from tests.engine_util import bucket, load_pair, make_drafter, make_target, random_prompts

HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name} inside a round")
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def rounds_without_host_reads(monkeypatch, target, drafter, vocab: int, sampling: dict) -> int:
    """Generate with every Round.run under no_host_reads; the number of rounds run."""
    run, count = Round.run, []

    def guarded(self, *args):
        with no_host_reads():
            run(self, *args)
        count.append(1)

    monkeypatch.setattr(Round, "run", guarded)
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=12, seed=i, **sampling))
            for i, p in enumerate(random_prompts([3, 20, 9], vocab=vocab, seed=2))]
    done = list(Engine(target, drafter, capture_sizes=[2, 4]).generate(iter(reqs), bucket(max_num_seqs=3)))
    assert len(done) == 3 and all(c.finish_reason == "length" for c in done)
    return len(count)


SAMPLING = {"greedy": {}, "sampled": dict(temperature=1.0, top_p=0.9, repetition_penalty=1.2)}


def test_the_guard_catches_a_host_read():
    with pytest.raises(HostRead), no_host_reads():
        torch.ones(2).sum().item()


@pytest.mark.parametrize("sampling", SAMPLING)
def test_qwen3_round(tmp_path, monkeypatch, sampling):
    make_drafter(tmp_path / "drafter", 2, sliding=True, window=6)
    target, drafter = load_pair(make_target(tmp_path / "target"), tmp_path / "drafter", torch.float32)
    assert rounds_without_host_reads(monkeypatch, target, drafter, 8, SAMPLING[sampling]) > 3


@pytest.mark.parametrize("sampling", SAMPLING)
def test_kimi_round(tmp_path, monkeypatch, sampling):
    target_dir, drafter_dir = kimi_pair.make_kimi_pair(tmp_path)
    target, drafter = kimi_pair.load_pair(target_dir, drafter_dir)
    experts = target.config["num_experts"]

    def every_expert(x, ids, weights, width, expert):  # routed_sum without the host-side grouping
        out = x.new_zeros(x.shape[0], width)
        for e in range(experts):
            w = (weights * (ids == e)).sum(-1, keepdim=True)
            out += w * expert(e, x)
        return out

    monkeypatch.setattr(kernels.moe_mxfp4, "routed_sum", every_expert)
    assert rounds_without_host_reads(monkeypatch, target, drafter, kimi_pair.VOCAB, SAMPLING[sampling]) > 3
