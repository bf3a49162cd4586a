"""Engine throughput side by side with the z-lab reference, on the same tiny weights and prompts.

The setup of ARCHITECTURE §9: a random Qwen3 (vocab 1000, hidden 128, 4 layers, 4/2 heads,
head_dim 32) with a random DFlash v1 drafter (2 layers, block 8), 32 prompts of 10..60 random
tokens, 128 new tokens each, greedy, no EOS. Two weight settings bracket speculation:
`random` (the drafter is never right: the worst case) and `zero-head` (the target's lm_head is
zeroed, so every draft is accepted: the best case; a DFlash2 selector would still rank its tied
candidates by its bigram codebooks, so v1 is used). Medians over --repeats runs, start-up excluded.

usage: python benchmarks/engine_vs_reference.py [--repeats 5] [--ref-prompts 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dflash.model as zl  # noqa: E402
import transformers  # noqa: E402

from dflash_batch.testing import checkpoints  # noqa: E402
from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.pair import attach_drafter  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.models.loader import load_model  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402

VOCAB, HIDDEN, NEW = 1000, 128, 128
SHAPE = dict(vocab=VOCAB, hidden=HIDDEN, inter=256, heads=4, kv_heads=2, head_dim=32)


def make_pair(d: Path, zero_head: bool) -> tuple[Path, Path]:
    target = checkpoints.qwen3_checkpoint(d / "target", layers=4, peaked=False, **SHAPE)
    if zero_head:
        w = load_file(target / "model.safetensors")
        w["lm_head.weight"].zero_()
        save_file(w, target / "model.safetensors", metadata={"format": "pt"})
    return target, checkpoints.dflash_checkpoint(d / "drafter", layers=2, **SHAPE)


def ours(target_dir: Path, drafter_dir: Path | None) -> Engine:
    target = load_model(target_dir)
    drafter = None
    if drafter_dir:
        drafter = load_model(drafter_dir)
        attach_drafter(target, drafter)
    return Engine(target, drafter, compile=True)  # as `dflash-batch run` builds it on a CPU host


def generate(engine: Engine, prompts: list[list[int]]) -> list:
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=NEW, seed=i)) for i, p in enumerate(prompts)]
    return list(engine.generate(reqs, Bucket(0, "0-256", 256, 32, True, None)))


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ref-prompts", type=int, default=8, help="prompts the (slow) reference runs per repeat")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=gen).tolist()
               for n in torch.randint(10, 61, (32,), generator=gen)]
    zl._cuda_time = time.perf_counter
    rows = []
    for case in ("random", "zero-head"):
        d = Path(tempfile.mkdtemp(prefix="dflash-engine-bench-"))
        target_dir, drafter_dir = make_pair(d, case == "zero-head")
        ref_target = transformers.AutoModelForCausalLM.from_pretrained(
            target_dir, dtype=torch.float32, attn_implementation="eager").eval()
        ref_drafter = zl.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
        spec, only = ours(target_dir, drafter_dir), ours(target_dir, None)
        for engine in (spec, only):
            generate(engine, prompts)  # compiles the round: start-up, not measured
        results: dict[str, list[float]] = {"reference": [], "spec": [], "target-only": []}
        acc = {}
        for _ in range(args.repeats):
            sec, outs = timed(lambda: [zl.dflash_generate(ref_drafter, ref_target, torch.tensor([p]), NEW, None,
                                                          return_stats=True) for p in prompts[:args.ref_prompts]])
            results["reference"].append(sum(o.num_output_tokens for o in outs) / sec)
            acc["reference"] = statistics.mean(l for o in outs for l in o.acceptance_lengths)
            for name, engine in (("spec", spec), ("target-only", only)):
                sec, outs = timed(lambda: generate(engine, prompts))
                results[name].append(sum(len(c.token_ids) for c in outs) / sec)
                if name == "spec":
                    rounds = sum(c.spec.rounds for c in outs)
                    acc[name] = 1 + sum(c.spec.accepted for c in outs) / rounds
        ref_rate = statistics.median(results["reference"])
        for name, rates in results.items():
            rate = statistics.median(rates)
            rows.append((case, name, rate, acc.get(name), rate / ref_rate))
    print(f"{'weights':>10} {'engine':>12} {'tokens/s':>9} {'acc_len':>8} {'vs reference':>13}")
    for case, name, rate, acc_len, ratio in rows:
        acc_txt = f"{acc_len:.2f}" if acc_len else "-"
        print(f"{case:>10} {name:>12} {rate:>9.0f} {acc_txt:>8} {ratio:>12.1f}x")


if __name__ == "__main__":
    main()
