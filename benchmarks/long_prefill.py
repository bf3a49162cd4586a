"""Peak memory and time of a long chunked prefill on a tiny Kimi-K3 (the target alone), by prompt
length, each in a fresh process: what a prompt costs beyond the caches' own bytes.

usage: python benchmarks/long_prefill.py [--lengths 8192,32768,131072] [--chunk 8192]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_batch.engine.cache import SeqRows, build_meta
from dflash_batch.models.loader import load_model
from dflash_batch.testing.kimi import make_kimi_checkpoint

PAGE = 16


def prefill(checkpoint: Path, length: int, chunk: int) -> str:
    """One table line: the prefill of `length` random tokens in chunks of `chunk`."""
    model = load_model(checkpoint, torch.float32)
    pages = list(range(length // PAGE + 1))
    caches = model.allocate_cache(len(pages) * PAGE, torch.float32, "cpu")
    model.allocate_state(1, 1, 8, "cpu")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ids = torch.randint(0, model.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.no_grad():
        for s in range(0, length, chunk):
            part = ids[s:s + chunk]
            meta = build_meta([SeqRows(pages, s, len(part), s + len(part))], PAGE, [len(part) - 1], "cpu", [0])
            model(part, meta)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (f"| {length:,} | {caches / 2**20:.1f} | {peak - before:.0f} | {time.perf_counter() - start:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # CHECKPOINT LENGTH: run one, in this process
    args = ap.parse_args()
    if args.one:
        print(prefill(Path(args.one[0]), int(args.one[1]), args.chunk))
        return
    with tempfile.TemporaryDirectory() as d:
        checkpoint = make_kimi_checkpoint(Path(d) / "kimi")
        print(f"chunk {args.chunk} tokens; peak RSS growth during the prefill, beyond the model and caches")
        print("| prompt tokens | caches MiB | peak RSS beyond MiB | seconds |")
        print("|---|---|---|---|")
        for length in (int(x) for x in args.lengths.split(",")):
            out = subprocess.run([sys.executable, __file__, "--one", str(checkpoint), str(length),
                                  "--chunk", str(args.chunk)], capture_output=True, text=True, check=True)
            print(out.stdout.strip())


if __name__ == "__main__":
    main()
