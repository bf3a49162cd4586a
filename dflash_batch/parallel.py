"""Tensor-parallel process group helpers (SPMD, gpt-fast style).

Every rank runs the same program on the same inputs. Model layers ask this module for the
rank and world size; with no process group initialised the world size is 1 and every
collective is the identity, so the same model code runs single-process.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place)."""
    if world_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice along the last dim (vocab- or head-parallel outputs)."""
    n = world_size()
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any (so all ranks take the same branch)."""
    if world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def init_from_env(backend: str | None = None) -> bool:
    """Join the process group described by torchrun/srun variables; False if there is none."""
    if dist.is_initialized():
        return True
    env_world = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS")
    if env_world is None or int(env_world) == 1:
        return False
    os.environ.setdefault("RANK", os.environ.get("SLURM_PROCID", "0"))
    os.environ.setdefault("WORLD_SIZE", env_world)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    return True
