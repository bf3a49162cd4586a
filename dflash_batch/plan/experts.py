"""A placement of the routed experts from a run's own routing counts (`dflash-batch experts place`):
a Slurm array's pilot shard calibrates the placement the rest of the array runs with."""

from __future__ import annotations

from pathlib import Path

import orjson

from dflash_batch.job import JobError
from dflash_batch.models.layers.expert_parallel import Placement, default_placement, imbalance, place


def routed_counts(out_dir: Path) -> dict[int, list[int]]:
    """Routed tokens per (layer, expert), summed over every shard's stats of the run in `out_dir`."""
    totals: dict[int, list[int]] = {}
    for path in sorted((out_dir / "stats").glob("shard-*.json")):
        for layer, counts in (orjson.loads(path.read_bytes()).get("experts") or {}).get("routed_tokens", {}).items():
            have = totals.setdefault(int(layer), [0] * len(counts))
            totals[int(layer)] = [a + b for a, b in zip(have, counts)]
    if not totals:
        raise JobError(f"{out_dir}: no shard's stats hold routing counts (a run of a target with routed "
                       "experts writes them in OUT_DIR/stats/shard-N.json once it ends or stops)")
    return totals


def placement_of_run(out_dir: Path, ranks: int, redundant: int) -> tuple[Placement, list[list]]:
    """The placement balancing the run's counts over `ranks` ranks with `redundant` replica slots
    each, and a row per layer: (layer, routed tokens, the hottest rank over the mean by default, placed)."""
    counts = routed_counts(out_dir)
    experts = len(next(iter(counts.values())))
    if experts % ranks:
        raise JobError(f"--ranks {ranks}: the run's {experts} experts do not split evenly over them")
    layers = {layer: place(c, ranks, redundant) for layer, c in counts.items()}
    default = default_placement(experts, ranks, redundant)
    rows = [[layer, sum(c), imbalance(c, default), imbalance(c, layers[layer])] for layer, c in sorted(counts.items())]
    return Placement(experts, ranks, redundant, layers), rows
