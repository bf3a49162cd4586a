"""Tensor-parallel process group helpers (SPMD, gpt-fast style).

Every rank runs the same program on the same inputs. Model layers ask this module for the
rank and world size; with no process group initialised the world size is 1 and every
collective is the identity, so the same model code runs single-process.

Under `planned(size)` (the memory and roofline plans, on the meta device) there is no group:
a collective returns what it would, in shape, and touches no other rank. Under `tallied()`
each collective adds what this rank hands it (its payload, in bytes) to a Counter by kind:
the plan counts a round's traffic from the engine's own calls (plan/work.py).

Pipeline stages (form_stages, model.pipeline_parallel_size): the ranks split into stages of
equal size, stage s holding global ranks s * tp .. s * tp + tp - 1 (one node a stage under
torchrun and srun, whose ranks count up node by node). Inside a stage the tensor-parallel
collectives above run over the stage's ranks: world_size() and rank() are the stage's. Between
stages, rank r of a stage hands its rows to rank r of the next (send_next / recv_prev), and the
last stage's results reach every stage by from_last_stage. Decisions the whole run must share
(any_rank, agreed, barrier) span every rank.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


_planned: int | None = None  # a world size models are built for without a group (sizing.py)
_tally: Counter | None = None  # collectives' payloads by kind while tallied() (plan/work.py)
_planned_stage = (0, 1)  # the stage planned() builds models for


@dataclass(frozen=True)
class _Stages:
    """This rank's place in the pipeline: its stage of `count`, the group of its stage's ranks
    (tensor parallelism) and the group of its peers, one rank a stage (hand-offs, results)."""

    count: int
    index: int
    size: int  # ranks a stage
    group: dist.ProcessGroup
    peers: dist.ProcessGroup


_stages: _Stages | None = None


def world_size() -> int:
    """Ranks in this rank's tensor-parallel group (its stage's, under pipeline stages)."""
    if _planned is not None:
        return _planned
    if _stages is not None:
        return _stages.size
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _group() -> dist.ProcessGroup | None:
    return _stages.group if _stages is not None else None


def global_rank() -> int:
    """This rank among every rank of the run (0 writes the outputs)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def form_stages(count: int) -> None:
    """Split the run's ranks into `count` pipeline stages of equal size (every rank calls this,
    in step: each group is made by all ranks). A count of 1 changes nothing."""
    global _stages
    if count == 1:
        return
    total = dist.get_world_size()
    if total % count:
        raise ValueError(f"{total} ranks do not split into {count} pipeline stages of equal size")
    size, me = total // count, dist.get_rank()
    groups = [dist.new_group(list(range(s * size, (s + 1) * size))) for s in range(count)]
    peers = [dist.new_group(list(range(r, total, size))) for r in range(size)]
    _stages = _Stages(count, me // size, size, groups[me // size], peers[me % size])


def leave_stages() -> None:
    """Forget the stages (their groups end with the process group: leave_group)."""
    global _stages
    _stages = None


def stage() -> tuple[int, int]:
    """(this rank's stage, stages): (0, 1) without pipeline stages."""
    if _planned is not None:
        return _planned_stage
    return (_stages.index, _stages.count) if _stages is not None else (0, 1)


def last_stage() -> bool:
    """This rank's stage holds the last layers: it has the logits, runs the drafter, decides."""
    index, count = stage()
    return index == count - 1


def send_next(x: torch.Tensor) -> None:
    """Hand `x` to this rank's peer on the next stage."""
    _add("hand_off", x)
    if _planned is None:
        dist.send(x.contiguous(), dist.get_rank() + _stages.size)


def recv_prev(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """What this rank's peer on the previous stage handed on (its shape known to both)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    if _planned is None:
        dist.recv(x, dist.get_rank() - _stages.size)
    return x


def from_last_stage(*tensors: torch.Tensor) -> None:
    """Every stage's copies of `tensors` take the last stage's values (in place; contiguous
    tensors of one shape on every stage). Nothing to do without stages."""
    count = stage()[1]
    if count == 1:
        return
    for t in tensors:
        _add("from_last_stage", t)
        if _planned is None:
            dist.broadcast(t, _peer(count - 1), group=_stages.peers)


def post_to_stages(*tensors: torch.Tensor) -> list:
    """The last stage: send copies of `tensors` to this rank's peer on every earlier stage, in
    order, without waiting for them to be received (pipeline lanes, engine/lanes.py). Returns
    what to wait on before the run goes on to anything else. They go over the peers' group, the
    hand-offs over the whole run's: under NCCL each group has its own communicator and stream, so
    a post waiting to be received never holds up a hand-off the other way."""
    works = []
    for t in tensors:
        _add("from_last_stage", t)
        if _planned is None:
            sent = t.contiguous().clone()
            works += [dist.isend(sent, _peer(s), group=_stages.peers) for s in range(stage()[1] - 1)]
    return works


def recv_from_last_stage(*tensors: torch.Tensor) -> None:
    """A stage before the last: `tensors` (contiguous) take, in place and in order, what this
    rank's peer on the last stage posted (post_to_stages)."""
    if _planned is None:
        for t in tensors:
            dist.recv(t, _peer(stage()[1] - 1), group=_stages.peers)


def _peer(index: int) -> int:
    """The global rank of this rank's peer (the same place in its stage) on stage `index`."""
    return index * _stages.size + dist.get_rank() % _stages.size


@contextmanager
def planned(size: int, at_stage: tuple[int, int] = (0, 1)) -> Iterator[None]:
    """Build and run models as rank 0 of `size` ranks would, without a process group, on stage
    `at_stage` (index, stages): for planning a job on the meta device (collectives give their
    results' shapes, nothing more)."""
    global _planned, _planned_stage
    previous, _planned = _planned, size
    previous_stage, _planned_stage = _planned_stage, at_stage
    try:
        yield
    finally:
        _planned, _planned_stage = previous, previous_stage


@contextmanager
def tallied() -> Iterator[Counter]:
    """Count the payload bytes this rank hands each kind of collective a model or round runs inside
    ("all_reduce", "all_gather", "reduce_scatter": the tensor it passes in)."""
    global _tally
    previous, _tally = _tally, Counter()
    try:
        yield _tally
    finally:
        _tally = previous


def tally() -> Counter | None:
    """The payloads counted so far inside tallied() (None outside)."""
    return _tally


def _add(kind: str, x: torch.Tensor) -> None:
    if _tally is not None:
        _tally[kind] += x.numel() * x.element_size()


def rank() -> int:
    """This rank in its tensor-parallel group (its stage's, under pipeline stages)."""
    if _planned is not None:
        return 0
    if _stages is not None:
        return dist.get_rank() % _stages.size
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place)."""
    if world_size() > 1:
        _add("all_reduce", x)
        if _planned is None:
            dist.all_reduce(x, group=_group())
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice along the last dim (vocab- or head-parallel outputs)."""
    n = world_size()
    if n == 1:
        return x
    _add("all_gather", x)
    parts = [torch.empty_like(x) for _ in range(n)]
    if _planned is None:
        dist.all_gather(parts, x.contiguous(), group=_group())
    return torch.cat(parts, dim=-1)


def all_gather_dim1(x: torch.Tensor) -> torch.Tensor:
    """[T, h, ...] on each rank -> [T, ranks * h, ...], ranks in order (query heads gathered for
    the latent split: rank r's heads are the model's r * h ..)."""
    n = world_size()
    if n == 1:
        return x
    _add("all_gather", x)
    parts = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # ranks' x, stacked
    if _planned is None:
        # all_gather_single is all_gather_into_tensor's newer name (torch 2.13 warns on the old one).
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(parts, x.contiguous(),
                                                                             group=_group())
    return parts.view(n, *x.shape).movedim(0, 1).flatten(1, 2)


def reduce_scatter_dim1(x: torch.Tensor) -> torch.Tensor:
    """[T, ranks * h, ...] partial sums on each rank -> [T, h, ...]: the sum over ranks of this
    rank's slice of dim 1 (the inverse of all_gather_dim1's layout)."""
    n = world_size()
    if n == 1:
        return x
    _add("reduce_scatter", x)
    chunks = x.unflatten(1, (n, -1)).movedim(1, 0).contiguous()  # [ranks, T, h, ...]
    if _planned is not None:
        return chunks[0]
    if dist.get_backend(_group()) != "nccl":
        # gloo's reduce-scatter is an all-reduce and a copy inside the op (a capture cannot replay
        # it: tests/emulated_graphs.py): the all-reduce itself, this rank's chunk kept.
        dist.all_reduce(chunks, group=_group())
        return chunks[rank()]
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    # reduce_scatter_single is reduce_scatter_tensor's newer name (torch 2.13 warns on the old one).
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, chunks.flatten(0, 1),
                                                                                 group=_group())
    return out


