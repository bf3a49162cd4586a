"""The Ray Data stage beside `dflash-batch run`, on the same rows: the demo pair over the demo
job's word problems, greedy. `run` is one process (the job's own settings); the Ray pipeline is a
local cluster of --actors actors of one CPU each (dflash_batch.ray.DFlashStage, committing to an
output directory). Rows/s and tokens/s of each, from its start (models loaded included) to its
last row; the Ray run's cluster start is timed apart. One run each.

usage: python benchmarks/ray_stage.py [--actors 2] [--batch-size 12] [--copies 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_batch.build import build_engine  # noqa: E402
from dflash_batch.job import load_job  # noqa: E402
from dflash_batch.plan.shards import Shard  # noqa: E402
from dflash_batch.ray import DFlashStage  # noqa: E402
from dflash_batch.runner import run_job  # noqa: E402

DEMO = ROOT / "jobs" / "demo.yaml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--copies", type=int, default=1, help="the demo rows this many times (ids made unique)")
    args = ap.parse_args()
    import ray

    base = [orjson.loads(line) for line in (ROOT / "jobs/demo/prompts.jsonl").read_bytes().splitlines()]
    rows = [{**r, "id": f"{r['id']}-{c}"} for c in range(args.copies) for r in base]
    scratch = Path(tempfile.mkdtemp())
    with open(scratch / "rows.jsonl", "wb") as f:
        f.writelines(orjson.dumps(r) + b"\n" for r in rows)

    torch.set_num_threads(1)
    job = load_job(DEMO)
    job = job.model_copy(update={"input": job.input.model_copy(update={"paths": [str(scratch / "rows.jsonl")]}),
                                 "output": job.output.model_copy(update={"dir": str(scratch / "run")})})
    t0 = time.perf_counter()
    run_job(job, build_engine, Shard(0, 1), progress=False)
    run_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    ray.init(num_cpus=args.actors, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = ray.data.from_items(rows, override_num_blocks=2 * args.actors).map_batches(
        DFlashStage, fn_constructor_kwargs={"job": str(DEMO), "output_dir": str(scratch / "ray"), "threads": 1},
        batch_size=args.batch_size, batch_format="pyarrow", concurrency=args.actors, num_cpus=1).take_all()
    ray_s = time.perf_counter() - t0
    ray.shutdown()
    tokens = sum(r["completion_tokens"] or 0 for r in out)
    assert len(out) == len(rows), (len(out), len(rows))

    print(f"{len(rows)} rows, {tokens} generated tokens (the demo pair, greedy, one torch thread a process)")
    print(f"{'':<34} {'seconds':>8} {'rows/s':>7} {'tok/s':>7}")
    print(f"{'dflash-batch run (1 process)':<34} {run_s:>8.1f} {len(rows) / run_s:>7.1f} {tokens / run_s:>7.0f}")
    print(f"{f'Ray map_batches ({args.actors} actors)':<34} {ray_s:>8.1f} {len(rows) / ray_s:>7.1f} "
          f"{tokens / ray_s:>7.0f}   (+ {start_s:.1f} s to start the local cluster)")


if __name__ == "__main__":
    main()
