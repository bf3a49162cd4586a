"""Optimizer, learning-rate schedule and the step budget shared by both training phases.

AdamW (betas 0.9/0.95, clip 1.0 in the loops), linear warmup over a fixed number of steps, then
cosine down to 10% (the doc's recipe). A phase runs either a given number of steps or as many as
fit in a time budget: the warmup steps after the first (their learning rates do not depend on
the total) are timed and fix the total; the log records it, and
`--target-steps/--drafter-steps` with that number reproduce the run exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

MIN_TIMED_WARMUP = 4


def adamw(model: nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    """Weight decay on matrices only; not on embeddings (the mask row must stay as initialised),
    norms, biases, codebooks or the conv kernels."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = p.dim() == 2 and not name.endswith(("embed_tokens.weight", "codebook"))
        (decay if matrix else plain).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": plain, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def run_phase(step_fn: Callable[[int, float], None], peak_lr: float, warmup: int, steps: int | None,
              seconds: float | None) -> int:
    """Call step_fn(step, lr) for each step; returns the number of steps run."""
    if steps is None and seconds is None:
        raise ValueError("give a step count or a time budget")
    if steps is None and warmup < MIN_TIMED_WARMUP:
        raise ValueError(f"a timed phase needs warmup >= {MIN_TIMED_WARMUP} steps (they time the step)")
    total, start, step = steps, time.monotonic(), 0
    while total is None or step < total:
        step_fn(step, lr_at(step, peak_lr, warmup, total or 10 ** 9))
        step += 1
        if total is None and step == 1:
            mark = time.monotonic()  # the first step (allocations, its evaluation) is not typical
        elif total is None and step == warmup:
            now = time.monotonic()
            total = step + max(0, int((seconds - (now - start)) / ((now - mark) / (warmup - 1))))
    return step
