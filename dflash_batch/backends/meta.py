"""What one model forward needs to know about its rows, and the attention backend that reads it.

The engine builds one `AttnMeta` per forward and passes it to every layer; models and backends
both import this module, which imports neither. Query rows are grouped per sequence into a
[bs, q_max] view; padding entries point at row T, a scratch row that attention writes and nobody
reads. A row whose slot is -1 (a padding row of a static batch) is never written to a cache.

Sliding-window layers may keep a ring instead of the whole context (`Ring`): each batch row owns
a few pages that its sequence's positions reuse in turn, enough for the window and one forward's
queries. `AttnMeta.ring_view` is a forward as such a layer sees it: the same queries, slots and
page tables in the ring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from dflash_batch.backends.latent_split import LatentSplit


class AttentionBackend(Protocol):
    """Paged attention over caches the models own. `plan` runs outside any CUDA graph and may
    read host-side lengths; `write` and `attend` run inside one."""

    name: str
    split: LatentSplit | None  # whose rows of the MLA latent caches this rank keeps (None: all of them)
    # Whether a round's forwards may go through pipeline stages in groups of sequences (a backend
    # that plans a round on the host plans it whole; its rounds run in lanes instead, engine/lanes.py).
    splits_rounds: bool
    # Whether a round's layout is planned on the host before it runs (plan_round): a verify whose
    # sequences have different numbers of rows (engine/row_drafts.py), known after the draft, is
    # then planned between the two, so only an eager round can be ragged.
    plans_on_host: bool

    def reads_rings(self, latent: bool) -> bool:
        """Whether a drafter's sliding layers may keep ring caches (AttnMeta.ring_view) here:
        latent (MLA) layers, or GQA ones."""

    def plan(self, meta: AttnMeta) -> None:
        """Prepare a forward whose metadata was built on the host (prefill chunks)."""

    def plan_round(self, batch: Any, n: int, kv_lens: dict[str, list[int]], graph: bool,
                   widths: dict[str, int] | None = None) -> None:
        """Prepare a round's forwards over rows 0..n-1 of a DecodeBatch: kv_lens[name] holds the
        key length of each row that runs a sequence ("draft", "verify"); the rows past it are
        padding. `graph`: the round replays a CUDA graph captured at n rows. `widths[name]`: the
        query rows a sequence has in that forward (a verify of fewer drafts), default the block."""

    def write(self, cache: torch.Tensor, meta: AttnMeta, values: torch.Tensor) -> None:
        """values [T, ...] of this forward's rows go to cache rows meta.slots (-1: skipped)."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
               scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        """q [T, heads, d] over per-head K/V caches [slots, kv_heads, d] -> [T, heads, dv]."""

    def attend_latent(self, q: torch.Tensor, cache: torch.Tensor, v_width: int, meta: AttnMeta,
                      scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        """Absorbed MLA: q [T, heads, w] over one latent row per slot (cache [slots, 1, w]);
        values are the rows' first v_width columns. -> [T, heads, v_width]."""


@dataclass(frozen=True)
class Ring:
    """A sliding-window layer's cache: batch row r owns pages r*pages .. (r+1)*pages - 1, and its
    sequence's position p lives on page r*pages + (p // page_size) % pages. A forward whose
    queries see at most `pages * page_size` positions back from its last query (the window plus
    a draft block) reads only live rows; older positions have been overwritten."""

    pages: int

    def slots(self, rows: int, page_size: int) -> int:
        """Cache slots for `rows` batch rows, and a scratch page (padding rows write there)."""
        return (rows * self.pages + 1) * page_size


class Stagger(NamedTuple):
    """Sequences of unequal row counts (a ragged verify, or a commit of different kept counts)
    longest first: `order` [n] their indices, `running[t]` how many of them have a row t (host
    ints). A recurrent layer then runs row t for the first running[t] only."""

    order: torch.Tensor
    running: tuple[int, ...]


def stagger(counts: list[int], device: torch.device | str) -> Stagger:
    """The Stagger of sequences with counts[b] rows each."""
    order = sorted(range(len(counts)), key=lambda b: -counts[b])
    return Stagger(torch.tensor(order, dtype=torch.int64, device=device),
                   tuple(sum(c > t for c in counts) for t in range(max(counts, default=0))))


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
    backend: AttentionBackend   # what writes and reads the caches of this forward
    gather_logits: bool = True  # False: each rank returns its vocabulary slice (read by parallel.sharded_*)
    state_ids: torch.Tensor | None = None  # [bs] recurrent-state slot of each sequence
    stage: bool = False         # verify: stage recurrent states per row instead of updating them
    dense: bool = False         # every sequence has q_max rows, in order: q_index is arange
    rows_own_slots: bool = False  # sequence b owns slots b*S..(b+1)*S-1, S = max_pages*page_size
    min_start: int = 0          # host-side lower bound of every sequence's first query position
    rows: torch.Tensor | None = None  # [bs] batch row of each sequence (whose ring pages it uses)
    ring: Ring | None = None    # the geometry of ring caches, for layers that keep one
    name: str = "forward"       # which planned forward this is (backends plan per name)
    micro_batches: int = 1      # groups of sequences a forward goes through pipeline stages in
    first_seq: int = 0          # the round's sequence this forward's first one is (a micro-batch's)
    stagger: Stagger | None = None  # an eager ragged verify's sequences, widest first (recurrent layers)
    derived: dict = field(default_factory=dict, repr=False)  # per-forward values layers share

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        """A value every layer of this forward needs (key slots, masks): computed once."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    def ring_view(self) -> AttnMeta:
        """This forward over ring caches: page tables and slots in the ring of each sequence's
        row. A row that a later row of its sequence in this forward would overwrite is not
        written (a prefill chunk longer than the ring keeps its last ring-full)."""
        if self.ring is None or self.rows is None:
            raise ValueError(f"forward {self.name!r} reads a ring cache but carries no ring geometry or rows")
        return self.shared("ring_view", self._ring_view)

    def _ring_view(self) -> AttnMeta:
        pages, ps = self.ring.pages, self.page_size
        bs, q_max = self.q_index.shape
        device = self.positions.device
        turn = torch.arange(self.block_tables.shape[1], device=device) % pages
        tables = torch.where(self.block_tables >= 0, self.rows[:, None] * pages + turn, -1)
        owner = torch.arange(bs, device=device).repeat_interleave(q_max)  # sequence of each query row
        if not self.dense:
            owner = torch.zeros(self.num_rows + 1, dtype=torch.int64, device=device).index_copy_(
                0, self.q_index.reshape(-1), owner)[:self.num_rows]
        pos = self.positions
        live = pos > self.q_positions.amax(1)[owner] - pages * ps
        ring_slots = tables[owner, pos // ps] * ps + pos % ps
        return dataclasses.replace(self, slots=torch.where((self.slots >= 0) & live, ring_slots, -1),
                                   block_tables=tables, rows_own_slots=False, ring=None, derived={},
                                   name=f"{self.name}.ring")

    def sequences(self, a: int, b: int, rows: slice) -> AttnMeta:
        """Sequences a..b-1, whose rows are `rows` (rows of sequences are contiguous, in order), as a
        forward of their own: a micro-batch (models/stages.py). Its rows count from 0; `first_seq`
        keeps where it sits in the round (KDA stages its rows there). The logits rows stay the
        whole forward's."""
        start, count = rows.start, rows.stop - rows.start
        q_index = self.q_index[a:b] - start
        if not self.dense:  # padding queries point past the last row
            q_index = torch.where(self.q_positions[a:b] >= 0, q_index, count)
        return dataclasses.replace(
            self, positions=self.positions[rows], slots=self.slots[rows], q_index=q_index,
            q_positions=self.q_positions[a:b], kv_lens=self.kv_lens[a:b], block_tables=self.block_tables[a:b],
            state_ids=None if self.state_ids is None else self.state_ids[a:b],
            rows=None if self.rows is None else self.rows[a:b], rows_own_slots=False, micro_batches=1,
            first_seq=self.first_seq + a, stagger=None, derived={})

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])
