"""dflash-batch's side of benchmarks/vs_vllm.py: the engine as `dflash-batch run` builds it on a
CPU host (round compiled), on the peer benchmark's checkpoint and prompts; the same measurement
../shared/peers/vllm_cpu/run_vllm.py makes: 32 prompts, 128 new tokens, greedy, no EOS.

python benchmarks/peer_ours.py --model DIR [--draft DIR] --prompts FILE [--reps 4] --out result.json

Start-up (loading, and compiling the round in a first, untimed pass) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.pair import attach_drafter
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.models.loader import load_model
from dflash_batch.plan.buckets import Bucket


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--eager", action="store_true", help="do not compile the round")
    ap.add_argument("--out")
    a = ap.parse_args()
    t0 = time.perf_counter()
    target, drafter = load_model(a.model), None
    if a.draft:
        drafter = load_model(a.draft)
        attach_drafter(target, drafter)
    engine = Engine(target, drafter, compile=not a.eager)
    prompts = json.load(open(a.prompts))
    bucket = Bucket(0, "0-512", 512, 32, True, None)

    def generate():
        reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=a.max_tokens, seed=i))
                for i, p in enumerate(prompts)]
        return list(engine.generate(reqs, bucket))

    generate()  # compiles the round
    startup = time.perf_counter() - t0
    runs, outs = [], []
    for r in range(a.reps):
        t1 = time.perf_counter()
        outs = generate()
        dt = time.perf_counter() - t1
        n = sum(len(c.token_ids) for c in outs)
        runs.append({"rep": r, "wall_s": dt, "gen_tokens": n, "tok_per_s": n / dt})
    acc = None
    if outs[0].spec is not None:
        acc = 1 + sum(c.spec.accepted for c in outs) / sum(c.spec.rounds for c in outs)
    result = {"engine": "dflash-batch", "startup_s": startup, "runs": runs, "acc_len": acc,
              "median_tok_per_s": statistics.median(x["tok_per_s"] for x in runs[1:] or runs),
              "threads": torch.get_num_threads(), "tokens": {c.key[0]: c.token_ids for c in outs}}
    if a.out:
        json.dump(result, open(a.out, "w"))
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}))


if __name__ == "__main__":
    main()
