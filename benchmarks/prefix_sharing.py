"""Prefix sharing: n = 8 samples of 2k-token prompts, prefilled once per prompt vs once per
sample; and prompts that share a long head (a system prompt, few-shot examples), prefilled
once (plan/heads.py, engine/heads.py) vs once per prompt.

The demo pair (jobs/demo/models) decodes --prompts distinct prompts of --length tokens (word
problems joined into one long user message), n samples each at temperature 1.0, with
engine.share_prompts off and on, side by side in one process (medians over --repeats), at
max_num_seqs = n (a prompt's later samples enter as rows free up) and = prompts x n (all at
once). Then the synthesis case: --rows prompts of one --few-shot-token head (word problems and
their answers) and distinct --row-tail-token tails (a question each) on the demo Kimi-K3 pair,
speculation on, greedy, max_num_seqs --seqs; then --heads prompts made of one --head-token head
and distinct --tail-token tails on a random Qwen3 (hidden 256, 8 layers), target-only, greedy.
Prints prompt tokens the target ran, wall time, generated tokens per second and whether the
outputs agree.

usage: python benchmarks/prefix_sharing.py [--prompts 4] [--n 8] [--length 2048] [--repeats 3]
                                          [--rows 256] [--few-shot 2048] [--row-tail 64] [--seqs 32]
                                          [--heads 32] [--head 1536] [--tail 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.pair import attach_drafter  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.models.loader import load_model  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402
from dflash_batch.tokenizer import Tokenizer  # noqa: E402
from dflash_batch.testing.checkpoints import qwen3_checkpoint  # noqa: E402


def long_prompts(tok: Tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` distinct chat prompts of about `length` tokens: the demo's word problems, from a
    different starting problem each, joined into one user message and cut to `length` tokens."""
    rows = [json.loads(line) for line in (ROOT / "jobs/demo/prompts.jsonl").read_text().splitlines()]
    problems = [m["content"] for r in rows for m in r["messages"] if m["role"] == "user"]
    prompts = []
    for i in range(count):
        text = "\n\n".join(problems[(i + j) % len(problems)] for j in range(len(problems)))
        ids = tok.encode_batch([tok.render_chat([{"role": "user", "content": text * 4}], {})],
                               add_special_tokens=False)[0]
        assert len(ids) >= length, f"only {len(ids)} tokens"
        prompts.append(ids[:length])
    return prompts


def few_shot_prompts(tok: Tokenizer, rows: int, head: int, tail: int) -> list[list[int]]:
    """`rows` prompts: one `head`-token block of the demo's word problems, then `tail` tokens
    of a question of their own (a problem and its row number, cut or padded to `tail` tokens)."""
    shared = long_prompts(tok, 1, head)[0]
    rows_ = [json.loads(line) for line in (ROOT / "jobs/demo/prompts.jsonl").read_text().splitlines()]
    problems = [m["content"] for r in rows_ for m in r["messages"] if m["role"] == "user"]
    prompts = []
    for i in range(rows):
        ids = tok.encode_batch([f"Question {i}: {problems[i % len(problems)]} " * 8], add_special_tokens=False)[0]
        assert len(ids) >= tail, f"only {len(ids)} tokens"
        prompts.append(shared + ids[:tail])
    assert len({tuple(p) for p in prompts}) == rows
    return prompts


def side_by_side(engines: dict[bool, Engine], reqs: list[Request], bucket: Bucket, repeats: int, label: str) -> None:
    """Decode `reqs` with sharing off and on, interleaved (the machine's drift hits both alike);
    print a table row for each."""
    seconds, ran, outputs = {s: [] for s in engines}, {}, {}
    for _ in range(repeats):
        for share, engine in engines.items():
            before, t0 = engine.prefill_tokens, time.perf_counter()
            done = list(engine.generate(iter(reqs), bucket))
            seconds[share].append(time.perf_counter() - t0)
            ran[share] = engine.prefill_tokens - before
            outputs[share] = {c.key: c.token_ids for c in done}
    # float32: a copied or forked prompt's logits were computed beside other neighbours, so a
    # near-tie may resolve apart
    same = sum(outputs[True][k] == outputs[False][k] for k in outputs[False])
    ratio = statistics.median(seconds[False]) / statistics.median(seconds[True])
    for share in engines:
        sec = statistics.median(seconds[share])
        tokens = sum(map(len, outputs[share].values()))
        print(f"| {label} | {'on' if share else 'off'} | {ran[share]} | {sec:.2f} | {tokens / sec:.0f} | "
              f"{f'{ratio:.2f}x' if share else ''} | {f'{same}/{len(outputs[False])}' if share else ''} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=ROOT / "jobs/demo/models")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--few-shot", type=int, default=2048)
    ap.add_argument("--row-tail", type=int, default=64)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--skip-samples", action="store_true", help="only the shared-head cases")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head", type=int, default=1536)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, medians of {args.repeats}; {args.new} new tokens per sample")
    print("| case | share_prompts | prompt tokens run | wall s | generated tok/s | off/on | same outputs |")
    print("|---|---|---|---|---|---|---|")

    target, drafter = load_model(args.models / "target"), load_model(args.models / "drafter")
    attach_drafter(target, drafter)
    tok = Tokenizer(args.models / "target")
    prompts = long_prompts(tok, args.prompts, args.length)
    reqs = [Request((str(i), j), p, SamplingParams(temperature=1.0, max_new_tokens=args.new, seed=100 * i + j))
            for i, p in enumerate(prompts) for j in range(args.n)]
    engines = {share: Engine(target, drafter, tok.decode, share_prompts=share) for share in (False, True)}
    for rows in () if args.skip_samples else (args.n, args.n * args.prompts):
        bucket = Bucket(0, "0-4096", args.length + args.new + 64, rows, True, None)
        side_by_side(engines, reqs, bucket, args.repeats,
                     f"demo pair, {args.prompts} prompts x {args.length} tokens, n = {args.n}, T = 1, "
                     f"max_num_seqs {rows}")

    few_shot = few_shot_prompts(tok, args.rows, args.few_shot, args.row_tail)
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=args.new)) for i, p in enumerate(few_shot)]
    bucket = Bucket(0, "0-4096", args.few_shot + args.row_tail + args.new + 64, args.seqs, True, None)
    side_by_side(engines, reqs, bucket, args.repeats,
                 f"demo Kimi-K3 pair, speculation on, {args.rows} prompts = one {args.few_shot}-token few-shot head "
                 f"+ {args.row_tail}-token tails, T = 0, max_num_seqs {args.seqs}")

    with tempfile.TemporaryDirectory() as d:
        qwen3 = load_model(qwen3_checkpoint(Path(d) / "qwen3", vocab=1000, hidden=256, layers=8, heads=8,
                                            kv_heads=4, head_dim=32, inter=768))
    gen = torch.Generator().manual_seed(0)
    head = torch.randint(0, 1000, (args.head,), generator=gen).tolist()
    reqs = [Request((str(i), 0), head + torch.randint(0, 1000, (args.tail,), generator=gen).tolist(),
                    SamplingParams(max_new_tokens=args.new)) for i in range(args.heads)]
    engines = {share: Engine(qwen3, None, share_prompts=share) for share in (False, True)}
    bucket = Bucket(0, "0-4096", args.head + args.tail + args.new + 64, args.n, False, None)
    side_by_side(engines, reqs, bucket, args.repeats,
                 f"random Qwen3, {args.heads} prompts = one {args.head}-token head + {args.tail}-token tails, "
                 f"T = 0, max_num_seqs {args.n}")


if __name__ == "__main__":
    main()
