"""Token batches from the synthetic data: rendered with the product's chat-template code (so the
training text is byte-for-byte what a job renders), right-padded, with each response's start.

Batch `step` of a stream is built from its own seed (seed * 1_000_003 + step): any step can be
rebuilt alone, and a run is reproduced by its seed and step counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_batch.tokenizer import Tokenizer
from recipes.demo import data


@dataclass
class Batch:
    ids: torch.Tensor         # [B, S] int64, right-padded with pad
    lengths: torch.Tensor     # [B] real tokens per row
    resp_start: torch.Tensor  # [B] position of the first response token (length: no response)


class BatchMaker:
    def __init__(self, tokenizer_dir: str | Path, seed: int, code_rate: float = 0.0, max_len: int = 256):
        self.tok = Tokenizer(tokenizer_dir)
        self.pad = self.tok.token_to_id("<|pad|>")
        self.seed, self.code_rate, self.max_len = seed, code_rate, max_len

    def render(self, messages: list[dict]) -> str:
        return self.tok.render_chat(messages, {})

    def batch(self, step: int, size: int, stream: int = 0) -> Batch:
        """Batch `step` of stream `stream` (0: training, others: held out)."""
        seed = (self.seed * 1_000_003 + step) * 7 + stream
        samples = data.samples(seed, size, self.render, code_rate=self.code_rate)
        prompts = self.tok.encode_batch([s.prompt for s in samples], add_special_tokens=False)
        responses = self.tok.encode_batch([s.response for s in samples], add_special_tokens=False)
        rows = [(p + r)[:self.max_len] for p, r in zip(prompts, responses)]
        S = max(len(r) for r in rows)
        ids = torch.full((size, S), self.pad, dtype=torch.int64)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = torch.tensor(r)
        return Batch(ids, torch.tensor([len(r) for r in rows]),
                     torch.tensor([min(len(p), len(r)) if rs else len(r)
                                   for p, r, rs in zip(prompts, rows, responses)]))
