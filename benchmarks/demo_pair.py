"""The demo pair (jobs/demo/models): speculative vs target-only decoding, side by side.

For batch sizes 1, 4 and 16 (max_num_seqs), the same prompts (the demo job's word problems) are
decoded by the speculative engine and the target-only engine, greedy and at the model card's
production sampling (temperature 1.0, top_p 0.95). Medians over --repeats runs in one process.

usage: python benchmarks/demo_pair.py [--repeats 3] [--prompts 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.engine.pair import attach_drafter  # noqa: E402
from dflash_batch.models.loader import load_model  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402
from dflash_batch.tokenizer import Tokenizer, stop_token_ids  # noqa: E402


def load_demo(models: Path, every_dataset: bool = False
              ) -> tuple[torch.nn.Module, torch.nn.Module, Tokenizer, tuple[int, ...], list[list[int]]]:
    """The demo pair (paired), its tokenizer, its stop ids and the demo job's word problems as
    tokens (`every_dataset`: its few-shot prompts too)."""
    target, drafter = load_model(models / "target"), load_model(models / "drafter")
    attach_drafter(target, drafter)
    tok = Tokenizer(models / "target")
    eos = tuple(stop_token_ids(models / "target", tok))
    rows = [json.loads(line) for line in (ROOT / "jobs/demo/prompts.jsonl").read_text().splitlines()]
    rows = [r for r in rows if every_dataset or r["dataset"] != "few-shot"]
    prompts = tok.encode_batch([tok.render_chat(r["messages"], {}) for r in rows], add_special_tokens=False)
    return target, drafter, tok, eos, prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=ROOT / "jobs/demo/models")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter, tok, eos, prompts = load_demo(args.models)
    prompts = prompts[:args.prompts]
    engines = {"spec": Engine(target, drafter, tok.decode), "target-only": Engine(target, None, tok.decode)}

    def decode(engine: Engine, batch: int, temperature: float) -> tuple[float, float | None, int]:
        params = dict(temperature=temperature, top_p=0.95 if temperature else 1.0, max_new_tokens=96,
                      stop_token_ids=eos)
        reqs = [Request((str(i), 0), p, SamplingParams(seed=i, **params)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        out = list(engine.generate(reqs, Bucket(0, "0-1024", 1024, batch, True, None)))
        sec = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for c in out)
        rounds = sum(c.spec.rounds for c in out if c.spec)
        acc = 1 + sum(c.spec.accepted for c in out if c.spec) / rounds if rounds else None
        return tokens / sec, acc, tokens

    print(f"{'T':>4} {'batch':>5} {'spec tok/s':>11} {'target tok/s':>13} {'speedup':>8} {'acc_len':>8}")
    for temperature in (0.0, 1.0):
        for batch in (1, 4, 16):
            rates: dict[str, list[float]] = {"spec": [], "target-only": []}
            acc = None
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    rate, a, _ = decode(engine, batch, temperature)
                    rates[name].append(rate)
                    acc = a if name == "spec" else acc
            spec, only = statistics.median(rates["spec"]), statistics.median(rates["target-only"])
            print(f"{temperature:>4.1f} {batch:>5} {spec:>11.0f} {only:>13.0f} {spec / only:>7.2f}x {acc:>8.2f}")


if __name__ == "__main__":
    main()
