"""The engine under tensor parallelism: the work each rank does, importable by spawned processes.

Kept free of transformers and dflash imports so the processes torch.multiprocessing spawns
start fast; the parent makes the checkpoints.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_batch import parallel
from dflash_batch.backends.latent_split import LatentSplit
from dflash_batch.backends.torch_attention import TORCH, TorchAttention
from dflash_batch.engine import choice
from dflash_batch.engine import engine as engine_module
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.graphs import RoundGraphs
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.engine.pair import attach_drafter
from dflash_batch.models.loader import load_model
from dflash_batch.plan.buckets import Bucket
from tests import fake_flashinfer
from tests.emulated_graphs import EmulatedGraphs


def generate(target_dir: str, drafter_dir: str, prompts: list[list[int]], sampling: dict,
             graphs: bool = False, device: str = "cpu", speculation: bool | str = True,
             latent_split: bool = False, backend: str = "torch", share_prompts: bool = True,
             micro_batches: int = 1) -> list[dict]:
    """Speculative decoding of every prompt (seed 1000 + index): tokens, accepted drafts per round and
    logprobs. `latent_split`: the ranks split the MLA latent caches by token (backends/latent_split.py).
    `backend` flashinfer: on the CPU, its MLA wrapper emulated (tests/fake_flashinfer.py).
    The target taps the drafter's layers on the drafter's aux_hidden_stream, as build_engine does.
    `graphs`: rounds go through the engine's graph path, captured and replayed as CUDA graphs on a
    GPU, emulated on the CPU. `share_prompts`: the engine's (shared heads, forked samples);
    `micro_batches`: the engine's (lanes, or groups of a captured round, under pipeline stages)."""
    # float64: the ranks sum partial products in another order than one process; in float32
    # that could round a near-tie apart.
    target, drafter = load_model(target_dir, torch.float64, device), load_model(drafter_dir, torch.float64, device)
    attach_drafter(target, drafter)
    reqs = [Request((str(i), 0), p, SamplingParams(seed=1000 + i, **sampling)) for i, p in enumerate(prompts)]
    bucket = Bucket(0, "0-1024", 1024, 16, speculation, None)
    engine_module.RoundGraphs = EmulatedGraphs if graphs and device == "cpu" else RoundGraphs
    graph_args = dict(cuda_graphs=True, capture_sizes=[1, 2, 4, 16]) if graphs else {}
    split = LatentSplit(parallel.world_size(), parallel.rank()) if latent_split else None
    if backend == "flashinfer":
        if device == "cpu":
            sys.modules["flashinfer"] = fake_flashinfer.module()
        from dflash_batch.backends.flashinfer_attention import FlashInferAttention

        attention = FlashInferAttention(device, split=split)
    else:
        attention = TorchAttention(split) if split else TORCH
    engine = Engine(target, drafter, dtype=torch.float64, device=device, attention=attention,
                    share_prompts=share_prompts, micro_batches=micro_batches, **graph_args)
    done = {c.key: c for c in engine.generate(reqs, bucket)}
    # flashinfer: whether rounds ran on wrappers planned as a captured graph's (fixed rows)
    captured = backend == "flashinfer" and any(key[1] is not None for key in attention.wrappers)
    return [dict(tokens=done[r.key].token_ids, per_round=done[r.key].spec and done[r.key].spec.per_round,
                 top_ids=done[r.key].logprobs and done[r.key].logprobs.top_ids,
                 logprobs=logprob_values(done[r.key].logprobs), captured=captured,
                 cached=done[r.key].cached_tokens, held=(target.held.start, target.held.stop)) for r in reqs]


def logprob_values(logprobs) -> list[list[float]]:
    """Each token's logprob and its top ones (empty without logprobs), compared within a tolerance."""
    return [] if logprobs is None else [[t, *top] for t, top in zip(logprobs.token, logprobs.top)]


