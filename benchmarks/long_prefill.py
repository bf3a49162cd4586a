"""Peak memory and time of a long chunked prefill on a tiny Kimi-K3 and its DFlash2-MLA drafter,
as the engine runs one: the target's chunks (MLA latents written, KDA state carried) and the
drafter's context rows from their taps (its full layer per token, its sliding layers in rings of
their window). Each length in a fresh process; the peak RSS is reset once the models, caches and
state are allocated and touched, so "beyond" is what the prefill itself costs.

usage: python benchmarks/long_prefill.py [--lengths 8192,32768,131072] [--chunk 8192] [--window 4096]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_batch.backends.meta import Ring
from dflash_batch.engine.cache import SeqRows, build_meta
from dflash_batch.engine.engine import runtime_tensors
from dflash_batch.testing.kimi_pair import BLOCK, load_pair, make_kimi_pair
from dflash_batch.testing.procs import peak_rss_mb, reset_peak_rss, rss_mb

PAGE = 16


def prefill(target_dir: Path, drafter_dir: Path, length: int, chunk: int) -> list[str]:
    """One table line's cells: the prefill of `length` random tokens in chunks of `chunk`."""
    target, drafter = load_pair(target_dir, drafter_dir, torch.float32)
    pages = list(range(length // PAGE + 1))
    ring = Ring(drafter.ring_pages(BLOCK, PAGE))
    target.allocate_cache(len(pages) * PAGE, torch.float32, "cpu")
    target.allocate_state(1, 1, BLOCK, "cpu")
    drafter.allocate_cache(len(pages) * PAGE, torch.float32, "cpu", ring.slots(1, PAGE))
    held = {name: sum(t.nbytes for t in runtime_tensors([model])) for name, model in
            (("target", target), ("drafter", drafter))}
    ids = torch.randint(0, target.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    reset_peak_rss()
    before = rss_mb(os.getpid())
    start = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, length, chunk):
            part = ids[s:s + chunk]
            meta = build_meta([SeqRows(pages, s, len(part), s + len(part))], PAGE, [len(part) - 1], "cpu", [0],
                              batch_rows=[0], ring=ring)
            _, taps = target(part, meta)
            drafter.write_context(taps, meta)
    seconds = time.perf_counter() - start
    beyond = peak_rss_mb(os.getpid()) - before
    return [f"{length:,}", f"{held['target'] / 2**20:.1f}", f"{held['drafter'] / 2**20:.1f}", f"{beyond:.0f}",
            f"{seconds:.1f}", f"{length / seconds:.0f}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--window", type=int, default=4096, help="the drafter's sliding window (the real one's)")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # TARGET DRAFTER LENGTH: one, in this process
    args = ap.parse_args()
    if args.one:
        print(" | ".join(prefill(Path(args.one[0]), Path(args.one[1]), int(args.one[2]), args.chunk)))
        return
    with tempfile.TemporaryDirectory() as d:
        target, drafter = make_kimi_pair(Path(d), window=args.window)
        print(f"chunks of {args.chunk} tokens; drafter window {args.window}; float32; {torch.get_num_threads()} threads")
        print("| prompt tokens | target caches + state MiB | drafter caches MiB | peak RSS beyond MiB | seconds | tokens/s |")
        print("|---|---|---|---|---|---|")
        beyond = []
        for length in (int(x) for x in args.lengths.split(",")):
            out = subprocess.run([sys.executable, __file__, "--one", str(target), str(drafter), str(length),
                                  "--chunk", str(args.chunk)], capture_output=True, text=True, check=True)
            cells = out.stdout.strip().splitlines()[-1]
            beyond.append(float(cells.split(" | ")[3]))
            print(f"| {cells} |")
        print(f"peak RSS beyond the caches, longest / shortest: {beyond[-1] / beyond[0]:.2f}x")


if __name__ == "__main__":
    main()
