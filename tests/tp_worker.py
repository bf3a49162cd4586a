"""Tensor-parallel test worker: importable by processes that torch.multiprocessing spawns."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_batch.engine.cache import SeqRows, build_meta
from dflash_batch.models.loader import load_model

PROMPT_LEN = 29
PAGES = list(range(4))  # 64 slots of pages of 16


def one_sequence(start: int, count: int):
    """A forward of positions start..start+count-1 of one sequence over PAGES, every row's logits."""
    return build_meta([SeqRows(PAGES, start, count, start + count)], 16)


def forward_steps(checkpoint: str | Path, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Prefill a fixed prompt, then decode its greedy next token; every output, on this rank."""
    model = load_model(checkpoint, getattr(torch, dtype))
    model.allocate_cache(64, getattr(torch, dtype), "cpu")
    model.set_taps([0, 2, 3])
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    prefill, prefill_taps = model(prompt, one_sequence(0, PROMPT_LEN))
    next_token = prefill[-1].argmax().view(1)
    decode, decode_taps = model(next_token, one_sequence(PROMPT_LEN, 1))
    return dict(prefill=prefill, prefill_taps=prefill_taps, decode=decode, decode_taps=decode_taps)


def run(rank: int, world_size: int, port: int, checkpoint: str, out_dir: str, dtype: str = "float32") -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # two ranks share a small CPU
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.save(forward_steps(checkpoint, dtype), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