def run(rank: int, world_size: int, port: int, target_dir: str, drafter_dir: str,
        prompts: list[list[int]], runs: dict[str, dict], out_dir: str, graphs: bool = False,
        device: str = "cpu", costs_by_rank: list[list[float]] | None = None, group_rows: int | None = None,
        latent_split: bool = False, backend: str = "torch", stages: int = 1, speculation: bool = True,
        micro_batches: int = 1) -> None:
    """`stages`: the ranks split into that many pipeline stages (parallel.form_stages).
    `costs_by_rank`: an auto bucket (speculation: auto) whose round costs each rank reads from
    here (seconds by verify width) instead of timing them; `group_rows`: verify rows each rank
    gathers and samples at once (engine/choice.py), default as many as its vocabulary allows."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # two ranks share a small CPU
    if device == "cuda":
        torch.cuda.set_device(rank)  # before the group: NCCL binds to the current GPU
    # Ranks that diverge (different rounds, different shapes) fail their next collective; the
    # timeout turns a rank left waiting into an error instead of a hung test.
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    parallel.form_stages(stages)
    try:
        if group_rows is not None:
            choice.group_rows = lambda vocab: group_rows
        if costs_by_rank is not None:
            Engine._time_round = lambda self, *args: costs_by_rank[rank][args[-1] - 1]
        speculation = speculation if costs_by_rank is None else "auto"
        verifies = record_verifies()
        results = {name: generate(target_dir, drafter_dir, prompts, s, graphs, device, speculation, latent_split,
                                  backend, micro_batches=micro_batches) for name, s in runs.items()}
        results["verifies"] = verifies
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel.leave_stages()
        dist.destroy_process_group()


def record_verifies() -> list:
    """What this process's verify forwards were, in order: (the batch row their first sequence
    sits in, the groups of sequences models/stages.py sends them through the stages in); and
    "decided" where the rank took the last stage's decision of a lane's round (engine/lanes.py);
    ("prefill", groups) for a prefill step. Appended to the list returned."""
    from dflash_batch.models import stages

    events, split, take = [], stages.micro_batches, parallel.recv_from_last_stage

    def recorded(meta):
        parts = split(meta)
        if meta.name in ("verify", "prefill"):
            events.append((meta.first_seq if meta.name == "verify" else "prefill", len(parts)))
        return parts

    def took(*tensors):
        if len(tensors) > 1:  # a decision (a lane's drafts come alone)
            events.append("decided")
        take(*tensors)

    stages.micro_batches, parallel.recv_from_last_stage = recorded, took
    return events


def assert_stages_took_turns(verifies: list, first_stage: bool, micro_batches: int, stages: int,
                             graphs: bool) -> None:
    """Rounds went through the stages as `micro_batches` asks: captured rounds whole, their
    sequences in that many groups (`graphs`: some were captured); the others in that many lanes
    (engine/lanes.py), the first stage verifying lane m + 1's round before it takes lane m's
    decision; a prefill step of several prompts in that many groups."""
    prefills = [groups for first, groups in (v for v in verifies if v != "decided") if first == "prefill"]
    assert max(prefills) == (micro_batches if stages > 1 else 1), verifies  # a step of several prompts
    runs = [v for v in verifies if v != "decided" and v[0] != "prefill"]
    if stages == 1 or micro_batches == 1:
        assert set(runs) == {(0, 1)}, runs
        return
    grouped, laned = [v for v in runs if v[1] > 1], [v for v in runs if v[1] == 1]
    assert max((g for _, g in grouped), default=None) == (micro_batches if graphs else None), runs
    assert {first for first, _ in grouped} <= {0} and len({first for first, _ in laned}) == micro_batches, runs
    if first_stage:
        lanes = [v for v in verifies if v == "decided" or v[0] != "prefill"]
        assert any("decided" not in (a, b) and a[0] != b[0] for a, b in zip(lanes, lanes[1:])), verifies


def assert_tp2_equals_tp1(target_dir: str, drafter_dir: str, prompts: list[list[int]], runs: dict[str, dict],
                          out_dir: str, port: int, graphs: bool = False, device: str = "cpu",
                          group_rows: int | None = None, ranks: int = 2, latent_split: bool = False,
                          backend: str = "torch", logprob_atol: float = 1e-9, cached: list[int] | None = None,
                          stages: int = 1, held: list[range] | None = None, speculation: bool = True,
                          micro_batches: int = 1) -> None:
    """Decode in this process on the torch backend, each prompt prefilled by itself (no shared
    heads), then on `ranks` ranks (gloo on the CPU, NCCL on GPUs; `graphs`: through the graph
    path; `group_rows`: the ranks gather and sample that many verify rows at a time;
    `latent_split`: they split the MLA latents by token; on `backend`; prompts that share a head
    share it): every rank must give the same tokens and accepted drafts per round, for every
    sampling setting in `runs`, and logprobs within `logprob_atol`; `cached`: the prompt tokens
    each prompt took from a shared head on the ranks; `stages`: the ranks form that many pipeline
    stages, each a tensor-parallel group of ranks / stages, stage s holding the layers `held[s]`;
    `speculation` False: target-only rounds, in both; `micro_batches`: the ranks' rounds go
    through the stages in that many lanes, or (captured) in that many groups of sequences."""
    import torch.multiprocessing as mp

    args = (target_dir, drafter_dir, prompts, runs)
    expected = {name: generate(*args[:3], s, device=device, speculation=speculation, share_prompts=False)
                for name, s in runs.items()}
    assert not speculation or any(n for r in expected["greedy"] for n in r["per_round"]), "no draft accepted"
    vocab = json.loads((Path(drafter_dir) / "config.json").read_text())["vocab_size"]  # the pair's
    assert_every_slice_decoded([t for r in expected["greedy"] for t in r["tokens"]], vocab, ranks // stages)
    mp.spawn(run, args=(ranks, port, *args, out_dir, graphs, device, None, group_rows, latent_split, backend,
                        stages, speculation, micro_batches), nprocs=ranks)
    for rank in range(ranks):
        got = torch.load(Path(out_dir) / f"rank{rank}.pt", map_location="cpu")
        for name in runs:
            for g, want in zip(got[name], expected[name]):
                exact = ("tokens", "per_round", "top_ids")
                assert [g[k] for k in exact] == [want[k] for k in exact], f"rank {rank}, {name}"
                assert g["captured"] == (graphs and backend == "flashinfer")
                assert len(g["logprobs"]) == len(want["logprobs"])
                for a, b in zip(g["logprobs"], want["logprobs"]):
                    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=logprob_atol)
            assert cached is None or [g["cached"] for g in got[name]] == cached, f"rank {rank}, {name}"
            assert held is None or range(*got[name][0]["held"]) == held[rank // (ranks // stages)], f"rank {rank}"
        assert_stages_took_turns(got["verifies"], rank < ranks // stages, micro_batches, stages, graphs)


def assert_auto_ranks_agree(target_dir: str, drafter_dir: str, prompts: list[list[int]], out_dir: str,
                            port: int, costs_by_rank: list[list[float]], latent_split: bool = False,
                            stages: int = 1, micro_batches: int = 1, max_new_tokens: int = 24) -> None:
    """An auto bucket on two gloo ranks whose round costs disagree: both ranks verify the drafts
    rank 0 plans (the same accepted drafts every round) and decode what one process decodes
    (`latent_split`: the ranks split the MLA latents; `stages` 2: they are two pipeline stages,
    in `micro_batches` lanes)."""
    import torch.multiprocessing as mp

    expected = generate(target_dir, drafter_dir, prompts, {"max_new_tokens": max_new_tokens})
    mp.spawn(run, args=(2, port, target_dir, drafter_dir, prompts, {"greedy": {"max_new_tokens": max_new_tokens}}, out_dir,
                        False, "cpu", costs_by_rank, None, latent_split, "torch", stages, True, micro_batches),
             nprocs=2)
    got = [[{k: v for k, v in r.items() if k != "held"} for r in torch.load(Path(out_dir) / f"rank{rank}.pt")["greedy"]]
           for rank in range(2)]  # what each rank's stage holds aside
    assert got[0] == got[1], "the ranks verified different drafts"
    assert any(n for r in got[0] for n in r["per_round"]), "rank 1's plan (verify none) was followed"
    assert [r["tokens"] for r in got[0]] == [r["tokens"] for r in expected]


def assert_every_slice_decoded(tokens: list[int], vocab: int, ranks: int) -> None:
    """Greedy decoding chose tokens from every rank's vocabulary slice (rank r holds ids
    r * vocab / ranks ..): otherwise a rank whose local ids were taken for global ones (in
    parallel.sharded_*) could leave every compared token and accepted draft as they were."""
    local = vocab // ranks
    missing = sorted(set(range(ranks)) - {t // local for t in tokens})
    assert not missing, f"no greedy token from the vocabulary slice of rank(s) {missing}: a test model for TP " \
                        "needs likely tokens in every slice (testing/kimi_pair.py's slices)"
