"""The latent split (latent_split.py) through flashinfer's MLA wrapper: what each rank hands it.

Rank r of `ways` keeps positions r, r + ways, ... of every sequence, global slot s at local row
s div ways, so page P's kept positions are local page P at page size page_size / ways: the page
tables stay. What changes is which keys a query sees here. A query at position p sees the
`kept_below(p + 1)` kept positions up to it; over a causal chunk's consecutive queries that count
grows by one every `ways` queries, so the wrapper's bottom-right mask (one more key a query) holds
not for a sequence's queries but for each chain of them `ways` apart. Each chain is one of the
wrapper's sequences, its queries gathered together and put back after (prefill chunks). A
captured round keeps a fixed count of the wrapper's sequences: one a query (a block of 8 at TP8
or wider is that already), in the forward's order. A non-causal block's queries all see
`kept_below(kv_len)` keys; a sliding layer's, the kept positions of their window.

A query that sees no key here (a position below this rank's first; a context shorter than the
ranks) is handed the scratch page's first row and marked dead: the backend gives it output 0 and
log-sum-exp -inf, which the merge across ranks weights 0 (the wrapper needs a key a sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_batch.backends.latent_split import LatentSplit


@dataclass(frozen=True)
class SplitRows:
    """One forward's sequences as a rank's wrapper takes them (host tensors)."""

    csr: tuple[torch.Tensor, ...]  # qo_indptr, kv_indptr, kv_indices, kv_len_arr (int32)
    order: torch.Tensor | None     # [T] forward row of each wrapper row (None: the forward's order)
    dead: torch.Tensor             # [T] bool: forward rows that see no key on this rank


def position_slots(tables: list[list[int]], rows: list[int | None], seq: torch.Tensor, pos: torch.Tensor,
                   page_size: int, ring_pages: int | None, scratch_page: int) -> torch.Tensor:
    """Global cache slot of position pos[k] of sequence seq[k]: in its pages or, with ring_pages, in
    its batch row's ring (row r owns ring pages r * ring_pages ..; no row: the scratch page)."""
    if ring_pages is None:
        padded = _padded(tables, scratch_page)
        page = padded[seq, (pos // page_size).clamp(max=padded.shape[1] - 1)]
    else:
        row = torch.tensor([-1 if r is None else r for r in rows])[seq]
        page = torch.where(row >= 0, row * ring_pages + (pos // page_size) % ring_pages, scratch_page)
    return page * page_size + pos % page_size


def _padded(tables: list[list[int]], scratch_page: int) -> torch.Tensor:
    """[sequences, widest table] page ids, short tables padded with the scratch page."""
    width = max(map(len, tables))
    return torch.tensor([t + [scratch_page] * (width - len(t)) for t in tables])


def _i32(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.int32)


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    return _i32(torch.cat([counts.new_zeros(1), counts.cumsum(0)]))


def paged_rows(q_lens: list[int], kv_lens: list[int], tables: list[list[int]], page_size: int,
               split: LatentSplit, causal: bool, one_per_query: bool, scratch_page: int) -> SplitRows:
    """A whole-context layer's forward (queries the last q_lens[b] positions of kv_lens[b]) over
    this rank's kept positions, at local page size page_size / ways. `one_per_query`: each query
    its own wrapper sequence, in order (a captured round's fixed count)."""
    ways = split.ways
    q, kv_len = torch.tensor(q_lens), torch.tensor(kv_lens)
    n, total = len(q_lens), int(q.sum())
    seq = torch.repeat_interleave(torch.arange(n), q)
    index = torch.arange(total) - (q.cumsum(0) - q)[seq]    # query index within its sequence
    pos = kv_len[seq] - q[seq] + index
    seen = split.kept_below(pos + 1 if causal else kv_len[seq])
    dead = seen == 0
    chains = causal and not one_per_query  # the only wrapper sequences that reorder queries
    if not causal:
        chain = seq  # every query of a sequence sees the same keys
    elif one_per_query:
        chain = torch.arange(total)
    else:  # queries `ways` apart see one more key each; a dead one goes alone (the scratch key)
        chain = torch.where(dead, n * ways + torch.arange(total), seq * ways + index % ways)
    order = torch.argsort(chain * total + index) if chains else torch.arange(total)
    _, counts = torch.unique_consecutive(chain[order], return_counts=True)
    last = order[counts.cumsum(0) - 1]                      # each chain's last query (forward row)
    keys, owner = seen[last], seq[last]
    empty = keys == 0
    keys = torch.where(empty, 1, keys)
    local_page = page_size // ways
    pages = -(-keys // local_page)
    chain_tables = torch.where(empty[:, None], scratch_page, _padded(tables, scratch_page)[owner])
    indices = chain_tables[torch.arange(chain_tables.shape[1])[None, :] < pages[:, None]]
    reordered = chains and not bool((order == torch.arange(total)).all())
    return SplitRows((_indptr(counts), _indptr(pages), _i32(indices), _i32(keys)), order if reordered else None, dead)


def window_rows(q_lens: list[int], kv_lens: list[int], tables: list[list[int]], rows: list[int | None],
                page_size: int, split: LatentSplit, window: int, ring_pages: int | None,
                scratch_page: int) -> SplitRows:
    """A sliding layer's dense non-causal block: each sequence's kept positions of the window
    [kv_len - window, kv_len), slot by slot (local page size 1), in its pages or its ring."""
    ways = split.ways
    q, kv_len = torch.tensor(q_lens), torch.tensor(kv_lens)
    low = (kv_len - window).clamp_min(0)
    counts = split.kept_below(kv_len) - split.kept_below(low)
    empty = counts == 0
    counts = torch.where(empty, 1, counts)
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), counts)
    pos = split.first_kept(low)[seq] + ways * (torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts)[seq])
    slots = position_slots(tables, rows, seq, pos, page_size, ring_pages, scratch_page)
    slots = torch.where(empty[seq], scratch_page * page_size, slots)
    dead = torch.repeat_interleave(empty, q)
    return SplitRows((_indptr(q), _indptr(counts), _i32(slots // ways), _i32(counts)), None, dead)