def _gathered_candidates(values: torch.Tensor, ids: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
    """Every rank's candidates [..., c] (values, global vocabulary ids, extras) -> [..., ranks * c,
    2 + len(extra)], ranks in vocabulary order. One gather; ids are exact in the values' float
    dtype (float32 up to 2^24)."""
    columns = [values, ids.to(values.dtype), *(e.to(values.dtype) for e in extra)]
    local = torch.stack(columns, -1)
    return all_gather_last(local.flatten(-2)).unflatten(-1, (-1, len(columns)))


def sharded_topk(local: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values along the last dim of logits split across ranks (rank r holds the
    vocabulary slice r * V_local ..): (values, global ids), sorted descending. Each rank sends
    its own top k, not its slice of the row."""
    values, ids = local.topk(min(k, local.shape[-1]), dim=-1)
    if world_size() == 1:
        return values, ids
    merged = _gathered_candidates(values, ids + rank() * local.shape[-1])
    values, at = merged[..., 0].topk(min(k, merged.shape[-2]), dim=-1)
    return values, merged[..., 1].gather(-1, at).long()


def sharded_argmax(local: torch.Tensor) -> torch.Tensor:
    """Argmax over the whole split last dim, on every rank (a tie goes to the lowest id, as
    argmax over the whole row)."""
    return _merged_top1(local, None)[0]


def sharded_top1(local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sharded_argmax, whether every value of the row is finite on every rank): one gather of
    3 values a row."""
    return _merged_top1(local, torch.isfinite(local).all(-1))


def _merged_top1(local: torch.Tensor, flag: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    best, ids = local.max(-1)
    if world_size() == 1:
        return ids, flag
    merged = _gathered_candidates(best[..., None], (ids + rank() * local.shape[-1])[..., None],
                                  *([] if flag is None else [flag[..., None]]))   # [..., ranks, 2 | 3]
    at = merged[..., 0].max(-1, keepdim=True).indices  # the first rank holding the maximum
    ids = merged[..., 1].gather(-1, at)[..., 0].long()
    return ids, None if flag is None else merged[..., 2].min(-1).values > 0


def sharded_prob(local: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The probability softmax(logits) gives token `ids` [...] (global vocabulary ids) where the
    logits' last dim is split across ranks: one gather of 2 values a row (each rank's log-sum-exp
    and its logit of the token, -inf where another rank holds it). In float32 at least."""
    wide = local.to(torch.promote_types(local.dtype, torch.float32))
    size = local.shape[-1]
    at = ids - rank() * size
    mine = (at >= 0) & (at < size)
    chosen = wide.gather(-1, at.clamp(0, size - 1)[..., None])[..., 0].masked_fill(~mine, float("-inf"))
    lse = torch.logsumexp(wide, -1)
    if world_size() == 1:
        return (chosen - lse).exp()
    merged = all_gather_last(torch.stack([lse, chosen], -1).flatten(-2)).unflatten(-1, (-1, 2))  # [..., ranks, 2]
    return (merged[..., 1].max(-1).values - torch.logsumexp(merged[..., 0], -1)).exp()


def run_size() -> int:
    """Every rank of the run, all stages (1 while planning)."""
    if _planned is not None:
        return 1
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def any_rank(flag: bool) -> bool:
    """True on every rank of the run if it is true on any (so all ranks take the same branch)."""
    if run_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def agreed(value: int) -> int:
    """Rank 0's value on every rank of the run (a decision each rank could make differently: one
    timed on its own clock)."""
    if run_size() == 1:
        return value
    t = torch.tensor([value], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.broadcast(t, 0)
    return int(t.item())


def agreed_tensor(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's values of `t` on every rank of the run, in place (as agreed, for a tensor on the
    group's device)."""
    if run_size() > 1:
        dist.broadcast(t, 0)
    return t


def barrier() -> None:
    if run_size() > 1:
        dist.barrier()


def local_gpu(env: dict[str, str], gpus: int) -> int:
    """The GPU of this rank on its node: torchrun's LOCAL_RANK, srun's SLURM_LOCALID, else the
    global rank modulo the node's GPUs (one GPU a rank)."""
    local = env.get("LOCAL_RANK") or env.get("SLURM_LOCALID")
    return int(local) if local is not None else int(env.get("RANK", "0")) % max(gpus, 1)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list ("gpu[07-08,11],login2" -> "gpu07"): Slurm's own order,
    the one `scontrol show hostnames` prints, so every rank picks the same one."""
    head, depth = "", 0
    for ch in nodelist:
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        head += ch
    while "[" in head:  # a bracket: its first range's first number, zero padding kept
        prefix, rest = head.split("[", 1)
        inside, suffix = rest.split("]", 1)
        head = prefix + inside.split(",")[0].split("-")[0] + suffix
    return head


def slurm_rendezvous(env: dict[str, str]) -> dict[str, str]:
    """The variables env:// needs for ranks srun started (one task a rank, SLURM_STEP_NUM_TASKS
    of them): the allocation's first host as the address, and a port from the job id, so the
    tasks of one job meet without a hand-set MASTER_ADDR and two jobs on one node do not meet.
    {} for a process srun did not start (a batch script, torchrun's workers, a login shell)."""
    if "SLURM_STEP_NUM_TASKS" not in env or "WORLD_SIZE" in env:
        return {}
    job = int(env.get("SLURM_JOB_ID", "0"))
    return {"WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"], "RANK": env.get("SLURM_PROCID", "0"),
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST")
                                                                 or env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + job % 10000)}  # below Linux's ephemeral range


