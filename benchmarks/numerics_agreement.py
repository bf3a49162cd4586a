"""How often tokens change with settings that should not change them, on the demo pair.

The reference is greedy speculative decoding in float32 with max_num_seqs 1. Each other case
decodes the same prompts (all 72 of the demo job) and is compared prompt by prompt: a prompt
"agrees" when its tokens are identical; once two outputs part, every later token of the longer
one counts as differing. float32 results depend in their last bits on the batch's shape (GEMM
blocking, MoE experts run on batch-sized subsets), so a near-tie can resolve two ways; bfloat16
keeps 8 bits. Coins are per position (kernels/coins.py), so sampled outputs part only where
the logits do.

usage: python benchmarks/numerics_agreement.py [--threads 2] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.pair import attach_drafter  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.models.loader import load_model  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402
from dflash_batch.tokenizer import Tokenizer, stop_token_ids  # noqa: E402

# (label, dtype, max_num_seqs, speculative, temperature); the first of each temperature is the reference
CASES = [
    ("float32, batch 1 (reference)", torch.float32, 1, True, 0.0),
    ("float32, batch 16", torch.float32, 16, True, 0.0),
    ("float32, batch 16, target-only", torch.float32, 16, False, 0.0),
    ("float64, batch 1", torch.float64, 1, True, 0.0),
    ("bfloat16, batch 1", torch.bfloat16, 1, True, 0.0),
    ("bfloat16, batch 16", torch.bfloat16, 16, True, 0.0),
    ("T=1: float32, batch 1 (reference)", torch.float32, 1, True, 1.0),
    ("T=1: float32, batch 16", torch.float32, 16, True, 1.0),
    ("T=1: bfloat16, batch 16", torch.bfloat16, 16, True, 1.0),
]


def differing(ref: list[int], got: list[int]) -> int:
    """Tokens from the first position where the two outputs part to the end of the longer."""
    same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return max(len(ref), len(got)) - same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=ROOT / "jobs/demo/models")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = Tokenizer(args.models / "target")
    eos = tuple(stop_token_ids(args.models / "target", tok))
    rows = [json.loads(line) for line in (ROOT / "jobs/demo/prompts.jsonl").read_text().splitlines()]
    prompts = tok.encode_batch([tok.render_chat(r["messages"], {}) for r in rows], add_special_tokens=False)
    pairs: dict[torch.dtype, tuple] = {}

    def decode(dtype: torch.dtype, seqs: int, spec: bool, temperature: float) -> list[list[int]]:
        if dtype not in pairs:
            target, drafter = load_model(args.models / "target", dtype), load_model(args.models / "drafter", dtype)
            attach_drafter(target, drafter)
            pairs[dtype] = (target, drafter)
        target, drafter = pairs[dtype]
        engine = Engine(target, drafter if spec else None, dtype=dtype)
        params = dict(temperature=temperature, top_p=0.95 if temperature else 1.0,
                      max_new_tokens=args.max_new_tokens, stop_token_ids=eos)
        reqs = [Request((str(i), 0), p, SamplingParams(seed=i, **params)) for i, p in enumerate(prompts)]
        done = {c.key: c.token_ids for c in engine.generate(reqs, Bucket(0, "0-1024", 1024, seqs, spec, None))}
        return [done[r.key] for r in reqs]

    print(f"{len(prompts)} prompts, greedy unless T=1, {args.threads} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"| case | prompts identical | tokens differing | rate |\n|---|---|---|---|")
    ref = None
    for label, dtype, seqs, spec, temperature in CASES:
        out = decode(dtype, seqs, spec, temperature)
        if "reference" in label:
            ref = out
            print(f"| {label} | - | {sum(map(len, out))} tokens | - |")
            continue
        same = sum(a == b for a, b in zip(ref, out))
        diff = sum(differing(a, b) for a, b in zip(ref, out))
        total = sum(map(len, ref))
        print(f"| {label} | {same}/{len(ref)} | {diff} of {total} | {diff / total:.2%} |")


if __name__ == "__main__":
    main()
