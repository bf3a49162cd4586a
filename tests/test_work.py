"""A round's work as the plan counts it (plan/work.py: the engine's own round on the meta device,
repeated layer parts counted once, one sequence scaled) against what a real round on the CPU runs:
torch's FlopCounterMode over Round.run on the tiny pairs, in total and per component (the routed
experts, each attention kind, the LM head), and the collective payloads that reach
torch.distributed on gloo ranks (TP2 and TP4, the MLA latents whole and split), to the byte."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_flop_count

from dflash_batch.backends import torch_attention
from dflash_batch import parallel
from dflash_batch.backends.latent_split import LatentSplit
from dflash_batch.backends.torch_attention import TORCH, TorchAttention
from dflash_batch.engine.engine import Engine
from dflash_batch.job import parse_job
from dflash_batch.plan import work
from dflash_batch.plan.buckets import Bucket
from dflash_batch.sizing import Sizer
from dflash_batch.testing import kimi_pair
from tests.engine_util import load_pair, make_drafter, make_target
from tests.test_tp import free_port

CONTEXT = 256  # the bucket's longest: the plan counts its rounds there
BUCKET = Bucket(0, "0-256", CONTEXT, 4, True, None)


# The CPU's fused attention op: torch's flash-attention formula (flop_counter leaves the CPU op out).
@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def sizer_of(target: Path, drafter: Path, greedy: bool, tp: int = 1, split: bool = False,
             at_stage: tuple[int, int] = (0, 1)) -> Sizer:
    """The plan's models for a job of this pair whose rows decode greedily or sample (a rank of
    stage `at_stage`)."""
    job = parse_job({"input": {"paths": ["p.jsonl"], "prompt_column": "prompt"}, "output": {"dir": "out"},
                     "model": {"target": str(target), "drafter": str(drafter), "dtype": "float32",
                               "tensor_parallel_size": tp},
                     "engine": {"max_model_len": 256, "context_parallel": split or None, "backend": "torch"},
                     "sampling": {"temperature": 0.0 if greedy else 1.0},
                     "buckets": [{"max_tokens": 256, "max_num_seqs": 4}]})
    return Sizer(job, target.parent, tp, None, latent_split=split, at_stage=at_stage)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("work")
    make_target(d / "qwen3")
    make_drafter(d / "qwen3-drafter", 2, block_size=8)
    return {"kimi": kimi_pair.make_kimi_pair(d / "kimi"), "qwen3": (d / "qwen3", d / "qwen3-drafter")}


def cpu_round(target: Path, drafter: Path, seqs: int, width: int, greedy: bool) -> FlopCounterMode:
    """FlopCounterMode over a real round of `seqs` padding rows at CONTEXT tokens (the blocked
    attention path on its matmuls, as on the meta device)."""
    engine = Engine(*load_pair(target, drafter), device="cpu")
    engine.allocate(dataclasses.replace(BUCKET, max_num_seqs=seqs))
    batch, step = engine.bucket_state[2], engine.bucket_state[3]
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        step.run(batch, seqs, greedy, CONTEXT + batch.block, width)
    return counter


def by_component(counter: FlopCounterMode, target: Path, drafter: Path) -> dict[str, int]:
    """The counter's FLOPs by the plan's components, from the modules' names."""
    models = load_pair(target, drafter, torch.float32)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    out = {}
    for role, model in zip(("target", "drafter"), models):
        for name, module in model.named_modules():
            kind = work.COMPONENTS.get(type(module).__name__)
            if kind and kind != "LM head":
                key = f"{role} {kind}"
                out[key] = out.get(key, 0) + counts.get(f"{type(model).__name__}.{name}", 0)
    # The head both use: under the target's name in its forward, under its class's in the drafter's.
    out["LM head"] = counts.get(f"{type(models[0]).__name__}.lm_head", 0) + counts.get("ParallelLMHead", 0)
    return out


def plan_side(w: work.Work) -> dict[str, int]:
    out = {k: v for k, v in w.flops.items() if "LM head" not in k and "other" not in k}
    out["LM head"] = sum(v for k, v in w.flops.items() if "LM head" in k)
    return out


