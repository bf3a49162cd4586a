"""Paged KV memory: a fixed pool of pages, and the row layout of one forward over it.

The target's caches and the drafter's caches are indexed by the same slots: the drafter's
context row for a token lives at that token's target slot (TokenSpeed shares the page space the
same way), so one page table per sequence serves both models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_batch.backends.meta import AttentionBackend, AttnMeta


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self.free = list(range(num_pages - 1, -1, -1))

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, tokens: int) -> list[int]:
        n = self.pages_for(tokens)
        if n > len(self.free):
            raise RuntimeError(f"KV pool exhausted: need {n} pages, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(pages)


@dataclass
class SeqRows:
    """One sequence's share of a forward: `positions` are consecutive, keys < kv_len visible."""

    pages: list[int]
    start: int
    count: int
    kv_len: int


def build_meta(rows: list[SeqRows], page_size: int, logits_rows: list[int] | None = None,
               device: torch.device | str = "cpu", state_ids: list[int] | None = None,
               stage: bool = False, backend: AttentionBackend | None = None, name: str = "forward") -> AttnMeta:
    """The AttnMeta of a forward whose rows are `rows`, packed in order."""
    q_max = max(r.count for r in rows)
    max_pages = max(len(r.pages) for r in rows)
    positions, slots, q_index, q_pos, tables = [], [], [], [], []
    total = sum(r.count for r in rows)
    row = 0
    for r in rows:
        pos = list(range(r.start, r.start + r.count))
        positions += pos
        slots += [r.pages[p // page_size] * page_size + p % page_size for p in pos]
        q_index.append(list(range(row, row + r.count)) + [total] * (q_max - r.count))
        q_pos.append(pos + [-1] * (q_max - r.count))
        tables.append(r.pages + [0] * (max_pages - len(r.pages)))
        row += r.count

    def t(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    kv_lens = [r.kv_len for r in rows]
    return AttnMeta(positions=t(positions), slots=t(slots), q_index=t(q_index), q_positions=t(q_pos),
                    kv_lens=t(kv_lens), block_tables=t(tables), page_size=page_size,
                    max_kv=max(kv_lens),
                    logits_rows=t(list(range(total)) if logits_rows is None else logits_rows),
                    state_ids=None if state_ids is None else t(state_ids), stage=stage,
                    dense=all(r.count == q_max for r in rows), backend=backend, name=name)
