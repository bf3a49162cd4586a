"""Per-row draft counts (engine/row_drafts.py) against the best single number of drafts k chosen in
hindsight, side by side in one run, on the CPU (where a round's time grows with the tokens it
verifies).

Three cases, all on the demo pair (jobs/demo/models): (a) the demo job's prompts (word problems
of three kinds and few-shot prompts, which accept least), greedy; (b) the same prompts, every
other request sampled at the model card's production settings (temperature 1.0, top_p 0.95);
(c) every other request a prompt of random tokens (20-80 of them, seeded), greedy: rows the
drafter predicts well (acceptance length ~6 at k = 7) beside rows it does not (~1.5). For each
batch size
(max_num_seqs) max(batch, --min-requests) requests, cycled over the prompts (each with its own
seed), are decoded by one engine in these modes, in turn: every pinned k (speculation {drafts:
k}; 0: target-only rounds, the drafter's context kept), `speculation: {per_row: false}` (auto, one
k a round) and `speculation: auto` (per row). Each auto run follows a one-request run of its bucket
(untimed: the round costs timed the first time) and forgets what that learnt, so the timed run
learns its acceptance and calibration as a run would. Medians over --repeats; "spread" is (max -
min) / median of per-row's and the best k's repeats, the larger: ratios closer to 1 than it are
within the noise. "k=7 trimmed" is what a perfect trim of k = 7's drafts would reach: its run
had each round verified only the drafts it kept (`trimmed`); below the best k, no choice of
drafts per row in rounds that all draft can reach the best k there. Then the cost curve the
choice used: a round's time by drafts verified, at each batch size (the schedule's table, timed
on padding rows: what row_widths reads).

usage: python benchmarks/row_drafts.py [--repeats 3] [--threads 1] [--max-new-tokens 64]
                                       [--batches 1,16,64,128] [--cases a,b] [--min-requests 16]
"""

from __future__ import annotations

import argparse
import random
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
from dflash_batch.engine.row_drafts import seconds_at  # noqa: E402
from dflash_batch.engine.schedule import Schedule  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402

BATCHES = (1, 16, 64, 128)
FIXED = range(1, 8)  # k = 0 (target-only rounds) was never the best: 0.65-0.82x k = 1 (docs/figures.md)
AUTO = ("one k", "per row")
ROUNDS: list[tuple[int, float, int, int]] = []  # the rounds of the decode running: (rows, seconds, kept, verified)


def listen() -> None:
    """Keep each round's rows, seconds and drafts kept and verified (Schedule.record: once a round)."""
    record = Schedule.record

    def listened(self, n, k, seconds, accepted, verified, *rest):
        ROUNDS.append((n, seconds, sum(accepted), sum(verified)))
        return record(self, n, k, seconds, accepted, verified, *rest)
    Schedule.record = listened


