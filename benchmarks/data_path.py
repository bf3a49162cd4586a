"""Throughput and memory of the data path alone: read -> template -> tokenise -> bucket -> write.

The engine is a null engine (the same 4 tokens for every request, no work), so what is measured
is dflash-batch's own per-row cost, which must never be what limits a GPU run.

usage: python benchmarks/data_path.py [--sizes 250000,1000000] [--repeats 1]

Each case runs in a fresh process, so peak RSS is per run (main process; the workers' peak is
shown apart). Inputs:
  chats, kimi   chat messages, Kimi-K3's tokenizer layout (tiktoken.model, Kimi's pattern)
  chats, hf     chat messages, an HF tokenizer.json (byte-level BPE: the tokenizer's own cost
                dominates, ~60 us a prompt on one core here)
  input_ids     pre-tokenised rows: dflash-batch's own per-row cost alone
Both tokenizers are the same 16k-vocab BPE trained on the Python standard library, so prompts
have the token counts a real model gives them (~54 tokens each).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
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

        tokens, spec = [11, 12, 13, 14], SpecCounters(8, [3])  # shared: nothing changes them
        for req in requests:
            yield Completion(req.key, tokens, "four", "length", None, spec, 0.0, 0.0)


def _children_peak_rss_mb(stop: threading.Event, out: list[float]) -> None:
    """Largest peak RSS among this process's children (the workers), polled until `stop`.
    (getrusage's RUSAGE_CHILDREN would count the parent's pages a child held before exec.)"""
    from dflash_batch.testing.procs import children, peak_rss_mb

    while not stop.wait(0.2):
        out[0] = max([out[0], *(peak_rss_mb(c) for c in children(os.getpid()))])


def child(workdir: Path, name: str) -> None:
    from dflash_batch.job import load_job
    from dflash_batch.plan.shards import Shard
    from dflash_batch.runner import run_job

    job = load_job(workdir / f"job-{name}.yaml")
    stop, workers_rss = threading.Event(), [0.0]
    threading.Thread(target=_children_peak_rss_mb, args=(stop, workers_rss), daemon=True).start()
    t0 = time.perf_counter()
    result = run_job(job, lambda job, tok: NullEngine(), Shard(0, 1), progress=False)
    dt = time.perf_counter() - t0
    stop.set()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    workers_rss = workers_rss[0]
    print(json.dumps({"rows": result.rows_written, "seconds": dt, "peak_rss_mb": rss,
                      "workers_peak_rss_mb": workers_rss}))


def write_job(work: Path, name: str, inputs: str, model: str, column: dict, workers: int) -> None:
    (work / f"job-{name}.yaml").write_text(json.dumps({
        "input": {"paths": [inputs], "id_column": "id", "passthrough_columns": ["topic"], "workers": workers,
                  **column},
        "model": {"target": model}, "engine": {"max_model_len": 4096, "max_num_seqs": 256},
        "buckets": [{"max_tokens": 128}, {"max_tokens": 1024}, {"max_tokens": 4096}],
        "sampling": {"max_new_tokens": 64}, "output": {"dir": f"out-{name}", "rows_per_part": 50000}}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="250000,1000000")
    ap.add_argument("--repeats", type=int, default=1, help="runs per case; the median is shown")
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return
    from dflash_batch.testing.tokenizer import make_tiktoken_dir, make_tokenizer_dir, stdlib_corpus

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    corpus = stdlib_corpus()
    models = {"kimi": make_tiktoken_dir(work / "kimi", vocab_size=16000, corpus=corpus),
              "hf": make_tokenizer_dir(work / "hf", vocab_size=16000, corpus=corpus)}
    for m in models.values():
        (m / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    sizes = [int(x) for x in args.sizes.split(",")]
    # (label, input kind, tokenizer, workers); workers 0 = the same work in a thread, for the ratio
    cases = [("chats", "messages", "kimi", 2), ("chats", "messages", "kimi", 0),
             ("chats", "messages", "hf", 2), ("input_ids", "input_ids", "hf", 2)]
    table = []
    for rows in sizes:
        inputs = {}
        for label, kind, tok, workers in cases:
            if kind not in inputs:
                inputs[kind] = f"in-{kind}-{rows}.jsonl"
                make_input(work / inputs[kind], rows, kind)
            name = f"{label}-{tok}-{workers}-{rows}"
            column = {"messages_column": "messages"} if kind == "messages" else {"input_ids_column": "input_ids"}
            write_job(work, name, inputs[kind], str(models[tok]), column, workers)
            runs = []
            for _ in range(args.repeats):
                out = subprocess.run([sys.executable, __file__, "--child", str(work), name], check=True,
                                     capture_output=True, text=True, cwd=ROOT)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                subprocess.run(["rm", "-rf", str(work / f"out-{name}")], check=True)
            rate = statistics.median(r["rows"] / r["seconds"] for r in runs)
            table.append((label, tok if kind == "messages" else "-", workers, rows, rate,
                          max(r["peak_rss_mb"] for r in runs), max(r["workers_peak_rss_mb"] for r in runs)))
    print(f"{'input':>9} {'tokenizer':>9} {'workers':>7} {'rows':>9} {'rows/s':>8} {'peak RSS MB':>11} "
          f"{'worker RSS MB':>13}")
    for label, tok, workers, rows, rate, rss, wrss in table:
        print(f"{label:>9} {tok:>9} {workers:>7} {rows:>9} {rate:>8.0f} {rss:>11.0f} {wrss if workers else 0:>13.0f}")


if __name__ == "__main__":
    main()
