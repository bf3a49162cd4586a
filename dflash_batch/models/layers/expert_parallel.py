"""Routed experts sharded whole over every rank of the run (model.expert_parallel), and where each
one goes.

A placement names, for each MoE layer, the experts each rank holds in its slots: num_experts /
ranks of its own, plus `redundant` replicas of hot experts (EPLB). Every slot holds a whole
expert, read from the checkpoint under its own name; a rank reads no other expert. Where an expert
has n replicas, the replica j serves the (token, expert) routes of the tokens whose index in the
step's dispatched rows is j mod n: each route is served exactly once, and every rank knows which
without a message.

`place` balances the ranks' loads from routed-token counts (a previous run's, `dflash-batch experts
place`): replicas first to the experts with the most tokens per replica, then each replica, heaviest
first, to the least-loaded rank with a free slot that does not hold that expert yet (the longest-
processing-time rule, within 4/3 of the optimum).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from dflash_batch import parallel


@dataclass(frozen=True)
class Placement:
    """layers[layer index] = per rank, its experts in slot order (every rank the same count)."""

    experts: int
    ranks: int
    redundant: int
    layers: dict[int, list[list[int]]]

    @property
    def slots(self) -> int:
        return self.experts // self.ranks + self.redundant

    def of_layer(self, layer: int) -> list[list[int]]:
        """The layer's placement; a layer the placement does not name gets the balanced default."""
        return self.layers.get(layer) or default_placement(self.experts, self.ranks, self.redundant)

    def to_json(self) -> dict:
        return {"experts": self.experts, "ranks": self.ranks, "redundant_experts": self.redundant,
                "layers": {str(k): v for k, v in sorted(self.layers.items())}}

    @classmethod
    def from_json(cls, doc: dict, where: str) -> Placement:
        """A placement file's contents, checked: every layer puts each expert on at least one rank,
        at most once a rank, in `slots` slots a rank."""
        try:
            placement = cls(int(doc["experts"]), int(doc["ranks"]), int(doc["redundant_experts"]),
                            {int(k): [[int(e) for e in rank] for rank in v] for k, v in doc["layers"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: not an expert placement ({type(e).__name__}: {e}); write one with "
                             "`dflash-batch experts place`") from None
        for layer, ranks in placement.layers.items():
            problem = placement.problem(ranks)
            if problem:
                raise ValueError(f"{where}: layer {layer}: {problem}")
        return placement

    def problem(self, ranks: list[list[int]]) -> str | None:
        if self.experts % self.ranks:
            return f"{self.experts} experts do not split evenly over {self.ranks} ranks"
        if len(ranks) != self.ranks or any(len(r) != self.slots for r in ranks):
            return f"needs {self.ranks} ranks of {self.slots} slots each"
        if any(len(set(r)) != len(r) for r in ranks):
            return "a rank holds an expert twice"
        held = {e for r in ranks for e in r}
        if held != set(range(self.experts)):
            return f"experts {sorted(set(range(self.experts)) - held)} are on no rank" if held < set(
                range(self.experts)) else f"names experts outside 0..{self.experts - 1}"
        return None


@functools.cache
def default_placement(experts: int, ranks: int, redundant: int) -> list[list[int]]:
    """The placement of no counts (every expert alike), made once for every layer that takes it."""
    return place([1] * experts, ranks, redundant)


def place(counts: list[int], ranks: int, redundant: int = 0) -> list[list[int]]:
    """Per rank, the experts it holds (sorted), balancing routed-token `counts` over `ranks` ranks
    of len(counts) / ranks + `redundant` slots each."""
    experts = len(counts)
    if experts % ranks:
        raise ValueError(f"{experts} experts do not split evenly over {ranks} ranks")
    replicas = [1] * experts
    for _ in range(ranks * redundant):  # each spare slot to the most tokens per replica (ties: lowest id)
        e = max((e for e in range(experts) if replicas[e] < ranks), key=lambda e: (counts[e] / replicas[e], -e))
        replicas[e] += 1
    pieces = sorted(((counts[e] / replicas[e], e) for e in range(experts) for _ in range(replicas[e])),
                    key=lambda p: (-p[0], p[1]))
    slots, load, held = experts // ranks + redundant, [0.0] * ranks, [set() for _ in range(ranks)]
    for share, e in pieces:
        r = min((r for r in range(ranks) if len(held[r]) < slots and e not in held[r]), key=lambda r: (load[r], r))
        load[r] += share
        held[r].add(e)
    return [sorted(h) for h in held]


def rank_loads(counts: list[int], ranks: list[list[int]]) -> list[float]:
    """Tokens each rank computes under a placement: an expert's count split evenly over its replicas."""
    replicas = [0] * len(counts)
    for held in ranks:
        for e in held:
            replicas[e] += 1
    return [sum(counts[e] / replicas[e] for e in held) for held in ranks]


def imbalance(counts: list[int], ranks: list[list[int]]) -> float:
    """The hottest rank's load over the mean (1.0: balanced; 1.0 where nothing was routed)."""
    loads = rank_loads(counts, ranks)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def routing_stats(counts: dict[int, list[int]], ranks: int, redundant: int, used: Placement | None) -> dict:
    """What a run's stats say of its routing: the routed tokens per (layer, expert), and per layer
    the hottest rank's load over the mean on `ranks` ranks: under the default placement, under the
    placement the run used (None: experts cut across ranks, every rank's load the mean), and under
    the one `place` makes from these counts."""
    loads = {}
    for layer, routed in counts.items():
        if len(routed) % ranks:
            continue
        loads[str(layer)] = {"default": imbalance(routed, default_placement(len(routed), ranks, redundant)),
                             "this_run": None if used is None else imbalance(routed, used.of_layer(layer)),
                             "placed": imbalance(routed, place(routed, ranks, redundant))}
    return {"routed_tokens": {str(k): v for k, v in counts.items()}, "ranks": ranks, "redundant": redundant,
            "hottest_over_mean": loads}


class ExpertTable(nn.Module):
    """One MoE layer's routes as this rank sees them: for each expert, the slot holding it here
    (-1: another rank's), which replica this one is and how many there are."""

    def __init__(self, ranks: list[list[int]], experts: int, me: int):
        super().__init__()
        slot_of, replica_of, replicas = [-1] * experts, [0] * experts, [0] * experts
        for r, held in enumerate(ranks):
            for s, e in enumerate(held):
                if r == me:
                    slot_of[e], replica_of[e] = s, replicas[e]
                replicas[e] += 1
        for name, values in (("slot_of", slot_of), ("replica_of", replica_of), ("replicas", replicas)):
            self.register_buffer(name, torch.tensor(values), persistent=False)

    def routes(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every group's routes (ids, weights [rows, k]) -> the ones this rank serves, as (slot,
        weight); the others become (slot 0, weight 0), which adds nothing (fixed shapes: no row is
        dropped on the host)."""
        token = torch.arange(ids.shape[0], device=ids.device)[:, None]
        slot = self.slot_of[ids]
        mine = (slot >= 0) & (token % self.replicas[ids] == self.replica_of[ids])
        return torch.where(mine, slot, 0), torch.where(mine, weights, torch.zeros_like(weights))

    def checkpoint_slot(self, expert: int) -> int | None:
        """The slot the checkpoint's expert `expert` fills here (None: another rank's)."""
        slot = int(self.slot_of[expert])
        return slot if slot >= 0 else None


def sharded_experts(experts: nn.Module, table: ExpertTable, latent: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """This group's rows' routed sum [T, width] over every rank's experts: the latent rows and their
    routes dispatched to every group, this rank's slots applied to all of them, the partial sums
    combined back (parallel.dispatch, combine)."""
    rows = latent.shape[0]
    x, every_id, every_weight = parallel.dispatch(latent), parallel.dispatch(ids), parallel.dispatch(weights)
    slot, weight = table.routes(every_id, every_weight)
    # The plan (no routing to read on the meta device) counts this rank's even share of every route.
    with parallel.work_share(1 / parallel.expert_rank()[1] if x.is_meta else 1.0):
        out = experts(x, slot, weight)
    return parallel.combine(out, rows)
