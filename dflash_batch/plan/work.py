"""What one decode round does on a rank, counted from the engine's own round run on the meta device:
the FLOPs of every matmul and attention it runs, by component, and the bytes it hands each kind
of collective (parallel.tallied).

The round is Round.run (engine/round.py) over a DecodeBatch of the bucket, every sequence at the
bucket's longest context: draft, verify, choose, accept, context write, commit, as a GPU runs it
(the plan's backend and kernels aside: attention is counted as the torch reference computes it,
each query over its sequence's whole key span, masked keys included; MoE routing, unknown on the
meta device, gives each token its top-k experts' work: kernels/moe_mxfp4.routed_sum). FLOPs come
from torch.utils.flop_counter's formulas for each op run; a model change changes them.

A round runs each layer of a kind on inputs of one shape, so the meta device would repeat the
same work 93 times over (seconds a round). A layer's parts that were called before on inputs of
the same shape, with the same settings, are counted from that call instead of run again (their
outputs keep their shapes): the same count, in a fraction of the time (test_work.py checks both).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from dflash_batch import parallel
from dflash_batch.kernels import moe_mxfp4

# Module classes whose work is a component of its own (by class name: models import nothing of the plan).
COMPONENTS = {"KDA": "KDA", "GatedMLA": "MLA attention", "Qwen3Attention": "attention",
              "MXFP4Experts": "routed experts", "DenseExperts": "routed experts", "ParallelLMHead": "LM head"}


@dataclass(frozen=True)
class Work:
    """One round's work on a rank."""

    flops: dict[str, int]        # by component: "target KDA", "target routed experts", "drafter", ...
    collectives: dict[str, int]  # payload bytes this rank hands each kind of collective

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def times(self, factor: float) -> Work:
        """This work done `factor` times over (a round of that many sequences, of one counted)."""
        return Work({k: v * factor for k, v in self.flops.items()},
                    {k: v * factor for k, v in self.collectives.items()})


class _Counting(TorchDispatchMode):
    """Adds each op's FLOPs (flop_counter's formula, where it has one) to the innermost component."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []
        self.flops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops[self.where[-1]] += formula(*args, **kwargs, out_val=out)
        return out


def void(_) -> None:
    """A forward hook's None (what it returns replaces the module's output)."""


def _shape_of(x):
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else id(x)


@contextmanager
def _counted(models: list[nn.Module]) -> Iterator[_Counting]:
    """Count inside: each op's FLOPs under "<role> <component>" (role: the model whose method runs
    it, target or drafter: _role), repeated layer parts counted from their first call."""
    counting = _Counting()
    memo: dict[tuple, tuple] = {}
    undo = []

    def enter(module: nn.Module, args) -> None:
        role = counting.where[-1].split()[0]  # target or drafter: whose method runs it
        counting.where.append(f"{role} {COMPONENTS[type(module).__name__]}")

    modules = list({id(m): m for model in models for m in model.modules()}.values())  # the head is shared
    for module in modules:
        if type(module).__name__ in COMPONENTS:
            undo.append(module.register_forward_pre_hook(enter))
            undo.append(module.register_forward_hook(lambda m, args, out: void(counting.where.pop())))
    for layers in (m for m in modules if isinstance(m, nn.ModuleList)):
        for layer in layers:
            for part in layer.children():
                undo += _memoize(part, memo, counting)
    routed_sum, moe_mxfp4.routed_sum = moe_mxfp4.routed_sum, _routed_on_meta(moe_mxfp4.routed_sum)
    try:
        with counting:
            yield counting
    finally:
        moe_mxfp4.routed_sum = routed_sum
        for handle in undo:
            handle.remove()


def _routed_on_meta(routed_sum):
    """kernels/moe_mxfp4.routed_sum, which groups rows by expert on the host, or on the meta device
    (no routing to read) expert 0 over every (row, choice) pair."""
    def run(x, ids, weights, width, experts, expert):
        if x.is_meta:
            return expert(0, x.repeat_interleave(ids.shape[1], 0))[:x.shape[0]]
        return routed_sum(x, ids, weights, width, experts, expert)
    return run


def _memoize(module: nn.Module, memo: dict, counting: _Counting) -> list:
    """Run `module`'s forward (and a recurrent layer's commit) once per (class, parameter shapes,
    plain settings, argument shapes): a later call with the same key adds the first call's FLOPs
    and collective payloads and returns tensors of its outputs' shapes."""
    settings = tuple(sorted((k, v) for k, v in vars(module).items()
                            if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))))
    params = tuple((tuple(p.shape), p.dtype) for p in module.parameters())
    handles = []
    for name in ("forward", "commit"):
        method = getattr(module, name, None)
        if method is None:
            continue

        def run(*args, method=method, name=name, **kwargs):
            key = (type(module), name, params, settings, tuple(map(_shape_of, args)),
                   tuple((k, _shape_of(v)) for k, v in kwargs.items()))
            if key not in memo:
                flops, tally = counting.flops.copy(), parallel._tally.copy()
                out = method(*args, **kwargs)
                memo[key] = (out, counting.flops - flops, parallel._tally - tally)
                return out
            out, flops, tally = memo[key]
            counting.flops.update(flops)
            parallel._tally.update(tally)
            return tree_map(lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t, out)

        setattr(module, name, run)
        handles.append(_Restore(module, name))
    return handles


class _Restore:
    def __init__(self, module: nn.Module, name: str):
        self.module, self.name = module, name

    def remove(self) -> None:
        delattr(self.module, self.name)  # the class's method again


def round_work(target: nn.Module, drafter: nn.Module | None, step, batch, seqs: int, context: int,
               width: int, greedy: bool) -> Work:
    """The work of one round of `seqs` sequences at `context` tokens each verifying `width` rows
    (anchor and drafts), on the meta device: `step` is the engine's Round for the batch's block,
    its backend the torch reference (with the job's latent split) and `batch` allocated on meta
    (sizing.py), inside parallel.planned. `greedy`: every row at temperature 0 (the sampler's
    gathers skipped)."""
    models = [target] + ([drafter] if drafter is not None else [])
    with parallel.tallied() as tally, _counted(models) as counting:
        counting.where.append("target other")
        with _role(drafter, counting):
            step.run(batch, seqs, greedy, context + batch.block, width)
    return Work(dict(counting.flops), dict(tally))


@contextmanager
def _role(drafter: nn.Module | None, counting: _Counting) -> Iterator[None]:
    """What the drafter's methods run is the drafter's ("drafter other" outside its components)."""
    if drafter is None:
        yield
        return
    undo = []
    for name in ("forward", "propose", "write_context"):
        method = getattr(drafter, name)

        def run(*args, method=method, **kwargs):
            counting.where.append("drafter other")
            try:
                return method(*args, **kwargs)
            finally:
                counting.where.pop()
        setattr(drafter, name, run)
        undo.append(_Restore(drafter, name))
    try:
        yield
    finally:
        for handle in undo:
            handle.remove()
