"""What one decode round does on a rank, counted from the engine's own round run on the meta device:
the FLOPs of every matmul and attention it runs, by component, and the bytes it hands each kind
of collective (parallel.tallied).

The round is Round.run (engine/round.py) over a DecodeBatch of the bucket, every sequence at the
bucket's longest context: draft, verify, choose, accept, context write, commit (the plan's backend
and kernels aside: attention is counted as the torch reference computes it, each query over its
sequence's whole key span, masked keys included; MoE routing, unknown on the meta device, gives
every (token, choice) pair to one expert: the work of any routing over experts of one shape,
`_routed_on_meta`). FLOPs come from torch.utils.flop_counter's formulas for each op run; a model
change changes them.

A round runs each layer of a kind on inputs of one shape, so the meta device would repeat the
same work 93 times over (seconds a round). A layer's parts that were called before, for the same
model, on inputs of the same shape, with the same settings, are counted from that call instead of
run again (their outputs keep their shapes): the same count, in a fraction of the time
(tests/test_work.py checks both).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
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

    flops: dict[str, float]        # by component: "target KDA", "target routed experts", "drafter other", ...
    collectives: dict[str, float]  # payload bytes this rank hands each kind of collective

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def times(self, factor: float) -> Work:
        """This work done `factor` times over (a round of that many sequences, of one counted)."""
        return Work({k: v * factor for k, v in self.flops.items()},
                    {k: v * factor for k, v in self.collectives.items()})


class _Counting(TorchDispatchMode):
    """Adds each op's FLOPs (flop_counter's formula, where it has one) to the innermost component
    on `where` ("<role> <component>": role target or drafter, the model whose method runs it)."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []
        self.flops: Counter = Counter()

    @property
    def role(self) -> str:
        return self.where[-1].split()[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:  # a rank's share where all ranks run it together (parallel.work_share)
            self.flops[self.where[-1]] += formula(*args, **kwargs, out_val=out) * parallel.work_fraction()
        return out


def round_work(target: nn.Module, drafter: nn.Module | None, step, batch, seqs: int, context: int,
               width: int, greedy: bool) -> Work:
    """The work of one round of `seqs` sequences at `context` tokens each verifying `width` rows
    (anchor and drafts), on the meta device: `step` is the engine's Round for the batch's block,
    its backend the torch reference (with the job's latent split) and `batch` allocated on meta
    (sizing.py), inside parallel.planned. `greedy`: every row at temperature 0 (the sampler's
    gathers skipped)."""
    counting = _Counting()
    counting.where.append("target other")
    with parallel.tallied() as tally, ExitStack() as undo:
        _install(undo, [target] + ([drafter] if drafter is not None else []), counting)
        with counting:
            step.run(batch, seqs, greedy, context + batch.block, width)
    return Work(dict(counting.flops), dict(tally))


def _install(undo: ExitStack, models: list[nn.Module], counting: _Counting) -> None:
    """Component labels, the drafter's role, repeated parts counted once, and the meta device's
    MoE routing, each undone by `undo`."""
    modules = list({id(m): m for model in models for m in model.modules()}.values())  # the head is shared

    def enter(module: nn.Module, args) -> None:
        counting.where.append(f"{counting.role} {COMPONENTS[type(module).__name__]}")

    def leave(module: nn.Module, args, out) -> None:  # returns None: a hook's value replaces the output
        counting.where.pop()

    for module in (m for m in modules if type(m).__name__ in COMPONENTS):
        undo.callback(module.register_forward_pre_hook(enter).remove)
        undo.callback(module.register_forward_hook(leave).remove)
    if len(models) > 1:
        for name in ("forward", "propose", "write_context"):
            _wrap(undo, models[1], name, lambda method: _as(counting, "drafter other", method))
    memo: dict[tuple, tuple] = {}
    parts = {id(p): p for layers in modules if isinstance(layers, nn.ModuleList)
             for layer in layers for p in layer.children()}
    for part in parts.values():
        for name in ("forward", "commit"):
            if hasattr(part, name):
                _wrap(undo, part, name, lambda method, part=part, name=name: _once(part, name, method, memo, counting))
    _wrap(undo, moe_mxfp4, "routed_sum", _routed_on_meta)


def _wrap(undo: ExitStack, owner, name: str, wrapper: Callable) -> None:
    """Replace owner.name by wrapper(owner.name) until `undo` closes (an instance's own attribute,
    removed after: the class's method again; a module's function, restored)."""
    method = getattr(owner, name)
    if isinstance(owner, nn.Module) and name not in vars(owner):
        undo.callback(delattr, owner, name)
    else:
        undo.callback(setattr, owner, name, method)
    setattr(owner, name, wrapper(method))


def _as(counting: _Counting, where: str, method: Callable) -> Callable:
    """`method`, its ops counted under `where` (outside any component)."""
    def run(*args, **kwargs):
        counting.where.append(where)
        try:
            return method(*args, **kwargs)
        finally:
            counting.where.pop()
    return run


def _once(part: nn.Module, name: str, method: Callable, memo: dict, counting: _Counting) -> Callable:
    """`method` run once per (role, class, method, parameter shapes, plain settings, argument
    shapes; for other arguments, the object: an AttnMeta is one forward's); a later call with the
    same key adds the first call's FLOPs and payloads and returns tensors of its outputs' shapes.
    The first call's arguments stay referenced, so no later object takes an id the key holds."""
    settings = tuple(sorted((k, v) for k, v in vars(part).items()
                            if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))))
    params = tuple((tuple(p.shape), p.dtype) for p in part.parameters())

    def signature(x):
        return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else id(x)

    def run(*args, **kwargs):
        key = (counting.role, type(part), name, params, settings, tuple(map(signature, args)),
               tuple((k, signature(v)) for k, v in kwargs.items()))
        tally = parallel.tally()
        if key not in memo:
            flops, payloads = counting.flops.copy(), tally.copy()
            out = method(*args, **kwargs)
            memo[key] = (out, counting.flops - flops, tally - payloads, (args, kwargs))
            return out
        out, flops, payloads, _ = memo[key]
        counting.flops.update(flops)
        tally.update(payloads)
        return tree_map(lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t, out)
    return run


def _routed_on_meta(routed_sum: Callable) -> Callable:
    """kernels/moe_mxfp4.routed_sum, which groups rows by expert on the host, or on the meta device
    (no routing to read) expert 0 over every (row, choice) pair."""
    def run(x, ids, weights, width, experts, expert):
        if x.is_meta:
            return expert(0, x.repeat_interleave(ids.shape[1], 0))[:x.shape[0]]
        return routed_sum(x, ids, weights, width, experts, expert)
    return run
