"""tests/emulated_graphs.py replays a recording, as a CUDA graph does, and the engine's graph path
holds under it.

- A replay recomputes from the buffers' current values, launches recorded kernels again (a
  Triton kernel under the interpreter), and keeps what the capture froze: a Python number read
  at capture, a tensor replaced instead of updated in place.
- Qwen3 + DFlash2 (sliding rings) through the engine's graph path == eager decoding, token for
  token and round for round, greedy and sampled with logprobs, penalties and logit bias; a
  request whose logit bias appears mid-bucket makes the batch's graphs stale, and the rounds
  after it run eagerly, with the same result. (Kimi-K3: tests/test_flashinfer_latent.py (rings)
  and tests/test_kimi_engine.py (TP2), through the same emulation.)"""

from __future__ import annotations

import pytest
import torch

from dflash_batch.engine import choice
from dflash_batch.engine import engine as engine_module
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.kernels import _triton
from dflash_batch.kernels.scatter import scatter_triton
from tests.emulated_graphs import Capture, EmulatedGraphs
from tests.engine_util import bucket, load_pair, make_drafter, make_target, random_prompts

F64 = torch.float64


def test_a_replay_recomputes_from_the_buffers():
    x, out = torch.arange(4.0), torch.zeros(4)
    graph = Capture()
    with graph.record():
        out.copy_((x * 2).cumsum(0) + 1)
    x.copy_(torch.tensor([1.0, 0.0, 0.0, 5.0]))
    graph.replay()
    assert out.tolist() == [3.0, 3.0, 3.0, 13.0]


def test_a_replay_keeps_what_the_capture_froze():
    x, out, held = torch.ones(3), torch.zeros(3), {"scale": 2, "x": None}
    held["x"] = x
    graph = Capture()
    with graph.record():
        out.copy_(held["x"] * held["scale"])
    held["scale"], held["x"] = 5, torch.full((3,), 7.0)  # a Python int changed, a tensor replaced
    graph.replay()
    assert out.tolist() == [2.0, 2.0, 2.0]  # what a graph gives; re-running the Python gives 35s


@pytest.mark.skipif(not _triton.available(), reason="needs Triton (its interpreter)")
def test_a_replay_launches_recorded_kernels_again():
    cache, slots, rows = torch.zeros(6, 2), torch.tensor([4, -1, 1]), torch.ones(3, 2)
    graph = Capture()
    with graph.record():
        scatter_triton(cache, slots, rows)
    rows.copy_(torch.arange(6.0).view(3, 2))
    graph.replay()
    assert cache[4].tolist() == [0.0, 1.0] and cache[1].tolist() == [4.0, 5.0] and cache[0].tolist() == [0.0, 0.0]


class CountedGraphs(EmulatedGraphs):
    replays = 0

    def replay(self, size: int, greedy: bool, width: int | None = None) -> None:
        CountedGraphs.replays += 1
        super().replay(size, greedy, width)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("graphs")
    make_drafter(d / "drafter", 2, sliding=True, window=6)
    return load_pair(make_target(d / "target"), d / "drafter", F64)


def outcomes(engine: Engine, sampling: list[dict], speculation: bool | str = True) -> dict:
    """Two buckets (the second's batch holds from its start what the first's requests grew)."""
    got = {}
    for seed in (1, 2):
        prompts = random_prompts([3, 20, 9, 14, 5, 30], seed=seed)
        reqs = [Request((str(i), seed), p, SamplingParams(max_new_tokens=9 + 2 * i, seed=i, **sampling[i % len(sampling)]))
                for i, p in enumerate(prompts)]
        got |= {c.key: (c.token_ids, c.spec.per_round, c.logprobs and c.logprobs.token)
                for c in engine.generate(iter(reqs), bucket(max_num_seqs=4, speculation=speculation))}
    return got


SAMPLED = dict(temperature=1.0, top_p=0.9, top_k=20, repetition_penalty=1.2, logit_bias=((3, 2.0),), logprobs=2)


@pytest.mark.parametrize("sampling", [[{}], [SAMPLED, {}]], ids=["greedy", "sampled"])
def test_qwen3_graph_path_equals_eager(qwen3, monkeypatch, sampling):
    """Sampled, the captured rounds choose their verify rows two sequences at a time
    (engine/choice.py: the loop and its gathers captured), the eager ones all four at once."""
    want = outcomes(Engine(*qwen3, dtype=F64), sampling)
    monkeypatch.setattr(choice, "group_rows", lambda vocab: 2 * 8)
    monkeypatch.setattr(engine_module, "RoundGraphs", CountedGraphs)
    monkeypatch.setattr(CountedGraphs, "replays", 0)
    got = outcomes(Engine(*qwen3, dtype=F64, cuda_graphs=True, capture_sizes=[1, 2, 4]), sampling)
    assert got == want
    assert CountedGraphs.replays > 10
    assert any(n for _, rounds, _ in want.values() for n in rounds), "no draft accepted"


CYCLE = [7, 2, 0, 5, 1, 3, 6, 4]  # k of round i


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [[{}], [SAMPLED, {}]], ids=["greedy", "sampled"])
def test_every_verify_width_replays_its_own_graph(qwen3, monkeypatch, sampling):
    """An auto bucket whose k changes every round (engine/schedule.py), one k a round (per-row
    counts: tests/test_row_drafts.py): each width's graph == eager at that width, round for round
    (a replay at the wrong width would keep drafts past k)."""
    monkeypatch.setattr(engine_module.Schedule, "plan", lambda self, n: CYCLE[self.total_rounds % 8])
    monkeypatch.setattr(engine_module.Schedule, "why_stop", lambda *args: None)
    want = outcomes(Engine(*qwen3, dtype=F64, per_row=False), sampling, "auto")
    monkeypatch.setattr(engine_module, "RoundGraphs", CountedGraphs)
    monkeypatch.setattr(CountedGraphs, "replays", 0)
    got = outcomes(Engine(*qwen3, dtype=F64, cuda_graphs=True, capture_sizes=[1, 2, 4], per_row=False), sampling,
                   "auto")
    assert got == want
    assert CountedGraphs.replays > 10


def test_a_batch_reshaped_mid_bucket_stops_replaying(qwen3, monkeypatch):
    # The first requests are plain; the fifth, admitted when a row frees, brings a logit bias
    # (its table is allocated then): the captured graphs no longer cover the batch.
    sampling = [{}] * 4 + [dict(logit_bias=((3, 2.0),))]
    reqs = lambda: [Request((str(i), 0), p, SamplingParams(max_new_tokens=6 + 4 * i, **sampling[i % 5]))  # noqa: E731
                    for i, p in enumerate(random_prompts([3, 20, 9, 14, 5, 30], seed=4))]
    want = {c.key: c.token_ids for c in Engine(*qwen3, dtype=F64).generate(reqs(), bucket(max_num_seqs=4))}
    monkeypatch.setattr(engine_module, "RoundGraphs", CountedGraphs)
    monkeypatch.setattr(CountedGraphs, "replays", 0)
    engine = Engine(*qwen3, dtype=F64, cuda_graphs=True, capture_sizes=[1, 2, 4])
    assert {c.key: c.token_ids for c in engine.generate(reqs(), bucket(max_num_seqs=4))} == want
    assert CountedGraphs.replays > 0
