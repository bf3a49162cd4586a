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

Data-parallel groups (form_data_parallel, model.data_parallel_size): the ranks split into groups
of tensor_parallel_size consecutive ranks (one node's GPUs), each a run of its own: its own rows,
caches and drafter, its tensor-parallel collectives and its decisions (any_rank, agreed,
barrier, run_rank) over its own ranks only. The one thing that joins them is the routed experts
sharded over every rank (model.expert_parallel): each MoE layer sends this group's latent rows to
rank r of every group (dispatch) and takes back their partial sums for its rows (combine), padded
to the most rows any group runs in that forward. So every group runs every forward together, in
lockstep: each target forward begins with expert_step, and a group with no rows left serves the
others' forwards (expert_idle) until every group is done; a group that skipped one would leave
every other rank waiting in its next collective.
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
_planned_groups = 1  # the data-parallel groups planned() builds models for


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


@dataclass(frozen=True)
class _DataGroups:
    """This rank's data-parallel group, `index` of `count`: `group` its `size` ranks (tensor
    parallelism and the group's decisions), `peers` rank r of every group (dispatch, combine),
    `first` the global rank of its rank 0."""

    count: int
    index: int
    size: int
    first: int
    group: dist.ProcessGroup
    peers: dist.ProcessGroup


_data: _DataGroups | None = None
_work_fraction = 1.0  # the share of the work running now that is this rank's (work_share)
_step_rows = 0  # the rows every group's dispatch carries in the current forward (expert_step)
idle_forwards = 0  # forwards this rank served for other groups after its own rows were done


def world_size() -> int:
    """Ranks in this rank's tensor-parallel group (its stage's, under pipeline stages)."""
    if _planned is not None:
        return _planned
    if _stages is not None:
        return _stages.size
    if _data is not None:
        return _data.size
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _group() -> dist.ProcessGroup | None:
    """The tensor-parallel group (None: every rank of the process group)."""
    if _stages is not None:
        return _stages.group
    return _data.group if _data is not None else None


def run_rank() -> int:
    """This rank among every rank of its run, all stages (0 writes the outputs): its data-parallel
    group's, under data-parallel groups."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank() - (_data.first if _data is not None else 0)


def form_data_parallel(count: int) -> None:
    """Split the run's ranks into `count` data-parallel groups of equal size, consecutive ranks
    a group (every rank calls this, in step). A count of 1 changes nothing."""
    global _data
    if count == 1:
        return
    if _stages is not None:
        raise ValueError("data-parallel groups and pipeline stages do not combine")
    size, group, peers = _split_ranks(count, "data-parallel groups")
    index = dist.get_rank() // size
    _data = _DataGroups(count, index, size, index * size, group, peers)


def _split_ranks(count: int, what: str) -> tuple[int, dist.ProcessGroup, dist.ProcessGroup]:
    """The run's ranks as `count` blocks of consecutive ranks: (ranks a block, this rank's block's
    group, the group of rank r of every block, r this rank's place in its block). Every rank makes
    every group, in step."""
    total = dist.get_world_size()
    if total % count:
        raise ValueError(f"{total} ranks do not split into {count} {what} of equal size")
    size, me = total // count, dist.get_rank()
    blocks = [dist.new_group(list(range(b * size, (b + 1) * size))) for b in range(count)]
    peers = [dist.new_group(list(range(r, total, size))) for r in range(size)]
    return size, blocks[me // size], peers[me % size]


def leave_data_parallel() -> None:
    """Forget the data-parallel groups (their process groups end with leave_group)."""
    global _data
    _data = None


def data_parallel() -> tuple[int, int]:
    """(this rank's data-parallel group, groups): (0, 1) without them; group 0 of those planned."""
    if _planned is not None:
        return (0, _planned_groups)
    return (_data.index, _data.count) if _data is not None else (0, 1)


def form_stages(count: int) -> None:
    """Split the run's ranks into `count` pipeline stages of equal size (every rank calls this,
    in step: each group is made by all ranks). A count of 1 changes nothing."""
    global _stages
    if count == 1:
        return
    size, group, peers = _split_ranks(count, "pipeline stages")
    _stages = _Stages(count, dist.get_rank() // size, size, group, peers)


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
def planned(size: int, at_stage: tuple[int, int] = (0, 1), groups: int = 1) -> Iterator[None]:
    """Build and run models as rank 0 of `size` ranks would, without a process group, on stage
    `at_stage` (index, stages), in data-parallel group 0 of `groups`: for planning a job on the meta
    device (collectives give their results' shapes, nothing more; every group is taken to run as
    many rows as group 0)."""
    global _planned, _planned_stage, _planned_groups
    previous, _planned = _planned, size
    previous_stage, _planned_stage = _planned_stage, at_stage
    previous_groups, _planned_groups = _planned_groups, groups
    try:
        yield
    finally:
        _planned, _planned_stage, _planned_groups = previous, previous_stage, previous_groups


@contextmanager
def work_share(fraction: float) -> Iterator[None]:
    """While planning: the work run inside is what all ranks do together, a rank's share of it
    `fraction` (whole experts serving every group's routes, each rank its 1/ranks on average): the
    plan counts that share (plan/work.py)."""
    global _work_fraction
    previous, _work_fraction = _work_fraction, fraction
    try:
        yield
    finally:
        _work_fraction = previous


def work_fraction() -> float:
    """The share of the work now running that the plan counts for this rank (work_share)."""
    return _work_fraction


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


def _add(kind: str, x: torch.Tensor, share: float = 1) -> None:
    """Tally `share` of x's bytes as what this rank hands a collective of `kind`."""
    if _tally is not None:
        _tally[kind] += x.numel() * x.element_size() * share


def rank() -> int:
    """This rank in its tensor-parallel group (its stage's, under pipeline stages)."""
    if _planned is not None:
        return 0
    if _stages is not None:
        return dist.get_rank() % _stages.size
    if _data is not None:
        return dist.get_rank() % _data.size
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


def _gather_single(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """out [n, *x.shape] = every rank's x, in the group's rank order (one all-gather into a tensor)."""
    # all_gather_single is all_gather_into_tensor's newer name (torch 2.13 warns on the old one).
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out.flatten(0, 1), x.contiguous(),
                                                                             group=group)


def _reduce_scatter_first(x: torch.Tensor, index: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """x [n, ...] partial sums on each of the group's n ranks -> the sum of x[index], this rank's
    (`index`: its place in the group)."""
    if dist.get_backend(group) != "nccl":
        # gloo's reduce-scatter is an all-reduce and a copy inside the op (a capture cannot replay
        # it: tests/emulated_graphs.py): the all-reduce itself, this rank's chunk kept.
        dist.all_reduce(x, group=group)
        return x[index]
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x.contiguous(), group=group)
    return out


def all_gather_dim1(x: torch.Tensor) -> torch.Tensor:
    """[T, h, ...] on each rank -> [T, ranks * h, ...], ranks in order (query heads gathered for
    the latent split: rank r's heads are the model's r * h ..)."""
    n = world_size()
    if n == 1:
        return x
    _add("all_gather", x)
    parts = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)  # ranks' x, stacked
    if _planned is None:
        _gather_single(parts, x, _group())
    return parts.movedim(0, 1).flatten(1, 2)


def reduce_scatter_dim1(x: torch.Tensor) -> torch.Tensor:
    """[T, ranks * h, ...] partial sums on each rank -> [T, h, ...]: the sum over ranks of this
    rank's slice of dim 1 (the inverse of all_gather_dim1's layout)."""
    n = world_size()
    if n == 1:
        return x
    _add("reduce_scatter", x)
    chunks = x.unflatten(1, (n, -1)).movedim(1, 0).contiguous()  # [ranks, T, h, ...]
    return chunks[0] if _planned is not None else _reduce_scatter_first(chunks, rank(), _group())


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
    """Every rank of the run, all stages (1 while planning): its data-parallel group's, under
    data-parallel groups."""
    if _planned is not None:
        return 1
    if _data is not None:
        return _data.size
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _run_group() -> tuple[dist.ProcessGroup | None, int]:
    """(the group the run's decisions span, the global rank of its rank 0)."""
    return (_data.group, _data.first) if _data is not None else (None, 0)


def _flags(*values: int) -> torch.Tensor:
    return torch.tensor(values, device="cuda" if dist.get_backend() == "nccl" else "cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank of the run if it is true on any (so all ranks take the same branch)."""
    if run_size() == 1:
        return flag
    t = _flags(int(flag))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_run_group()[0])
    return bool(t.item())


def agreed(value: int) -> int:
    """Rank 0's value on every rank of the run (a decision each rank could make differently: one
    timed on its own clock)."""
    if run_size() == 1:
        return value
    t = _flags(value)
    group, first = _run_group()
    dist.broadcast(t, first, group=group)
    return int(t.item())


def agreed_tensor(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's values of `t` on every rank of the run, in place (as agreed, for a tensor on the
    group's device)."""
    if run_size() > 1:
        group, first = _run_group()
        dist.broadcast(t, first, group=group)
    return t


def barrier() -> None:
    if run_size() > 1:
        dist.barrier(group=_run_group()[0])


def any_group(flag: bool) -> bool:
    """True on every rank of every data-parallel group if it is true on any."""
    if _data is None:
        return any_rank(flag)
    t = _flags(int(flag))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# -- routed experts across data-parallel groups ---------------------------------------------------

def expert_rank() -> tuple[int, int]:
    """(this rank among the ranks the routed experts are sharded over, those ranks): every rank
    of every data-parallel group, group by group."""
    group, groups = data_parallel()
    return group * world_size() + rank(), groups * world_size()


def expert_step(rows: int) -> int:
    """Begin a target forward of `rows` tokens (every rank of every group, before each): the most
    rows any group's forward carries, which each MoE layer's dispatch is padded to. Without
    data-parallel groups, `rows`."""
    global _step_rows
    _step_rows = rows
    if _data is not None and _planned is None:
        t = _flags(rows, 1)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        _step_rows = int(t[0].item())
    return _step_rows


def expert_idle() -> int | None:
    """A group with no rows left: None once every group is done (every rank then goes on), else
    the rows of the forward the others are beginning, which this rank serves with none of its own."""
    global _step_rows, idle_forwards
    if _data is None or _planned is not None:
        return None
    t = _flags(0, 0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if not t[1].item():
        return None
    _step_rows = int(t[0].item())
    idle_forwards += 1
    return _step_rows


def dispatch(x: torch.Tensor) -> torch.Tensor:
    """This group's rows [T, ...] (the same on each of its ranks) -> every group's, [groups * P, ...]
    group by group, P the step's rows rounded up to a multiple of the group's ranks. Each rank
    sends its 1/ranks share of the rows to its peers in the other groups (one copy per remote
    node, over the NIC), then the group's ranks gather the shares (NVLink). Planned: every group's
    T rows unpadded, the payloads tallied as their shares."""
    groups, size = data_parallel()[1], world_size()
    if groups == 1:
        return x
    if _planned is not None:
        _add("dispatch", x, 1 / size)
        if size > 1:
            _add("all_gather", x, groups / size)
        return x.new_empty((groups * x.shape[0], *x.shape[1:]))
    share = -(-_step_rows // size)
    padded = x.new_zeros((share * size, *x.shape[1:]))
    padded[:x.shape[0]] = x
    mine = padded[rank() * share:(rank() + 1) * share]
    _add("dispatch", mine)
    across = x.new_empty((groups, share, *x.shape[1:]))
    _gather_single(across, mine, _data.peers)
    if size == 1:
        return across.flatten(0, 1)
    _add("all_gather", across)
    whole = x.new_empty((size, groups, share, *x.shape[1:]))
    _gather_single(whole, across, _group())
    return whole.movedim(0, 1).flatten(0, 2)  # [groups, ranks' shares, ...]


def combine(x: torch.Tensor, rows: int) -> torch.Tensor:
    """This rank's partial sums [groups * P, ...] for every group's rows -> the sums over every rank
    of every group for this group's first `rows` (on each of its ranks): the inverse of dispatch,
    a reduce-scatter inside the group (NVLink), one across the groups (the NIC), then the group's
    ranks gather their shares. Without data-parallel groups: the group's all-reduce."""
    groups, size = data_parallel()[1], world_size()
    if groups == 1:
        return all_reduce(x)
    if _planned is not None:
        if size > 1:
            _add("reduce_scatter", x)
            _add("all_gather", x, 1 / (groups * size))
        _add("combine", x, 1 / size)
        return x[:rows]
    shares = x.unflatten(0, (groups, size, -1)).movedim(1, 0).contiguous()  # [ranks, groups, share, ...]
    if size > 1:
        _add("reduce_scatter", shares)
        shares = _reduce_scatter_first(shares, rank(), _group())
    else:
        shares = shares[0]
    _add("combine", shares)
    mine = _reduce_scatter_first(shares.contiguous(), _data.index, _data.peers)
    if size == 1:
        return mine[:rows]
    _add("all_gather", mine)
    whole = x.new_empty((size, *mine.shape))
    _gather_single(whole, mine, _group())
    return whole.flatten(0, 1)[:rows]


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
    """"rank R of N on HOST" ("rank R of N (stage S of P) on HOST" under pipeline stages, "(data-
    parallel group G of D)" under those): how a rank's messages name it in a log every rank
    writes to. R and N count every rank of the process group."""
    index, count = stage()
    group, groups = data_parallel()
    where = f" (stage {index} of {count})" if count > 1 else ""
    where += f" (data-parallel group {group} of {groups})" if groups > 1 else ""
    on = dist.is_available() and dist.is_initialized()
    me, total = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    return f"rank {me} of {total}{where} on {socket.gethostname()}"