def init_from_env(backend: str | None = None) -> bool:
    """Join the process group described by torchrun's or srun's variables; False if there is
    none. On CUDA each rank takes its own GPU before the group starts (NCCL binds to the current
    one)."""
    if dist.is_initialized():
        return True
    os.environ.update(slurm_rendezvous(dict(os.environ)))
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(local_gpu(dict(os.environ), torch.cuda.device_count()))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    return True


def lost_rank(error: BaseException) -> bool:
    """Whether `error` is a collective or hand-off finding a rank of the run gone (NCCL's
    DistError; any error of gloo's transport: a peer that closed or reset its connection, a read
    that timed out): the run's failure, never one request's."""
    return isinstance(error, dist.DistError) or "gloo/transport/" in str(error) or "by peer" in str(error)


def leave_group() -> None:
    """Shut this rank's process group down while the interpreter is whole (NCCL's communicators
    freed in order; a rank then ends by cli.end_rank, not the interpreter's teardown). A group a
    rank was lost from is not left this way: shutting it down could wait on the rank that is gone."""
    if dist.is_initialized():
        dist.destroy_process_group()


def describe_rank() -> str:
    """"rank R of N on HOST" ("rank R of N (stage S of P) on HOST" under pipeline stages): how a
    rank's messages name it in a log every rank writes to."""
    index, count = stage()
    where = f" (stage {index} of {count})" if count > 1 else ""
    return f"rank {global_rank()} of {run_size()}{where} on {socket.gethostname()}"
