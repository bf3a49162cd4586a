"""What one model forward needs to know about its rows, and the attention backend that reads it.

The engine builds one `AttnMeta` per forward and passes it to every layer; models and backends
both import this module, which imports neither. Query rows are grouped per sequence into a
[bs, q_max] view; padding entries point at row T, a scratch row that attention writes and nobody
reads. A row whose slot is -1 (a padding row of a static batch) is never written to a cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class AttentionBackend(Protocol):
    """Paged attention over caches the models own. `plan` runs outside any CUDA graph and may
    read host-side lengths; `write` and `attend` run inside one."""

    name: str

    def plan(self, meta: AttnMeta) -> None:
        """Prepare a forward whose metadata was built on the host (prefill chunks)."""

    def plan_round(self, batch: Any, n: int, kv_lens: dict[str, list[int]], graph: bool) -> None:
        """Prepare a round's forwards over rows 0..n-1 of a DecodeBatch: kv_lens[name] holds the
        key length of each row that runs a sequence ("draft", "verify"); the rows past it are
        padding. `graph`: the round replays a CUDA graph captured at n rows."""

    def write(self, cache: torch.Tensor, meta: AttnMeta, values: torch.Tensor) -> None:
        """values [T, ...] of this forward's rows go to cache rows meta.slots (-1: skipped)."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
               scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        """q [T, heads, d] over per-head K/V caches [slots, kv_heads, d] -> [T, heads, dv]."""

    def attend_latent(self, q: torch.Tensor, cache: torch.Tensor, v_width: int, meta: AttnMeta,
                      scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        """Absorbed MLA: q [T, heads, w] over one latent row per slot (cache [slots, 1, w]);
        values are the rows' first v_width columns. -> [T, heads, v_width]."""


@dataclass
class AttnMeta:
    positions: torch.Tensor     # [T] int64: absolute position of each row
    slots: torch.Tensor         # [T] int64: cache slot each row's K/V is written to (-1: none)
    q_index: torch.Tensor       # [bs, q_max] int64: row of query j of sequence b (T = padding)
    q_positions: torch.Tensor   # [bs, q_max] int64: position of that query (-1 = padding)
    kv_lens: torch.Tensor       # [bs] int64: keys at positions < kv_len are visible (before masks)
    block_tables: torch.Tensor  # [bs, max_pages] int64: page ids of each sequence (-1: none)
    page_size: int
    max_kv: int                 # host-side upper bound of kv_lens: how many key positions to read
    logits_rows: torch.Tensor   # [R] int64: rows whose logits (and samples) the engine needs
    state_ids: torch.Tensor | None = None  # [bs] recurrent-state slot of each sequence
    stage: bool = False         # verify: stage recurrent states per row instead of updating them
    dense: bool = False         # every sequence has q_max rows, in order: q_index is arange
    rows_own_slots: bool = False  # sequence b owns slots b*S..(b+1)*S-1, S = max_pages*page_size
    name: str = "forward"       # which planned forward this is (backends plan per name)
    backend: AttentionBackend | None = None  # None: the torch reference
    derived: dict = field(default_factory=dict, repr=False)  # per-forward values layers share

    def shared(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A value every layer of this forward needs (key slots, masks): computed once."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    @property
    def attention(self) -> AttentionBackend:
        if self.backend is None:
            from dflash_batch.backends.torch_attention import TORCH  # the default; imports this module
            self.backend = TORCH
        return self.backend

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
        dense=True,
    )
