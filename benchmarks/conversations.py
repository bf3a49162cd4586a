"""Conversations on the demo pair: later turns kept in their rows' caches vs prefilled whole each
turn (as a single-turn engine must: engine.turn_caches false), side by side in one process.

N conversations (the demo job's word problems, cycled, each with its own id) of T assistant turns:
the problem, then T - 1 scripted user turns (input.followups_column) through the demo's chat
template, greedy. Each mode runs the same job through `run_job` (the real loader, bucketing, the
engine; the demo job's buckets: a conversation that outgrows 256 tokens moves to the 1024 bucket
and is prefilled there whole, in both modes). Reported: the prompt tokens the target ran (the
rows' turn_prompt_tokens, summed), per turn and in all; wall time; tokens generated; whether every
row's tokens are identical between the modes (they must be: greedy, the same history). Medians
over --repeats, modes alternating.

usage: python benchmarks/conversations.py [--conversations 200] [--turns 4] [--repeats 1]
                                          [--max-new-tokens 48] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_batch.build import build_engine  # noqa: E402
from dflash_batch.job import parse_job  # noqa: E402
from dflash_batch.plan.shards import Shard  # noqa: E402
from dflash_batch.runner import run_job  # noqa: E402
from dflash_batch.io.ledger import part_files  # noqa: E402

FOLLOWUPS = ["Explain how you got that, one step at a time.", "Check the answer another way.",
             "Now give only the final number.", "Thank you. What would change with twice as many?"]


def job(out: Path, inputs: Path, keep: bool, max_new: int) -> dict:
    doc = yaml.safe_load((ROOT / "jobs/demo.yaml").read_text())
    doc["input"].update(paths=[str(inputs)], followups_column="more", workers=0)
    doc["model"].update(target=str(ROOT / "jobs/demo/models/target"), drafter=str(ROOT / "jobs/demo/models/drafter"))
    doc["engine"]["turn_caches"] = keep
    doc["sampling"]["max_new_tokens"] = max_new
    doc["output"].update(dir=str(out), include_token_ids=True)
    return doc


def run(doc: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    run_job(parse_job(doc, "<benchmark>", ROOT), lambda j, tok: build_engine(j, tok), Shard(0, 1), progress=False)
    seconds = time.perf_counter() - started
    rows = [r for f in part_files(Path(doc["output"]["dir"])) for r in pq.read_table(f).to_pylist()]
    return seconds, {r["row_id"]: r for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    problems = [json.loads(line) for line in (ROOT / "jobs/demo/prompts.jsonl").read_text().splitlines()]
    work = Path(tempfile.mkdtemp(prefix="conversations-"))
    inputs = work / "conversations.jsonl"
    inputs.write_text("".join(json.dumps({**problems[i % len(problems)], "id": f"c{i:04d}",
                                          "more": FOLLOWUPS[:args.turns - 1]}) + "\n"
                              for i in range(args.conversations)))
    times: dict[bool, list[float]] = {True: [], False: []}
    rows: dict[bool, dict] = {}
    for r in range(args.repeats):
        for keep in (True, False):
            seconds, rows[keep] = run(job(work / f"out-{keep}-{r}", inputs, keep, args.max_new_tokens))
            times[keep].append(seconds)
    same = all(rows[True][k]["turn_token_ids"] == rows[False][k]["turn_token_ids"] for k in rows[True])
    print(f"{args.conversations} conversations x {args.turns} turns, demo pair, greedy, max_new_tokens "
          f"{args.max_new_tokens}, {torch.get_num_threads()} thread(s), medians of {args.repeats}; "
          f"tokens identical in both modes: {same}")
    print()
    print("| turn | prompt tokens run, kept caches | prefilled whole each turn | ratio |")
    print("|---|---|---|---|")
    sums = {keep: [sum(r["turn_prompt_tokens"][t] for r in rows[keep].values() if len(r["turn_prompt_tokens"]) > t)
                   for t in range(args.turns)] for keep in (True, False)}
    for t in range(args.turns):
        print(f"| {t + 1} | {sums[True][t]:,} | {sums[False][t]:,} | {sums[False][t] / sums[True][t]:.1f}x |")
    total = {keep: sum(sums[keep]) for keep in (True, False)}
    print(f"| all | {total[True]:,} | {total[False]:,} | {total[False] / total[True]:.1f}x |")
    print()
    generated = sum(r["completion_tokens"] for r in rows[True].values())
    # a turn moved to a larger bucket is prefilled whole there, as every later turn is without kept caches
    moved = sum(any(a == b for a, b in zip(r["turn_prompt_tokens"][1:], rows[False][k]["turn_prompt_tokens"][1:]))
                for k, r in rows[True].items())
    wall = {keep: statistics.median(times[keep]) for keep in (True, False)}
    print("| mode | wall s | tokens generated / s |")
    print("|---|---|---|")
    for keep, name in ((True, "kept caches"), (False, "prefilled whole each turn")):
        print(f"| {name} | {wall[keep]:.1f} | {generated / wall[keep]:.0f} |")
    print(f"\nspeed-up {wall[False] / wall[True]:.2f}x (wall time includes loading the models, once a mode); "
          f"{generated:,} tokens generated; {moved} conversations moved to the 1024 bucket when a turn outgrew 256")


if __name__ == "__main__":
    main()