@pytest.mark.parametrize("family", ["kimi", "qwen3"])
@pytest.mark.parametrize("width, greedy", [(8, True), (3, False), (1, True)])
def test_the_plans_flops_are_what_a_cpu_round_runs(pairs, family, width, greedy, monkeypatch):
    monkeypatch.setattr(torch_attention, "FUSED_CPU_BLOCKS", False)
    target, drafter = pairs[family]
    counted = sizer_of(target, drafter, greedy).work(BUCKET, width).times(3)
    counter = cpu_round(target, drafter, 3, width, greedy)
    assert counted.total_flops == pytest.approx(counter.get_total_flops(), rel=0.01)
    want, got = by_component(counter, target, drafter), plan_side(counted)
    for component, flops in want.items():
        assert got.get(component, 0) == pytest.approx(flops, rel=0.01), component
    assert any(k.endswith("routed experts") and v for k, v in got.items()) == (family == "kimi")
    # The drafter writes its context at every width (a round of width 1 drafts nothing).
    assert got["LM head"] > 0 and counted.flops["drafter other"] > 0
    assert ("drafter LM head" in counted.flops) == (width > 1)


@pytest.mark.parametrize("family", ["kimi", "qwen3"])
def test_layer_parts_counted_once_are_counted_as_if_run(pairs, family, monkeypatch):
    # Every component, "other" ones too: the Qwen3 drafter's MLP is the target's in shape, and
    # each model's work stays its own.
    sizer = sizer_of(*pairs[family], greedy=True)
    once = sizer.work(BUCKET, 8)
    monkeypatch.setattr(work, "_once", lambda part, name, method, memo, counting: method)
    assert sizer.work(BUCKET, 8) == once


def test_a_round_of_n_sequences_is_n_rounds_of_one(pairs):
    for greedy in (True, False):
        sizer = sizer_of(*pairs["kimi"], greedy)
        one = sizer.work(BUCKET, 8)
        with torch.no_grad():
            batch = sizer.engine.allocate(BUCKET)  # 4 sequences
            step = sizer.engine.rounds[batch.block]
            step.attention = TORCH
            four = work.round_work(sizer.target, sizer.drafter, step, batch, 4, CONTEXT, 8, greedy)
        assert four == one.times(4)


def _counting(name: str, payload_arg: int, into: dict):
    """A torch.distributed collective that adds the bytes of its `payload_arg`th argument to `into`."""
    real = getattr(dist, name)

    def call(*args, **kwargs):
        x = args[payload_arg]
        into[name] = into.get(name, 0) + x.numel() * x.element_size()
        return real(*args, **kwargs)
    return call