def trimmed(tokens: int, seconds: float, rounds: list[tuple[int, float, int, int]], schedule: Schedule) -> float:
    """Tokens/s of a k = 7 run had each round verified only the drafts it kept: each round's time
    scaled along the cost curve from the drafts it verified to those it kept, the rest (prefill)
    as it was. A row emits its kept drafts and the target's token after them either way, so no
    choice of drafts per row emits more in a drafting round for less."""
    saved = 0.0
    for n, took, kept, verified in rounds:
        size, costs = schedule.curve(n)
        at = seconds_at(torch.tensor([kept, verified]), size, torch.tensor(costs, dtype=torch.float64)).tolist()
        saved += took * (1 - at[0] / at[1])
    return tokens / (seconds - saved)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=ROOT / "jobs/demo/models")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--cases", default="a,b,c")
    ap.add_argument("--min-requests", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    listen()
    target, drafter, tok, eos, prompts = load_demo(args.models, every_dataset=True)
    greedy = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=eos)
    sampled = dict(greedy, temperature=1.0, top_p=0.95)
    rng = random.Random(0)
    noise = [[rng.randrange(5, tok.vocab_size) for _ in range(rng.randrange(20, 81))] for _ in range(len(prompts))]
    def demo(i: int) -> list[int]:
        return prompts[i % len(prompts)]

    cases = {"a": ("(a) demo pair, the demo's prompts, greedy", lambda i: (demo(i), greedy)),
             "b": ("(b) demo pair, every other request sampled (temperature 1.0, top_p 0.95)",
                   lambda i: (demo(i), sampled if i % 2 else greedy)),
             "c": ("(c) demo pair, every other request a prompt of random tokens, greedy",
                   lambda i: (noise[i % len(noise)] if i % 2 else demo(i), greedy))}
    curves = {}
    for case in args.cases.split(","):
        name, settings = cases[case]
        engine = Engine(target, drafter, tok.decode)  # one engine: buckets of the same shape keep their caches

        def decode(bucket: Bucket, count: int) -> float:
            reqs = [Request((str(i), 0), prompt, SamplingParams(seed=i, **params))
                    for i, (prompt, params) in ((i, settings(i)) for i in range(count))]
            ROUNDS.clear()
            t0 = time.perf_counter()
            out = list(engine.generate(reqs, bucket))
            return sum(len(c.token_ids) for c in out), time.perf_counter() - t0

        print(f"\n{name}: tokens/s, median of {args.repeats}")
        print(f"{'batch':>5} " + " ".join(f"{f'k={k}':>6}" for k in FIXED) + f" {'one k':>6} {'per row':>7} "
              f"{'best k':>6} {'per row/best':>12} {'per row/one k':>13} {'k=7 trimmed/best':>17} {'spread':>6}  "
              "drafts verified per kept (per row; best k)")
        for batch in map(int, args.batches.split(",")):
            count = max(batch, args.min_requests)
            buckets = {k: Bucket(0, f"k{k}", 1024, batch, True, None, k) for k in FIXED}
            buckets |= {mode: Bucket(0, mode, 1024, batch, "auto", None, None, mode == "per row") for mode in AUTO}
            runs = {mode: [] for mode in buckets}
            kept, whole = {}, []  # whole: each repeat's k = 7 run (tokens, seconds, its rounds)
            for _ in range(args.repeats):
                for mode, bucket in buckets.items():  # in turn: a drift of the machine touches each alike
                    decode(bucket, 1)  # warm-up: the shape allocated; auto's round costs timed once
                    if mode in AUTO:
                        engine.schedules[mode].forget_run()
                    tokens, seconds = decode(bucket, count)
                    runs[mode].append(tokens / seconds)
                    kept[mode] = engine.schedules[bucket.name].stats()["verified_per_kept"]
                    if mode == max(FIXED):
                        whole.append((tokens, seconds, list(ROUNDS)))
            rates = {mode: statistics.median(r) for mode, r in runs.items()}
            trim = statistics.median(trimmed(*run, engine.schedules["per row"]) for run in whole)
            best = max(FIXED, key=rates.get)
            spread = max((max(runs[m]) - min(runs[m])) / rates[m] for m in (best, "per row"))
            print(f"{batch:>5} " + " ".join(f"{rates[k]:>6.0f}" for k in FIXED)
                  + f" {rates['one k']:>6.0f} {rates['per row']:>7.0f} {best:>6} "
                  f"{rates['per row'] / rates[best]:>12.2f} {rates['per row'] / rates['one k']:>13.2f} "
                  f"{trim / rates[best]:>17.2f} {spread:>6.2f}"
                  f"  {kept['per row']['per row']}; {kept[best]['one k']}", flush=True)
            schedule = engine.schedules["per row"]
            curves[batch] = schedule.stats()["cost_ms"]
            for mode in buckets:  # the next batch size is a new bucket
                engine.schedules.pop(buckets[mode].name, None)

    print("\nThe cost curve the choice used: ms a round of `size` rows at k = 0 .. 7 drafts a row (the "
          "schedule's table, timed on padding rows, with the correction the rounds run made; k = 0 drafts "
          "nothing; per row reads k >= 1, never falling)")
    for batch, by_size in curves.items():
        size = str(max(map(int, by_size)))
        print(f"  batch {batch:>3} (table size {size}): " + " ".join(f"{c:.1f}" for c in by_size[size]))


if __name__ == "__main__":
    main()
