"""Paged KV memory: the pages a batch row owns, and the row layout of one forward over them.

The target's caches and the drafter's caches are indexed by the same slots: the drafter's
context row for a token lives at that token's target slot (TokenSpeed shares the page space the
same way), so one page table per sequence serves both models. Each row of a bucket's batch owns
a fixed run of pages, enough for the bucket's longest sequence (prompt + max_new_tokens + a
block), and the sequence decoding in that row uses them: every sequence fits, none waits for
pages. Sequences still carry page tables, so attention backends take any layout; the torch
backend reads keys in place when a forward's rows are batch rows 0..n-1 (AttnMeta.rows_own_slots).
The drafter's sliding layers may instead keep a ring per batch row (backends/meta.py's Ring).
Past the rows' pages and a scratch page lies a pool of pages that shared prompt heads fill once
and their rows' page tables point at (engine/heads.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dflash_batch.backends.meta import AttentionBackend, AttnMeta, Ring
from dflash_batch.backends.torch_attention import TORCH


def row_pages(row: int, pages_per_row: int) -> list[int]:
    """The pages batch row `row` owns."""
    return list(range(row * pages_per_row, (row + 1) * pages_per_row))


def slots(pages: list[int], positions: range | list[int], page_size: int) -> list[int]:
    """The cache slots of these positions of a sequence with these pages."""
    return [pages[p // page_size] * page_size + p % page_size for p in positions]


class RowRings(NamedTuple):
    """The drafter's ring caches of a bucket (a rank's share of them, under a latent split) and
    the slots each batch row holds in every one of them (backends/meta.py's Ring)."""

    caches: list[torch.Tensor]
    row_slots: int

    def of(self, row: int) -> list[torch.Tensor]:
        """Batch row `row`'s slots in each ring (views: writing them writes the rings)."""
        return [ring[row * self.row_slots:(row + 1) * self.row_slots] for ring in self.caches]


NO_RINGS = RowRings([], 0)


@dataclass
class SeqRows:
    """One sequence's share of a forward: `positions` are consecutive, keys < kv_len visible."""

    pages: list[int]
    start: int
    count: int
    kv_len: int


def build_meta(rows: list[SeqRows], page_size: int, logits_rows: list[int] | None = None,
               device: torch.device | str = "cpu", state_ids: list[int] | None = None,
               stage: bool = False, backend: AttentionBackend = TORCH, name: str = "forward",
               batch_rows: list[int] | None = None, ring: Ring | None = None, micro_batches: int = 1) -> AttnMeta:
    """The AttnMeta of a forward whose rows are `rows`, packed in order; `batch_rows`: the batch
    row of each sequence (whose ring pages it uses, with `ring`); `micro_batches`: groups of
    sequences it goes through pipeline stages in."""
    q_max = max(r.count for r in rows)
    max_pages = max(len(r.pages) for r in rows)
    positions, slot_ids, q_index, q_pos, tables = [], [], [], [], []
    total = sum(r.count for r in rows)
    row = 0
    for r in rows:
        pos = list(range(r.start, r.start + r.count))
        positions += pos
        slot_ids += slots(r.pages, pos, page_size)
        q_index.append(list(range(row, row + r.count)) + [total] * (q_max - r.count))
        q_pos.append(pos + [-1] * (q_max - r.count))
        tables.append(r.pages + [0] * (max_pages - len(r.pages)))
        row += r.count

    def t(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    kv_lens = [r.kv_len for r in rows]
    return AttnMeta(positions=t(positions), slots=t(slot_ids), q_index=t(q_index), q_positions=t(q_pos),
                    kv_lens=t(kv_lens), block_tables=t(tables), page_size=page_size,
                    max_kv=max(kv_lens), min_start=min(r.start for r in rows),
                    logits_rows=t(list(range(total)) if logits_rows is None else logits_rows),
                    state_ids=None if state_ids is None else t(state_ids), stage=stage,
                    rows=None if batch_rows is None else t(batch_rows), ring=ring,
                    dense=all(r.count == q_max for r in rows), backend=backend, name=name,
                    micro_batches=micro_batches)