def rank_round(rank: int, ranks: int, port: int, target: str, drafter: str, split: bool, width: int,
               greedy: bool, out: str, stages: int = 1) -> None:
    """One round of 3 padding rows on this gloo rank (of `stages` pipeline stages), counting what
    reaches torch.distributed."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    parallel.form_stages(stages)
    try:
        torch.set_num_threads(1)
        counted: dict[str, int] = {}
        for name, at in (("all_reduce", 0), ("all_gather", 1), ("all_gather_into_tensor", 1),
                         ("all_gather_single", 1), ("reduce_scatter_tensor", 1), ("broadcast", 0), ("send", 0)):
            if hasattr(dist, name):
                setattr(dist, name, _counting(name, at, counted))
        attention = TorchAttention(LatentSplit(parallel.world_size(), parallel.rank())) if split else TORCH
        engine = Engine(*load_pair(Path(target), Path(drafter)), device="cpu", attention=attention)
        engine.allocate(dataclasses.replace(BUCKET, max_num_seqs=3))
        batch, step = engine.bucket_state[2], engine.bucket_state[3]
        counted.clear()  # loading and allocating gathered nothing a round does
        with torch.inference_mode():
            step.run(batch, 3, greedy, CONTEXT + batch.block, width)
        torch.save(counted, Path(out) / f"rank{rank}.pt")
    finally:
        parallel.leave_stages()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory):
    # Every width divides 4 ways: one of 4 MLA and KDA heads a rank, 32 of the experts' 128 columns.
    return kimi_pair.make_kimi_pair(tmp_path_factory.mktemp("tp_pair"), vocab_size=320, moe_intermediate_size=128,
                                    slices=4)


@pytest.mark.parametrize("ranks, split, width, greedy", [(2, False, 8, True), (2, True, 8, False),
                                                         (4, True, 3, True), (4, False, 1, False)])
def test_the_plans_collective_bytes_are_what_reaches_torch_distributed(tp_pair, tmp_path, ranks, split, width,
                                                                        greedy):
    target, drafter = tp_pair
    mp.spawn(rank_round, args=(ranks, free_port(), str(target), str(drafter), split, width, greedy, str(tmp_path)),
             nprocs=ranks)
    planned = sizer_of(target, drafter, greedy, ranks, split).work(BUCKET, width).times(3).collectives
    for rank in range(ranks):
        sent = torch.load(tmp_path / f"rank{rank}.pt")
        gathered = sum(v for k, v in sent.items() if k.startswith("all_gather"))
        # gloo's reduce-scatter is an all-reduce of the same payload (parallel.reduce_scatter_dim1)
        assert planned.get("all_gather", 0) == gathered, (rank, planned, sent)
        assert planned.get("all_reduce", 0) + planned.get("reduce_scatter", 0) == sent.get("all_reduce", 0), rank
        assert sum(planned.values()) == sum(sent.values()), (rank, planned, sent)
    assert ("reduce_scatter" in planned) == split


@pytest.mark.parametrize("ranks, split, width, greedy", [(2, False, 8, True), (4, True, 3, False)])
def test_a_stages_hand_offs_and_collectives_are_what_reaches_torch_distributed(tp_pair, tmp_path, ranks, split,
                                                                               width, greedy):
    """Two pipeline stages of ranks / 2: each stage's planned round (counted on its own layers)
    hands on what its ranks send, takes back what the last stage broadcasts, and runs the
    collectives of its tensor-parallel group, to the byte."""
    target, drafter = tp_pair
    mp.spawn(rank_round, args=(ranks, free_port(), str(target), str(drafter), split, width, greedy, str(tmp_path), 2),
             nprocs=ranks)
    tp = ranks // 2
    for stage in range(2):
        planned = sizer_of(target, drafter, greedy, tp, split, (stage, 2)).work(BUCKET, width).times(3).collectives
        assert (planned.get("hand_off", 0) > 0) == (stage == 0) and planned["from_last_stage"] > 0
        for rank in range(stage * tp, (stage + 1) * tp):
            sent = torch.load(tmp_path / f"rank{rank}.pt")
            assert planned.get("hand_off", 0) == sent.get("send", 0), (rank, planned, sent)
            assert planned["from_last_stage"] == sent["broadcast"], (rank, planned, sent)
            gathered = sum(v for k, v in sent.items() if k.startswith("all_gather"))
            assert planned.get("all_gather", 0) == gathered, (rank, planned, sent)
            assert planned.get("all_reduce", 0) + planned.get("reduce_scatter", 0) == sent.get("all_reduce", 0)


@pytest.mark.parametrize("family", ["kimi", "qwen3"])
def test_the_stages_rounds_add_up_to_the_whole_round(pairs, family):
    """Each layer runs on one stage, the head and drafter on the last: two stages' FLOPs a round,
    component by component, are the whole model's."""
    target, drafter = pairs[family]
    for width, greedy in ((8, True), (3, False)):
        whole = sizer_of(target, drafter, greedy).work(BUCKET, width).flops
        parts = [sizer_of(target, drafter, greedy, at_stage=(s, 2)).work(BUCKET, width).flops for s in range(2)]
        assert all(parts) and set(parts[0]) | set(parts[1]) == set(whole)
        for component, flops in whole.items():
            assert parts[0].get(component, 0) + parts[1].get(component, 0) == pytest.approx(flops, rel=1e-12), component
