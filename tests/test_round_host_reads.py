"""A decode round waits on nothing from the host: what CUDA-graph capture needs (a captured round
replays without Python, and a sync inside a capture is refused).

The round runs with the GPU's code paths selected on the CPU (kernels/'s Triton kernels under
TRITON_INTERPRET=1: sampling, acceptance, the MXFP4 MoE, AttnRes, cache scatter; fla's recurrent
KDA kernel; flashinfer's MLA wrapper through tests/fake_flashinfer.py) inside
tests/emulated_graphs.py's guard, as the engine's graph path captures it (the guard refuses every op whose result's shape or a returned
scalar depends on tensor values, bool-mask indexing, and copies to the host), then replayed. Kernel bodies (the
interpreter, the wrapper's emulation) are the device's and run unguarded. Both families, greedy
and sampled with logprobs, penalties and logit bias. Prefill is not captured and may read what
it likes."""

from __future__ import annotations

import pytest
import torch

import dflash_batch.models.layers.kda as kda_layer
from dflash_batch.engine import engine as engine_module
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.kernels import _triton, kda, ops
from dflash_batch.testing import kimi_pair
from tests import fake_flashinfer
from tests.emulated_graphs import EmulatedGraphs, HostSync, refuse_host_syncs
from tests.engine_util import bucket, load_pair, make_drafter, make_target, random_prompts

pytestmark = pytest.mark.skipif(not _triton.available(), reason="needs Triton (its interpreter)")

SAMPLING = {"greedy": {},
            "sampled": dict(temperature=1.0, top_p=0.9, top_k=20, repetition_penalty=1.2, presence_penalty=0.3,
                            logit_bias=((3, 2.0), (5, -1.0)), logprobs=2)}
WANT = {"greedy": (True, False, False, False), "sampled": (False, True, True, True)}  # a replay of this kind ran


@pytest.fixture()
def gpu_paths(monkeypatch):
    """The kernels a CUDA device would run, here on the CPU."""
    monkeypatch.setattr(ops, "for_device", lambda device: ops.TRITON)
    monkeypatch.setattr(kda_layer, "kda_kernels", lambda state: (kda.recurrent, kda_layer.kda_chunked))


class CountedGraphs(EmulatedGraphs):
    """Captures under the guard (tests/emulated_graphs.py's Capture refuses host syncs) and notes
    what each replay's batch held: (greedy, logit bias, penalty counts, logprobs)."""
    replays: list[tuple[bool, bool, bool, bool]] = []

    def replay(self, size: int, greedy: bool, width: int | None = None) -> None:
        b = self.batch
        self.replays.append((greedy, b.bias is not None, b.counts is not None, b.token_logprob is not None))
        super().replay(size, greedy, width)


def captured_rounds(monkeypatch, target, drafter, vocab: int, sampling: dict, drafts: int | None = None,
                    **engine) -> set[tuple]:
    """Buckets through the engine's graph path, captures guarded (sampled: a second bucket whose
    batch holds from its start what the first one's requests grew: bias, counts, logprobs); what
    the replays' batches held."""
    monkeypatch.setattr(engine_module, "RoundGraphs", CountedGraphs)
    monkeypatch.setattr(CountedGraphs, "replays", [])
    # One capture size, few tokens: each captured kind is guarded once per bucket, and replays
    # under the Triton interpreter are what this test costs.
    e = Engine(target, drafter, cuda_graphs=True, capture_sizes=[4], **engine)
    # A second bucket only where the first one's requests grew the tables it starts with.
    for seed in (2, 3) if sampling else (2,):
        reqs = [Request((str(i), seed), p, SamplingParams(max_new_tokens=5, seed=i, **sampling))
                for i, p in enumerate(random_prompts([3, 20, 9, 5], vocab=vocab, seed=seed))]
        done = list(e.generate(iter(reqs), bucket(max_num_seqs=4, drafts=drafts)))
        assert len(done) == 4 and all(c.finish_reason == "length" for c in done), [c.error for c in done]
    return set(CountedGraphs.replays)


@pytest.mark.parametrize("op", [
    lambda x: torch.bincount(x), lambda x: x.nonzero(), lambda x: x.unique(), lambda x: x[x > 1],
    lambda x: x.masked_select(x > 1), lambda x: x.sum().item(), lambda x: bool(x[0]), lambda x: x.tolist(),
    lambda x: x.cpu(), lambda x: x.numpy(), lambda x: torch.repeat_interleave(x, x), lambda x: torch.equal(x, x),
], ids=["bincount", "nonzero", "unique", "bool_mask", "masked_select", "item", "bool", "tolist", "cpu", "numpy",
        "repeat_interleave", "equal"])
def test_the_guard_refuses(op):
    with pytest.raises(HostSync), refuse_host_syncs():
        op(torch.tensor([1, 2, 3]))


def test_the_guard_allows_what_a_graph_holds():
    x = torch.tensor([1, 2, 3])
    with refuse_host_syncs():
        x[torch.tensor([2, 0])] += 1
        torch.repeat_interleave(x, x, output_size=8)
        torch.where(x > 1, x, 0).argsort()


@pytest.mark.parametrize("sampling", SAMPLING)
def test_qwen3_round(tmp_path, monkeypatch, gpu_paths, sampling):
    make_drafter(tmp_path / "drafter", 2, sliding=True, window=6)
    target, drafter = load_pair(make_target(tmp_path / "target"), tmp_path / "drafter", torch.float32)
    assert WANT[sampling] in captured_rounds(monkeypatch, target, drafter, 8, SAMPLING[sampling])


@pytest.mark.parametrize("drafts", [0, 3])
def test_a_round_verifying_fewer_drafts(tmp_path, monkeypatch, gpu_paths, drafts):
    """Widths below the block (engine/schedule.py): k = 3 of 7 (the drafts past it blanked, the
    verify's own positions and slots), and k = 0 (no draft, the drafter's context kept)."""
    make_drafter(tmp_path / "drafter", 2, sliding=True, window=6)
    target, drafter = load_pair(make_target(tmp_path / "target"), tmp_path / "drafter", torch.float32)
    assert (True, False, False, False) in captured_rounds(monkeypatch, target, drafter, 8, {}, drafts=drafts)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLING)
def test_kimi_round(tmp_path, monkeypatch, gpu_paths, sampling):
    fake_flashinfer.install(monkeypatch)
    from dflash_batch.backends.flashinfer_attention import FlashInferAttention

    target, drafter = kimi_pair.load_pair(*kimi_pair.make_kimi_pair(tmp_path, window=10))
    attention = FlashInferAttention("cpu", latent_rings=True, workspace_bytes=1024)
    assert WANT[sampling] in captured_rounds(monkeypatch, target, drafter, kimi_pair.VOCAB, SAMPLING[sampling],
                                             attention=attention)
