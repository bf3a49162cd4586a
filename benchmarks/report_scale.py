"""`report`, `status` and the duplicate-key check on 1M and 10M output rows: wall time and peak
memory.

Writes synthetic committed parts (the output schema's columns that report and status read, 100k
rows a part, 4 datasets, 3 buckets, block size 8) to --dir once, then runs each command in a fresh
process on the first 1M rows and on all of them, and prints a table. Flat memory: the peak
should not grow with the rows (report and status read one part at a time; the duplicate check,
which a shard runs over its committed keys when it finishes, regroups them through spill parts).

usage: python benchmarks/report_scale.py [--rows 10000000] [--dir /tmp/dfb-report-scale]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

PART = 100_000


def part(start: int, rng: np.random.Generator) -> pa.Table:
    n, block = PART, 8
    rows = np.arange(start, start + n)
    ok = rng.random(n) > 0.01
    rounds = rng.integers(1, 200, n)
    hist = rng.integers(0, 30, (n, block))
    return pa.table({
        "row_id": pa.array(rows // 2).cast(pa.string()), "sample_index": pa.array(rows % 2, pa.int32()),
        "status": pa.array(np.where(ok, "ok", "error")),
        "finish_reason": pa.array(np.where(ok, np.where(rng.random(n) < 0.1, "length", "stop"), "error")),
        "completion_tokens": pa.array(rounds * 5, pa.int32()),
        "bucket": pa.array(np.array(["0-2048", "2048-8192", "8192-131072"])[rows % 3]),
        "spec_block_size": pa.array(np.full(n, block), pa.int16()),
        "spec_rounds": pa.array(rounds, pa.int32()), "spec_accepted": pa.array(rounds * 3, pa.int32()),
        "spec_histogram": pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * block, block), pa.int32()),
                                                   pa.array(hist.reshape(-1), pa.int32())),
        "shard_index": pa.array(np.full(n, start // PART % 4), pa.int32()),
        "dataset": pa.array(np.array(["gsm8k", "math500", "aime", "writing"])[rows % 4]),
    })


def generate(d: Path, rows: int) -> None:
    if (d / "done").exists():
        return
    shutil.rmtree(d, ignore_errors=True)
    rng = np.random.default_rng(0)
    for i in range(rows // PART):
        shard = d / "data" / f"shard-{i % 4:05d}"
        shard.mkdir(parents=True, exist_ok=True)
        pq.write_table(part(i * PART, rng), shard / f"part-{i:06d}.parquet")
    (d / "run.json").write_bytes(orjson.dumps({"num_shards": 4, "job_file": None}))
    (d / "done").touch()


def subset(d: Path, rows: int) -> Path:
    """A directory with the first `rows` rows' parts (links)."""
    out = d.parent / f"{d.name}-{rows}"
    if not out.exists():
        for f in sorted((d / "data").rglob("part-*.parquet"))[:rows // PART]:
            (out / "data" / f.parent.name).mkdir(parents=True, exist_ok=True)
            (out / "data" / f.parent.name / f.name).symlink_to(f)
        shutil.copy(d / "run.json", out / "run.json")
    return out


CLI = "from dflash_batch.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
DUPLICATES = ("import pyarrow.parquet as pq; from pathlib import Path\n"
              "from dflash_batch.io.ledger import part_files; from dflash_batch.io.spill import duplicates\n"
              "keys = ['row_id', 'sample_index']\n"
              "assert duplicates((pq.read_table(f, columns=keys) for f in part_files(Path(sys.argv[2]))), keys)['count'] == 0\n")


def measure(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one command in a fresh process."""
    t0 = time.perf_counter()
    code = ("import resource, sys\n" + (DUPLICATES if command[0] == "duplicates" else CLI) +
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, int(out.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dfb-report-scale"))
    args = ap.parse_args()
    generate(args.dir, args.rows)
    print("| rows | command | wall s | peak RSS MiB |")
    print("|---|---|---|---|")
    for rows in (args.rows // 10, args.rows):
        d = subset(args.dir, rows) if rows < args.rows else args.dir
        for name in ("report", "status", "duplicates"):
            sec, rss = measure([name, str(d)] + (["--json"] if name == "report" else []))
            print(f"| {rows:,} | {name} | {sec:.1f} | {rss:.0f} |")


if __name__ == "__main__":
    main()
