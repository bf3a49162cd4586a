"""Measure a trained demo pair with the product engine: greedy speculative decoding against
target-only decoding on held-out word problems.

    python -m recipes.demo.evaluate --models jobs/demo/models [--prompts 16] [--batch 1]

Reports acc_len (tokens per verify round: accepted drafts + the target's own token, as the
job's output rows count them), tokens/s of both runs, whether the two runs generated the same
tokens (greedy speculative decoding must not change the output), and how many final answers
are arithmetically right (a sanity check of the target, not of the drafter).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.engine.pair import attach_drafter
from dflash_batch.models.loader import load_model
from dflash_batch.plan.buckets import Bucket
from dflash_batch.tokenizer import Tokenizer, stop_token_ids
from recipes.demo import data

EVAL_SEED = 10 ** 9  # far from the training streams' seeds


def load_pair(models: str | Path):
    models = Path(models)
    target, drafter = load_model(models / "target"), load_model(models / "drafter")
    attach_drafter(target, drafter)
    return target, drafter


def _run(engine: Engine, prompts: list[list[int]], stop: tuple[int, ...], max_new: int, batch: int,
         speculation: bool) -> tuple[list, float]:
    bucket = Bucket(0, "demo", max(len(p) for p in prompts) + max_new, batch, speculation, None)
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=max_new, stop_token_ids=stop))
            for i, p in enumerate(prompts)]
    start = time.perf_counter()
    done = {c.key: c for c in engine.generate(reqs, bucket)}
    return [done[r.key] for r in reqs], time.perf_counter() - start


def measure(models: str | Path, prompts: int = 16, max_new_tokens: int = 96, batch: int = 1,
            seed: int = EVAL_SEED) -> dict:
    models = Path(models)
    tok = Tokenizer(models / "target")
    problems = data.eval_problems(seed, prompts)
    ids = [tok.encode_batch([tok.render_chat([{"role": "user", "content": p.question}], {})], False)[0]
           for p in problems]
    stop = tuple(stop_token_ids(models / "target", tok))
    target, drafter = load_pair(models)
    spec, spec_s = _run(Engine(target, drafter, tok.decode), ids, stop, max_new_tokens, batch, True)
    base, base_s = _run(Engine(target, None, tok.decode), ids, stop, max_new_tokens, batch, False)
    rounds = sum(c.spec.rounds for c in spec)
    accepted = sum(c.spec.accepted for c in spec)
    tokens = sum(len(c.token_ids) for c in spec)
    hist = [sum(c.spec.histogram[n] for c in spec) for n in range(drafter.block_size)]
    right = sum(data.final_answer(c.text) == data.final_answer(p.answer) for c, p in zip(spec, problems))
    return dict(prompts=prompts, batch=batch, tokens=tokens, rounds=rounds,
                acc_len=round((accepted + rounds) / max(rounds, 1), 3), accepted_histogram=hist,
                spec_tok_s=round(tokens / spec_s, 1),
                target_tok_s=round(sum(len(c.token_ids) for c in base) / base_s, 1),
                speedup=round(base_s / spec_s, 2),
                same_output=all(a.token_ids == b.token_ids for a, b in zip(spec, base)),
                stopped=sum(c.finish_reason == "stop" for c in spec), answers_right=right,
                sample=spec[0].text)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m recipes.demo.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True, help="directory with target/ and drafter/")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.models, args.prompts, args.max_new_tokens, args.batch)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
