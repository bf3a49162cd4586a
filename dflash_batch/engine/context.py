"""What one model forward needs to know about its rows: positions, cache slots, sequence layout.

The engine builds one `AttnMeta` per forward from host-side bookkeeping (no device sync) and
passes it to every layer. Query rows are grouped per sequence into a padded [bs, q_max] view;
padding entries point at row T, a scratch row that attention writes and nobody reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttnMeta:
    positions: torch.Tensor     # [T] int64: absolute position of each row
    slots: torch.Tensor         # [T] int64: paged-cache slot each row's K/V is written to
    q_index: torch.Tensor       # [bs, q_max] int64: row of query j of sequence b (T = padding)
    q_positions: torch.Tensor   # [bs, q_max] int64: position of that query (-1 = padding)
    kv_lens: torch.Tensor       # [bs] int64: keys at positions < kv_len are visible (before masks)
    block_tables: torch.Tensor  # [bs, max_pages] int64: page ids of each sequence
    page_size: int
    max_kv: int                 # host-side upper bound of kv_lens: how many key positions to read
    logits_rows: torch.Tensor   # [R] int64: rows whose logits (and samples) the engine needs
    state_ids: torch.Tensor | None = None  # [bs] recurrent-state slot of each sequence
    stage: bool = False         # verify: stage recurrent states per row instead of updating them
    derived: dict = field(default_factory=dict, repr=False)  # per-forward values layers share

    def shared(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A value every layer of this forward needs (key slots, masks): computed once."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])


def single_sequence_meta(num_tokens: int, start: int = 0, page_size: int = 16,
                         all_logits: bool = True) -> AttnMeta:
    """Meta for one sequence whose rows sit at positions start..start+num_tokens-1 and whose
    cache pages are 0, 1, 2, ... (used by tests and simple callers)."""
    end = start + num_tokens
    pages = (end + page_size - 1) // page_size
    positions = torch.arange(start, end)
    rows = torch.arange(num_tokens)
    return AttnMeta(
        positions=positions,
        slots=positions.clone(),
        q_index=rows[None, :],
        q_positions=positions[None, :],
        kv_lens=torch.tensor([end]),
        block_tables=torch.arange(pages)[None, :],
        page_size=page_size,
        max_kv=end,
        logits_rows=rows if all_logits else rows[-1:],
    )
