"""Speculation by batch size: tokens/s of always-off, every fixed number of verified drafts k
(k = 7: always-on) and `speculation: auto` (engine/schedule.py), side by side in one run.

Three pairs: (a) the demo pair (jobs/demo/models) on the demo job's word problems; (b) a tiny
Qwen3 with a random DFlash drafter, which almost never agrees with it (acceptance ~0); (c) its
constant-head twin, the same weights with the head zeroed, so the target always picks token 0
and so does the drafter (every draft accepted). For batch sizes 1, 4, 16 and 64 (max_num_seqs),
max(2 x batch, --min-requests) requests are decoded greedily by one engine, the modes in turn. Each timed
run follows a one-request generate of its bucket (untimed: allocation, and the first time, auto's
round costs timed on padding rows); auto's acceptance is then forgotten, so the timed run learns
it as a run would. Medians over --repeats; "spread" is (max - min) / median of auto's and the
best fixed k's repeats, the larger: ratios closer to 1 than it are within the noise.

usage: python benchmarks/spec_schedule.py [--repeats 3] [--threads 1] [--max-new-tokens 64] [--pairs a,b,c]
                                          [--batches 1,4,16,64] [--min-requests 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.demo_pair import load_demo  # noqa: E402
from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.pair import attach_drafter  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.models.loader import load_model  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402
from dflash_batch.testing.checkpoints import dflash_checkpoint, qwen3_checkpoint  # noqa: E402

BATCHES = (1, 4, 16, 64)
FIXED = range(8)  # 0: always-off (target-only), 7: always-on
VOCAB = 2048


def tiny_pairs(directory: Path) -> dict[str, tuple]:
    """(b) and (c): (target, drafter, stop ids, prompts) each."""
    target_dir = qwen3_checkpoint(directory / "target", vocab=VOCAB, hidden=256, layers=4, heads=4, kv_heads=2,
                                  head_dim=64, inter=768, peaked=False)
    const_dir = qwen3_checkpoint(directory / "const", vocab=VOCAB, hidden=256, layers=4, heads=4, kv_heads=2,
                                 head_dim=64, inter=768, peaked=False)
    weights = load_file(const_dir / "model.safetensors")
    weights["lm_head.weight"].zero_()
    save_file(weights, str(const_dir / "model.safetensors"), metadata={"format": "pt"})
    drafter_dir = dflash_checkpoint(directory / "drafter", version=1, vocab=VOCAB, hidden=256, layers=1, heads=4,
                                    kv_heads=2, head_dim=64, inter=768, target_layer_ids=(1, 2))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=gen).tolist() for n in torch.randint(20, 120, (16,))]
    out = {}
    for name, path in (("(b) tiny Qwen3, random drafter", target_dir), ("(c) its constant-head twin", const_dir)):
        target, drafter = load_model(path), load_model(drafter_dir)
        attach_drafter(target, drafter)
        out[name] = (target, drafter, (), prompts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=ROOT / "jobs/demo/models")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--pairs", default="a,b,c")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--min-requests", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pairs = {}
    if "a" in args.pairs:
        target, drafter, tok, eos, prompts = load_demo(args.models)
        pairs["(a) demo pair"] = (target, drafter, eos, prompts)
    scratch = tempfile.TemporaryDirectory()
    if "b" in args.pairs or "c" in args.pairs:
        pairs |= {k: v for k, v in tiny_pairs(Path(scratch.name)).items() if k[1] in args.pairs.split(",")}

    for name, (target, drafter, eos, prompts) in pairs.items():
        params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=eos)

        def decode(engine: Engine, bucket: Bucket, count: int) -> tuple[float, list]:
            reqs = [Request((str(i), 0), prompts[i % len(prompts)], params) for i in range(count)]
            t0 = time.perf_counter()
            out = list(engine.generate(reqs, bucket))
            return sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0), out

        print(f"\n{name}: greedy tokens/s, median of {args.repeats}")
        print(f"{'batch':>5} " + " ".join(f"{f'k={k}':>6}" for k in FIXED) + f" {'auto':>6} {'best k':>6} "
              f"{'auto/best':>9} {'auto/on':>7} {'auto/off':>8} {'spread':>6}  auto's k (share of rounds)")
        engine = Engine(target, drafter)  # one engine: a bucket of the same shape keeps its caches
        for batch in map(int, args.batches.split(",")):
            count = max(2 * batch, args.min_requests)
            modes = [*FIXED, "auto"]
            buckets = {mode: Bucket(0, f"{mode}", 1024, batch, "auto" if mode == "auto" else mode > 0, None,
                                    mode if mode not in (0, 7, "auto") else None) for mode in modes}
            runs = {mode: [] for mode in modes}
            for _ in range(args.repeats):
                for mode in modes:  # in turn, so a drift of the machine's speed touches each alike
                    if mode == "auto" and "auto" not in engine.schedules:
                        decode(engine, buckets[mode], 1)  # auto's round costs, timed once
                    # Warm-up: the bucket's shape allocated (auto's: the always-on bucket's, the same).
                    decode(engine, buckets[7 if mode == "auto" else mode], 1)
                    if mode == "auto":
                        engine.schedules["auto"].forget_run()
                    runs[mode].append(decode(engine, buckets[mode], count)[0])
            rates = {mode: statistics.median(r) for mode, r in runs.items()}
            schedule = engine.schedules["auto"]
            used = Counter()
            for by_k in schedule.rounds.values():
                used.update({int(k): n for k, n in by_k.items()})
            total = sum(used.values()) or 1
            picks = ", ".join(f"{k}: {n / total:.0%}" for k, n in sorted(used.items())) + (
                " (then off)" if schedule.off else "")
            engine.schedules.clear()  # the next batch size is a new bucket
            best = max(FIXED, key=rates.get)
            spread = max((max(runs[m]) - min(runs[m])) / rates[m] for m in (best, "auto"))
            print(f"{batch:>5} " + " ".join(f"{rates[k]:>6.0f}" for k in FIXED) + f" {rates['auto']:>6.0f} {best:>6} "
                  f"{rates['auto'] / rates[best]:>9.2f} {rates['auto'] / rates[7]:>7.2f} "
                  f"{rates['auto'] / rates[0]:>8.2f} {spread:>6.2f}  {picks}", flush=True)


if __name__ == "__main__":
    main()
