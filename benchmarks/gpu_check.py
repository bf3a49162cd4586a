"""The GPU check's table (run by benchmarks/gpu_check.sh on a machine with one GPU): per kernel
the largest difference from its torch reference; CUDA-graph rounds == eager rounds; round time
eager vs graph at batch 1/4/16/32; speculative and target-only tokens/s. A tiny Qwen3 (4 layers,
hidden 256, 64-wide heads, vocab 1000) with a 1-layer DFlash v1 drafter (random: drafts are
rarely accepted, so tokens/s here is the cost of a round, not a speed-up).

python benchmarks/gpu_check.py [--backend torch|flashinfer] [--out table.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.pair import attach_drafter  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.kernels.accept import accept_torch, accept_triton  # noqa: E402
from dflash_batch.kernels.prepare import prepare_torch, prepare_triton  # noqa: E402
from dflash_batch.kernels.sample import sample_torch, sample_triton  # noqa: E402
from dflash_batch.kernels.scatter import scatter_torch, scatter_triton  # noqa: E402
from dflash_batch.models.loader import load_model  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402
from dflash_batch.testing import checkpoints  # noqa: E402

SHAPE = dict(vocab=1000, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512)
DEVICE = "cuda"  # benchmarks/triton_cache.py runs these functions on the CPU to compile their kernels


def sync() -> None:
    if DEVICE == "cuda":
        sync()


def kernel_errors() -> dict[str, float]:
    """Mismatching elements (integer kernels) or the largest difference (scatter), GPU Triton vs torch."""
    g = torch.Generator().manual_seed(0)
    n, B, V = 257, 8, 32000
    logits = torch.randn(n, V, generator=g) * 3
    logits[torch.rand(n, V, generator=g) < 0.5] = float("-inf")
    logits[:, 0] = 0.0
    seed, pos = torch.randint(0, 2**62, (n,), generator=g), torch.randint(0, 1 << 17, (n,), generator=g)
    out = {"sample (mismatched rows)": int((sample_triton(logits.to(DEVICE), seed.to(DEVICE), pos.to(DEVICE)).cpu()
                                            != sample_torch(logits, seed, pos)).sum())}
    ids, chosen = torch.randint(0, 9, (n, B), generator=g), torch.randint(0, 9, (n, B), generator=g)
    budget, stops = torch.randint(0, 12, (n,), generator=g), torch.randint(-1, 9, (n, 3), generator=g)
    ref = [ids.clone(), pos.clone(), budget.clone()]
    want = torch.zeros(n, B + 2, dtype=torch.int64)
    accept_torch(ref[0], chosen, ref[1], ref[2], stops, want)
    dev = [t.clone().to(DEVICE) for t in (ids, pos, budget)]
    got = torch.zeros(n, B + 2, dtype=torch.int64, device=DEVICE)
    accept_triton(dev[0], chosen.to(DEVICE), dev[1], dev[2], stops.to(DEVICE), got)
    out["accept (mismatched values)"] = int((got.cpu() != want).sum()) + sum(
        int((a.cpu() != b).sum()) for a, b in zip(dev, ref))
    tables = torch.randperm(n * 40, generator=g).view(n, 40)
    tables[::5] = -1
    p = torch.randint(0, 600, (n,), generator=g)
    ref = prepare_torch(ids, p, budget, tables, 16, 7)
    got = prepare_triton(ids.to(DEVICE), p.to(DEVICE), budget.to(DEVICE), tables.to(DEVICE), 16, 7)
    out["prepare (mismatched values)"] = sum(int((a.cpu() != b).sum()) for a, b in zip(got, ref))
    cache, slots = torch.randn(4096, 2, 64, generator=g), torch.randperm(4096, generator=g)[:n]
    slots[::3] = -1
    values = torch.randn(n, 2, 64, generator=g)
    want = cache.clone()
    scatter_torch(want, slots, values)
    got = cache.to(DEVICE)
    scatter_triton(got, slots.to(DEVICE), values.to(DEVICE))
    out["scatter (max abs error)"] = float((got.cpu() - want).abs().max())
    return out


def load_models(d: Path) -> tuple:
    """The tiny Qwen3 pair in bfloat16 on DEVICE (random head: a round's cost, not its acceptance)."""
    target = load_model(checkpoints.qwen3_checkpoint(d / "t", layers=4, peaked=False, **SHAPE), torch.bfloat16, DEVICE)
    drafter = load_model(checkpoints.dflash_checkpoint(d / "d", layers=1, **SHAPE), torch.bfloat16, DEVICE)
    attach_drafter(target, drafter)
    return target, drafter


def engine(models, backend: str, graphs: bool, sizes: list[int]) -> Engine:
    attention = None
    if backend == "flashinfer":
        from dflash_batch.backends.flashinfer_attention import FlashInferAttention

        attention = FlashInferAttention(DEVICE)
    kw = dict(attention=attention) if attention else {}
    return Engine(*models, device=DEVICE, dtype=torch.bfloat16, cuda_graphs=graphs,
                  capture_sizes=sizes if graphs else None, **kw)


def timed(e: Engine, batch: int, speculation: bool, new: int = 64) -> tuple[float, int, int, dict]:
    """(seconds, tokens, rounds, outputs) of `batch` prompts decoded together, after a warm-up."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 999, (int(k),), generator=g).tolist() for k in torch.randint(16, 64, (batch,), generator=g)]
    bucket = Bucket(0, "0-256", 256, batch, speculation, None)

    def go():
        reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=new, seed=i)) for i, p in enumerate(prompts)]
        return list(e.generate(reqs, bucket))

    go()
    sync()
    t = time.perf_counter()
    outs = go()
    sync()
    dt = time.perf_counter() - t
    rounds = max(len(c.spec.per_round) if c.spec else len(c.token_ids) - 1 for c in outs)
    return dt, sum(len(c.token_ids) for c in outs), rounds, {c.key: c.token_ids for c in outs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="torch", choices=["torch", "flashinfer"])
    ap.add_argument("--out")
    a = ap.parse_args()
    models = load_models(Path(tempfile.mkdtemp()))
    target = models[0]
    table = {"backend": a.backend, "kernels": kernel_errors(), "rounds": []}
    print(json.dumps({"kernels": table["kernels"]}), flush=True)
    sizes = [1, 4, 16, 32]
    for batch in sizes:
        runs = {mode: timed(engine(models, a.backend, mode == "graph", sizes), batch, True) for mode in ("eager", "graph")}
        row = {"batch": batch, **{mode: dict(ms_per_round=1e3 * dt / rounds, tok_s=tokens / dt)
                                  for mode, (dt, tokens, rounds, _) in runs.items()}}
        eager, graph = runs["eager"][3], runs["graph"][3]
        row["graph == eager"] = f"{sum(eager[k] == graph[k] for k in eager)}/{len(eager)}"
        row["speedup"] = row["eager"]["ms_per_round"] / row["graph"]["ms_per_round"]
        table["rounds"].append(row)
        print(json.dumps(row), flush=True)
    only = timed(engine((target, None), a.backend, True, sizes), 32, False)
    spec = timed(engine(models, a.backend, True, sizes), 32, True)
    table["tok_s_batch32"] = {"target-only": only[1] / only[0], "speculative": spec[1] / spec[0]}
    print(f"\n| kernel | vs torch reference |\n|---|---|")
    for k, v in table["kernels"].items():
        print(f"| {k} | {v:g} |")
    print(f"\n| batch | eager ms/round | graph ms/round | graph speed-up | graph == eager tokens |\n|---|---|---|---|---|")
    for r in table["rounds"]:
        print(f"| {r['batch']} | {r['eager']['ms_per_round']:.2f} | {r['graph']['ms_per_round']:.2f} | "
              f"{r['speedup']:.2f}x | {r['graph == eager']} |")
    t = table["tok_s_batch32"]
    print(f"\nbatch 32, graphs, {a.backend}: target-only {t['target-only']:,.0f} tok/s, "
          f"speculative {t['speculative']:,.0f} tok/s")
    if a.out:
        json.dump(table, open(a.out, "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
