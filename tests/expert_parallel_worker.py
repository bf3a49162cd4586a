"""The engine in data-parallel groups with the routed experts sharded over every rank (gloo, float64):
the work each rank does, importable by spawned processes (kept free of transformers and dflash)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_batch import parallel
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.pair import attach_drafter
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.models import loader
from dflash_batch.models.layers.expert_parallel import Placement, place
from dflash_batch.plan.buckets import Bucket


def placement(kind: str, experts: int, ranks: int) -> Placement | None:
    """"default": the balanced default; "moved": every expert on another rank than the default's;
    "redundant": one replica slot a rank, the replicas for the highest expert ids (their slots
    numbered unlike their experts)."""
    if kind == "redundant":
        skewed = place(list(range(1, experts + 1)), ranks, 1)
        return Placement(experts, ranks, 1, {layer: skewed for layer in range(64)})
    if kind == "moved":
        default = place([1] * experts, ranks)
        return Placement(experts, ranks, 0, {layer: default[1:] + default[:1] for layer in range(64)})
    return Placement(experts, ranks, 0, {})


def generate(target_dir: str, drafter_dir: str, prompts: list[list[int]], sampling: dict,
             max_new: list[int], speculation: bool | str = True, expert_placement: Placement | None = None,
             read: list[str] | None = None, seeds: list[int] | None = None, poison: bool = False,
             device: str = "cpu") -> tuple[list[dict], Engine]:
    """Each prompt decoded (seed `seeds[i]`, else 1000 + its index; `max_new[i]` tokens): tokens,
    accepted drafts a round, error type. `read` collects the checkpoint tensors the target's load
    read; `poison`: the first token of the fifth forward of rows into the first MoE layer is NaN
    (a row that goes bad where its latent travels to every group). On "cuda": float32 (the Triton
    MoE's widest), eagerly."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    seeds = seeds or [1000 + i for i in range(len(prompts))]
    opened = loader.safe_open

    class Logged:  # safe_open, naming every tensor read in `read`
        def __init__(self, *args, **kwargs):
            self.file = opened(*args, **kwargs)

        def __enter__(self):
            self.handle = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_slice(self, name: str):
            read.append(name)
            return self.handle.get_slice(name)

    if read is not None:
        loader.safe_open = Logged
    try:
        target = loader.load_model(target_dir, dtype, device, expert_placement)
    finally:
        loader.safe_open = opened
    if poison:
        moe = next(iter(target.moe_layers().values()))
        calls, forward = [0], moe.forward

        def poisoned(x: torch.Tensor) -> torch.Tensor:
            calls[0] += x.shape[0] > 0
            return forward(x.index_fill(0, torch.tensor([0], device=x.device), float("nan")) if calls[0] == 5 else x)

        moe.forward = poisoned
    forwarded = [0]  # tokens through the target's forwards
    layers = target.run_layers
    target.run_layers = lambda carry, meta: (forwarded.__setitem__(0, forwarded[0] + carry[0].shape[0]),
                                             layers(carry, meta))[1]
    drafter = loader.load_model(drafter_dir, dtype, device)
    attach_drafter(target, drafter)
    reqs = [Request((str(i), 0), p, SamplingParams(seed=seed, max_new_tokens=n, **sampling))
            for i, (p, n, seed) in enumerate(zip(prompts, max_new, seeds))]
    engine = Engine(target, drafter, dtype=dtype, device=device)
    done = {c.key: c for c in engine.generate(reqs, Bucket(0, "0-1024", 1024, 16, speculation, None))}
    engine.forwarded = forwarded
    return [dict(tokens=done[r.key].token_ids, per_round=done[r.key].spec and done[r.key].spec.per_round,
                 error=done[r.key].error_type) for r in reqs], engine


def run(rank: int, world: int, port: int, groups: int, target_dir: str, drafter_dir: str,
        prompts: list[list[int]], max_new: list[int], runs: dict[str, dict], kind: str, out_dir: str,
        speculation: bool | str, poison: bool = False, device: str = "cpu") -> None:
    """Group g decodes prompts g, g + groups, ..; then serves the other groups until all are done.
    `poison`: group 0's rows as generate's `poison` makes them; `device` cuda: a GPU a rank, NCCL."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)  # before the group: NCCL binds to the current GPU
    # A rank left waiting (a group that skipped a forward) fails its collective instead of hanging.
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    parallel.form_data_parallel(groups)
    try:
        group = parallel.data_parallel()[0]
        mine = list(range(group, len(prompts), groups))
        experts = loader.load_config(target_dir).get("text_config", {}).get("num_experts", 8)
        results, read = {}, []
        for name, sampling in runs.items():
            rows, engine = generate(target_dir, drafter_dir, [prompts[i] for i in mine], sampling,
                                    [max_new[i] for i in mine], speculation, placement(kind, experts, world),
                                    read if not read else None, [1000 + i for i in mine], poison and group == 0,
                                    device)
            engine.target.serve_experts()
            counts = [moe.routed_tokens.tolist() for moe in engine.target.moe_layers().values()]
            results[name] = dict(rows=dict(zip(mine, rows)), counts=counts, forwarded=engine.forwarded[0])
        results.update(read=read, idle=parallel.idle_forwards, group=group)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel.leave_data_parallel()
        dist.destroy_process_group()
