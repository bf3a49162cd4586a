"""Kimi-K3 + kimi-k3-dflash2 on the GPUs its users have: the memory plan of each production job
(dflash-batch plan: the engine's own allocation on the meta device), one line a bucket. What a
round costs on those GPUs (memory, compute, network) is the plan's roofline: `dflash-batch plan JOB`.

usage: python benchmarks/kimi_memory.py
"""

from __future__ import annotations

from pathlib import Path

from dflash_batch.job import gpu_bytes, load_job
from dflash_batch.sizing import GB, plan_job

JOBS = Path(__file__).resolve().parent.parent / "jobs"


def main() -> None:
    jobs = [("kimi-k3-dflash2.yaml", "gb300", 8), ("kimi-k3-dflash2-h200.yaml", "h200", 8),
            ("kimi-k3-dflash2-h100.yaml", "h100", 8)]
    plans = {name: plan_job(load_job(JOBS / name), JOBS, gpu_bytes(gpu), with_split=True) for name, gpu, _ in jobs}
    print("memory plan per rank (dflash-batch plan JOB), GB, at each job's reserve and engine.gpu_memory_headroom; "
          "split: the MLA latents split across the ranks (engine.context_parallel, on where the buckets need it):")
    print(f"{'job':<28} {'gpu':>6} {'tp':>4} {'nodes':>5} {'weights':>8} {'bucket':>13} {'seqs':>5} {'split':>5} "
          f"{'total':>7}")
    for name, gpu, per_node in jobs:
        plan = plans[name]
        for need in plan.runs.needs:
            print(f"{name:<28} {gpu:>6} {plan.tp:>4} {-(-plan.tp // per_node):>5} "
                  f"{sum(plan.weights.values()) / GB:>8.1f} {need.bucket.name:>13} {need.bucket.max_num_seqs:>5} "
                  f"{'yes' if plan.uses_split else 'no':>5} {(plan.base + need.total) / GB:>7.1f}")


if __name__ == "__main__":
    main()
