"""Train the demo pair: a tiny Kimi-K3-architecture target and its DFlash2-MLA drafter.

    python -m recipes.demo.train --out jobs/demo/models --minutes 25
    python -m recipes.demo.train --out /tmp/pair --preset tiny --steps 20      # smoke run

Writes OUT/target (config.json, model.safetensors, tokenizer files), OUT/drafter (config.json,
model.safetensors) and OUT/train_log.json (arguments, per-step losses, held-out evaluations,
step counts and times). Everything is seeded; a timed run logs its step counts, and passing
them back with --target-steps/--drafter-steps reproduces it exactly (same machine type: float
reductions may differ across CPUs).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from dflash_batch.models.dflash import DFlash2Drafter
from dflash_batch.models.kimi_k3 import KimiK3ForConditionalGeneration
from dflash_batch.models.loader import load_model
from recipes.demo import checkpoint, configs, train_drafter, train_target
from recipes.demo.batches import BatchMaker
from recipes.demo.init import init_weights
from recipes.demo.tokenizer import special_ids, train_tokenizer, vocab_size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.demo.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (target/, drafter/, train_log.json)")
    p.add_argument("--minutes", type=float, default=25.0, help="time budget for both phases")
    p.add_argument("--target-share", type=float, default=0.6, help="share of the budget for the target")
    p.add_argument("--steps", type=int, help="steps for each phase (instead of --minutes)")
    p.add_argument("--target-steps", type=int)
    p.add_argument("--drafter-steps", type=int)
    p.add_argument("--preset", choices=sorted(configs.PRESETS), default="demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size")
    p.add_argument("--tokenizer-samples", type=int, default=20000, help="samples the BPE is trained on")
    p.add_argument("--code-rate", type=float, default=0.0, help="share of stdlib code snippets in the data")
    p.add_argument("--batch", type=int, default=16, help="target sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--draft-batch", type=int, default=16, help="drafter sequences per step")
    p.add_argument("--anchors", type=int, default=12, help="blocks per sequence per drafter step")
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--gamma", type=float, default=4.0, help="block position decay (doc: 4 for block 8)")
    p.add_argument("--selector-alpha", type=float, default=1.0)
    p.add_argument("--labels", choices=("target", "data"), default="target",
                   help="drafter labels: the target's greedy tokens or the text")
    p.add_argument("--taps", type=lambda s: [int(x) for x in s.split(",")], help="target layers, e.g. 1,3,6")
    p.add_argument("--stream", choices=("prefix", "attn_res"), default="prefix", help="aux_hidden_stream")
    p.add_argument("--warmup", type=int, default=20, help="warmup steps of each phase")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny matrices: 1 is usually best)")
    p.add_argument("--save-dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="dtype of the saved weights (the real checkpoint's: bfloat16, float32 where it keeps float32)")
    return p.parse_args(argv)


def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = configs.PRESETS[args.preset]
    seconds = args.minutes * 60
    t0 = time.monotonic()
    log: dict = {"args": vars(args), "target": {}, "drafter": {}}

    tok_dir = train_tokenizer(out / "target", args.vocab, args.seed, args.tokenizer_samples, args.code_rate)
    special = special_ids(tok_dir)
    vocab = -(-vocab_size(tok_dir) // 64) * 64  # model rows: the tokenizer's ids, rounded up to 64
    maker = BatchMaker(tok_dir, args.seed, args.code_rate)

    target_cfg = configs.target_config(preset, vocab, special)
    target = init_weights(KimiK3ForConditionalGeneration(target_cfg), args.seed, preset["layers"])
    log["target"]["params"] = sum(p.numel() for p in target.parameters())
    steps = args.target_steps or args.steps
    train_target.train(target, maker, args.batch, args.lr, args.warmup, steps,
                       None if steps else seconds * args.target_share, args.eval_every, log["target"])
    checkpoint.save(target, target_cfg, out / "target", DTYPES[args.save_dtype], "language_model.")
    # The drafter learns the target as it ships: reloaded through the product loader (with the
    # saved dtype's rounding), not the in-memory float32 copy.
    target = load_model(out / "target")

    taps = args.taps or configs.default_taps(preset["layers"], preset["attn_res_block"])
    draft_cfg = configs.drafter_config(preset, vocab, preset["layers"], special["<|mask|>"], taps, args.stream)
    drafter = init_weights(DFlash2Drafter(draft_cfg), args.seed + 1, preset["draft_layers"])
    log["drafter"]["params"] = sum(p.numel() for p in drafter.parameters())
    steps = args.drafter_steps or args.steps
    remaining = max(0.0, seconds - (time.monotonic() - t0))
    train_drafter.train(drafter, target, maker, args.draft_batch, args.anchors, args.gamma, args.labels,
                        args.selector_alpha, args.draft_lr, args.warmup, steps, None if steps else remaining,
                        args.eval_every, args.seed, log["drafter"])
    checkpoint.save(drafter, draft_cfg, out / "drafter", DTYPES[args.save_dtype])

    log["seconds"] = round(time.monotonic() - t0, 1)
    # Training amplifies last-bit float differences between CPUs: the pair depends on the machine.
    log["machine"] = {"cpu": cpu_model(), "torch": torch.__version__,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    log["size_mb"] = {k: round(checkpoint.size_mb(out / k), 2) for k in ("target", "drafter")}
    (out / "train_log.json").write_text(json.dumps(log))
    print(f"wrote {out}: target {log['size_mb']['target']} MB ({log['target']['params'] / 1e6:.2f}M params, "
          f"{log['target']['total_steps']} steps), drafter {log['size_mb']['drafter']} MB "
          f"({log['drafter']['params'] / 1e6:.2f}M params, {log['drafter']['total_steps']} steps), "
          f"{log['seconds']:.0f}s; reproduce with --target-steps {log['target']['total_steps']} "
          f"--drafter-steps {log['drafter']['total_steps']}", flush=True)
    return log


if __name__ == "__main__":
    main()
