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
from transformers import Qwen3Config  # noqa: E402

from dflash_batch.engine.engine import Engine  # noqa: E402
from tests.engine_util import bucket, load_pair, run  # noqa: E402
from tests.tiny_models import load_hf_model, make_qwen3_checkpoint, randomize_  # noqa: E402

VOCAB, HIDDEN, NEW = 1000, 128, 128


def make_pair(d: Path, zero_head: bool) -> tuple[Path, Path, torch.nn.Module]:
    target = make_qwen3_checkpoint(d / "target", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    if zero_head:
        w = load_file(target / "model.safetensors")
        w["lm_head.weight"].zero_()
        save_file(w, target / "model.safetensors", metadata={"format": "pt"})
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_target_layers=4,
                         is_causal=False, architectures=["DFlashDraftModel"],
                         dflash_config=dict(block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=[1, 2]))
    ref = zl.DFlashDraftModel(config)
    randomize_(ref, 1)
    ref.save_pretrained(d / "drafter")
    return target, d / "drafter", ref.eval()


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
        target_dir, drafter_dir, ref_drafter = make_pair(d, case == "zero-head")
        ref_target = load_hf_model(target_dir)
        spec = Engine(*load_pair(target_dir, drafter_dir))
        only = Engine(load_pair(target_dir, None)[0])
        b = bucket(max_num_seqs=32, max_tokens=256)
        results: dict[str, list[float]] = {"reference": [], "spec": [], "target-only": []}
        acc = {}
        for _ in range(args.repeats):
            sec, outs = timed(lambda: [zl.dflash_generate(ref_drafter, ref_target, torch.tensor([p]), NEW, None,
                                                          return_stats=True) for p in prompts[:args.ref_prompts]])
            results["reference"].append(sum(o.num_output_tokens for o in outs) / sec)
            acc["reference"] = statistics.mean(l for o in outs for l in o.acceptance_lengths)
            for name, engine in (("spec", spec), ("target-only", only)):
                sec, outs = timed(lambda: run(engine, prompts, b, max_new_tokens=NEW))
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
