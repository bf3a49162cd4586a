"""How many drafts a round should verify, by batch size: tokens/s of the demo pair at each fixed
verify width, side by side in one run (the measurement issue 25's schedule is to be decided from).

For batch sizes 1, 4, 16 and 64 (max_num_seqs; the prompts repeated to fill the batch), the demo
job's word problems are decoded greedily with the drafter verifying k drafts a round (the bucket's
block_size k + 1: the drafter proposes a block of that width) for k = 1 .. 7, and target-only
(k = 0). Prints tokens/s, the acceptance length and the best k of each batch size. Medians over
--repeats runs in one process.

usage: python benchmarks/spec_schedule.py [--repeats 3] [--threads 1] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.demo_pair import load_demo  # noqa: E402
from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402

BATCHES = (1, 4, 16, 64)
DRAFTS = range(8)  # 0: target-only


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=ROOT / "jobs/demo/models")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter, tok, eos, prompts = load_demo(args.models)
    engines = {False: Engine(target, None, tok.decode), True: Engine(target, drafter, tok.decode)}

    def decode(batch: int, drafts: int) -> tuple[float, float | None]:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=eos)
        reqs = [Request((str(i), 0), prompts[i % len(prompts)], params) for i in range(max(batch, len(prompts)))]
        bucket = Bucket(0, "0-1024", 1024, batch, drafts > 0, drafts + 1 if drafts else None)
        t0 = time.perf_counter()
        out = list(engines[drafts > 0].generate(reqs, bucket))
        sec = time.perf_counter() - t0
        rounds = sum(c.spec.rounds for c in out if c.spec)
        acc = 1 + sum(c.spec.accepted for c in out if c.spec) / rounds if rounds else None
        return sum(len(c.token_ids) for c in out) / sec, acc

    print(f"{'batch':>5} " + " ".join(f"{f'k={k} tok/s':>11}" for k in DRAFTS) + f" {'best k':>6} {'acc_len at k=7':>14}")
    for batch in BATCHES:
        rates, acc = {}, None
        for k in DRAFTS:
            runs = [decode(batch, k) for _ in range(args.repeats)]
            rates[k] = statistics.median(r for r, _ in runs)
            acc = runs[-1][1] if k == 7 else acc
        best = max(rates, key=rates.get)
        print(f"{batch:>5} " + " ".join(f"{rates[k]:>11.0f}" for k in DRAFTS) + f" {best:>6} {acc:>14.2f}")


if __name__ == "__main__":
    main()
