"""Throughput and memory of the data path alone: read -> tokenise -> bucket -> write.

The engine is a null engine (4 fixed tokens a request, no work), so what is measured is
dflash-batch's own per-row cost, which must never be what limits a GPU run.

usage: python benchmarks/data_path.py [--sizes 250000,1000000]
Each (input kind, size) runs in a fresh process so peak RSS is per run. Two input kinds:
`messages` (chat template + BPE tokenizer: the tokenizer's own cost dominates) and `input_ids`
(pre-tokenised: dflash-batch's own per-row cost alone).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOPICS = ["arithmetic", "geometry", "python", "history", "poetry"]


def make_input(path: Path, rows: int, kind: str) -> None:
    with open(path, "w") as f:
        for i in range(rows):
            row = {"id": f"q{i}", "topic": TOPICS[i % 5]}
            if kind == "messages":
                row["messages"] = [{"role": "system", "content": "You are a careful assistant."},
                                   {"role": "user", "content": f"Question {i}: what is {i % 97} plus "
                                    f"{i % 89}? Explain the {TOPICS[i % 5]} behind it step by step."}]
            else:
                row["input_ids"] = [(i * 7 + j) % 15000 + 10 for j in range(40 + i % 20)]
            f.write(json.dumps(row) + "\n")


class NullEngine:
    """Answers every request at once with the same 4 tokens: costs next to nothing, so the
    figures are the data path's own."""

    vocab_size = None

    def generate(self, requests, bucket):
        from dflash_batch.engine.request import Completion, SpecCounters

        for req in requests:
            yield Completion(req.key, [11, 12, 13, 14], "four", "length", None, SpecCounters(8, [3]), 0.0, 0.0)


def child(workdir: Path, name: str) -> None:
    from dflash_batch.job import load_job
    from dflash_batch.plan.shards import Shard
    from dflash_batch.runner import run_job

    job = load_job(workdir / f"job-{name}.yaml")
    t0 = time.perf_counter()
    result = run_job(job, lambda job, tok: NullEngine(), Shard(0, 1), progress=False)
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": result.rows_written, "seconds": dt, "peak_rss_mb": rss}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="250000,1000000")
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return
    from tests.tiny_tokenizer import make_tokenizer_dir, stdlib_corpus

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    # A 16k-vocab BPE trained on the standard library: token counts per prompt like a real model's.
    model = make_tokenizer_dir(work / "model", vocab_size=16000, corpus=stdlib_corpus())
    (model / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    table = []
    for kind in ("messages", "input_ids"):
        for rows in (int(x) for x in args.sizes.split(",")):
            name = f"{kind}-{rows}"
            make_input(work / f"in-{name}.jsonl", rows, kind)
            column = {"messages_column": "messages"} if kind == "messages" else {"input_ids_column": "input_ids"}
            (work / f"job-{name}.yaml").write_text(json.dumps({
                "input": {"paths": [f"in-{name}.jsonl"], "id_column": "id", "passthrough_columns": ["topic"],
                          **column},
                "model": {"target": "model"}, "engine": {"max_model_len": 4096, "max_num_seqs": 256},
                "buckets": [{"max_tokens": 128}, {"max_tokens": 1024}, {"max_tokens": 4096}],
                "sampling": {"max_new_tokens": 64}, "output": {"dir": f"out-{name}", "rows_per_part": 50000}}))
            out = subprocess.run([sys.executable, __file__, "--child", str(work), name], check=True,
                                 capture_output=True, text=True, cwd=ROOT)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            table.append((kind, rows, r["seconds"], r["rows"] / r["seconds"], r["peak_rss_mb"]))
    print(f"{'input':>10} {'rows':>9} {'seconds':>8} {'rows/s':>8} {'peak RSS MB':>12}")
    for kind, rows, sec, rate, rss in table:
        print(f"{kind:>10} {rows:>9} {sec:>8.1f} {rate:>8.0f} {rss:>12.0f}")


if __name__ == "__main__":
    main()
