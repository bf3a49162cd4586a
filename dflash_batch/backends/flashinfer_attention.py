"""Paged attention through flashinfer on the GPU, over the same caches the torch backend uses.

GQA layers (`attend`) go through BatchPrefillWithPagedKVCacheWrapper, the caches viewed as
[pages, page_size, kv_heads, head_dim] (NHD); the drafter's sliding layers use window_left =
window - 1. Absorbed MLA layers (`attend_latent`: Kimi-K3's and the DFlash2-MLA drafter's) go
through BatchMLAPagedAttentionWrapper, the latent cache [slots, 1, kl + dr] viewed as its
kl-wide compressed part and dr-wide rope part: whole layers page by page, causal bottom-right
(prefill chunks, verify) or not (the drafter's full layer); sliding layers slot by slot over the
last query's window plus an edge strip in torch (flashinfer_latent.py), and these read rings.
Cache writes go through the project's Triton scatter (slot -1 skipped).

flashinfer plans on the host: `plan` / `plan_round` record each named forward's layout (query
rows per sequence, key lengths, pages, batch rows) outside any graph. A wrapper exists per
(forward, kind of read) and, for captured rounds, per batch size (use_cuda_graph over static
index buffers, as SGLang and vLLM do); it is planned when its forward's layout changes: lazily
on first use in an eager forward, and by plan_round itself before a graph replays (the replay
calls no Python). flashinfer has no bound on the right of a GQA window, which a non-causal block
sees only when the window is shorter than the block (build.py refuses that pairing here).
flashinfer aligns queries to the end of the keys, so a draft block cut short by max_new_tokens
sees its window (and, for causal drafters, its causal edge) shifted by the rows it lacks: its
drafts may differ from the torch backend's in that last round, never the output, which
verification decides.

Under a latent split (engine.context_parallel) every rank gathers all ranks' query heads, hands
the wrapper the positions it keeps (flashinfer_split.py: the same page ids at page_size / TP,
causal chunks as chains of queries TP apart, queries that see no key here marked dead), asks for
the natural log-sum-exps and merges across the ranks (latent_split.merge_across_ranks); writes go
to the owning rank's rows only.

Import-safe without flashinfer: it is imported when the backend is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash_batch import parallel
from dflash_batch.backends.flashinfer_latent import edge_strip
from dflash_batch.backends.flashinfer_split import SplitRows, paged_rows, position_slots, window_rows
from dflash_batch.backends.latent_split import LatentSplit, merge_across_ranks
from dflash_batch.backends.meta import AttnMeta
from dflash_batch.backends.torch_attention import merge_attention
from dflash_batch.kernels.scatter import scatter_triton

RING = ".ring"  # AttnMeta.ring_view names a forward's ring view `<name>.ring`


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _i32(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32)


@dataclass
class _Layout:
    """A forward's sequences on the host: query rows, key length, pages and batch row of each
    (None: a padding sequence, on the scratch page), and the CSR forms flashinfer plans from."""

    q_lens: list[int]
    kv_lens: list[int]
    tables: list[list[int]]
    rows: list[int | None]
    page_size: int
    generation: int
    cache: dict = field(default_factory=dict)

    def paged(self) -> tuple[torch.Tensor, ...]:
        """(qo_indptr, kv_indptr, kv_indices, last_page_len, kv_len) over whole pages."""
        if "paged" not in self.cache:
            ps = self.page_size
            pages = [-(-kv // ps) for kv in self.kv_lens]
            indices = [p for table, n in zip(self.tables, pages) for p in table[:n]]
            self.cache["paged"] = (self._qo_indptr(), _i32([0, *torch.tensor(pages).cumsum(0).tolist()]),
                                   _i32(indices), _i32([kv - (n - 1) * ps for kv, n in zip(self.kv_lens, pages)]),
                                   _i32(self.kv_lens))
        return self.cache["paged"]

    def window(self, window: int, ring_pages: int | None, scratch_page: int) -> tuple[torch.Tensor, ...]:
        """(qo_indptr, kv_indptr, kv_indices, kv_len) over the slots of each sequence's last
        `window` positions (page size 1), in its pages or, with ring_pages, in its batch row's ring
        (row r owns ring pages r * ring_pages ..; padding sequences read the scratch page)."""
        key = ("window", window, ring_pages)
        if key not in self.cache:
            ps, n = self.page_size, len(self.kv_lens)
            hi = torch.tensor(self.kv_lens)
            lo = (hi - window).clamp_min(0)
            counts = hi - lo
            seq = torch.repeat_interleave(torch.arange(n), counts)
            first = counts.cumsum(0) - counts
            pos = lo[seq] + torch.arange(int(counts.sum())) - first[seq]
            slots = position_slots(self.tables, self.rows, seq, pos, ps, ring_pages, scratch_page)
            self.cache[key] = (self._qo_indptr(), _i32([0, *counts.cumsum(0).tolist()]), _i32(slots), _i32(counts))
        return self.cache[key]

    def split_rows(self, split: LatentSplit, causal: bool, window: int | None, ring_pages: int | None,
                   scratch_page: int, one_per_query: bool) -> SplitRows:
        """This forward over the positions `split`'s rank keeps (flashinfer_split.py)."""
        key = ("split", causal, window, ring_pages, one_per_query)
        if key not in self.cache:
            if window is None:
                self.cache[key] = paged_rows(self.q_lens, self.kv_lens, self.tables, self.page_size, split, causal,
                                             one_per_query, scratch_page)
            else:
                self.cache[key] = window_rows(self.q_lens, self.kv_lens, self.tables, self.rows, self.page_size,
                                              split, window, ring_pages, scratch_page)
        return self.cache[key]

    def _qo_indptr(self) -> torch.Tensor:
        return _i32([0, *torch.tensor(self.q_lens).cumsum(0).tolist()])


@dataclass
class _Entry:
    wrapper: object
    plan: Callable[[_Layout], None]  # plans the wrapper for a layout of its forward
    generation: int = -1             # the layout it was planned for
    # A latent split's reorder and dead rows (flashinfer_split.SplitRows) on the device, refilled
    # in place by each plan (a captured round reads them): "order", "inverse", "dead".
    rows: dict[str, torch.Tensor] = field(default_factory=dict)

    def keep(self, rows: SplitRows, device: torch.device) -> None:
        order = rows.order
        values = {"dead": rows.dead} | ({} if order is None else {"order": order, "inverse": torch.argsort(order)})
        if values.keys() != self.rows.keys():
            self.rows = {}
        for name, value in values.items():
            if name in self.rows and self.rows[name].shape == value.shape:
                self.rows[name].copy_(value)
            else:  # a captured wrapper's shapes never change: only an eager one's buffers are replaced
                self.rows[name] = value.to(device)


class FlashInferAttention:
    name = "flashinfer"
    splits_rounds = False  # plan_round lays a round out whole
    plans_on_host = True

    def __init__(self, device: torch.device | str, latent_rings: bool = True, workspace_bytes: int = 256 << 20,
                 split: LatentSplit | None = None):
        """`latent_rings` False: MLA drafters' sliding layers keep whole caches too (tests).
        `split`: the MLA latent caches are split across the ranks by token (latent_split.py)."""
        import flashinfer

        self.flashinfer = flashinfer
        self.device = torch.device(device)
        self.split = split
        self.latent_rings = latent_rings
        # One float workspace for every wrapper: forwards run one after another on one stream.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.layouts: dict[str, _Layout] = {}
        self.graph_rows: dict[str, int | None] = {}  # rows of the graph a forward is captured in
        self.wrappers: dict[tuple, _Entry] = {}      # (forward, graph rows, ...) -> its wrapper
        self.ring_pages: int | None = None
        self.ring_scratch = 0     # the ring caches' scratch page (padding sequences read it)
        self.scratch_page = 0     # the other caches' scratch page
        self.generation = 0

    def reads_rings(self, latent: bool) -> bool:
        """The latent (MLA) path reads rings; a GQA drafter's sliding layers keep whole caches
        here, their window masked by flashinfer, not cut."""
        return latent and self.latent_rings

    # -- host side, outside any graph ----------------------------------------------------------
    def plan(self, meta: AttnMeta) -> None:
        """An eager forward built on the host (a prefill chunk: no ring is read): its layout
        from the meta."""
        T = meta.num_rows
        q_lens = (meta.q_index < T).sum(-1).tolist()
        rows = meta.rows.tolist() if meta.rows is not None else [None] * len(q_lens)
        self._set(meta.name, _Layout(q_lens, meta.kv_lens.tolist(), meta.block_tables.tolist(), rows,
                                     meta.page_size, self._next()), None)

    def plan_round(self, batch, n: int, kv_lens: dict[str, list[int]], graph: bool,
                   widths: dict[str, int | list[int]] | None = None) -> None:
        """A round's forwards over rows 0..n-1 of `batch`: rows past the lists are padding, given
        the scratch page (flashinfer needs every sequence to have keys). A width given as a list
        is each row's (a ragged verify, engine/row_drafts.py: eager only)."""
        ps = batch.page_size
        self.scratch_page = batch.scratch_page
        if batch.ring is not None:
            self._set_ring(batch.ring.pages, batch.scratch_state)  # scratch_state: the rows that run sequences
        for name, lens in kv_lens.items():
            width = (widths or {}).get(name, batch.block)  # query rows a sequence has in this forward
            q_lens = width if isinstance(width, list) else [width] * n
            block = max(q_lens)
            pad = [block] * (n - len(lens))
            scratch = [batch.scratch_page] * -(-block // ps)
            tables = [batch.host_pages(r) or scratch for r in range(len(lens))] + [scratch] * len(pad)
            # the batch row of each (a lane's rows start at its first: engine/lanes.py)
            rows = [batch.first_row + r if batch.host_pages(r) else None for r in range(len(lens))] + [None] * len(pad)
            self._set(name, _Layout(q_lens, lens + pad, tables, rows, ps, self._next()), n if graph else None)
            # plan fills each wrapper's pinned host buffer and copies it to the device
            # asynchronously; the previous round's read-back has synchronised, so that copy of
            # the last plan is done before this one overwrites the buffer.
            if graph:  # a replay calls no Python: plan its wrappers now (those of this batch's shape)
                shape = (name, n, block, batch.tables.shape[1])  # _wrapper's key: q rows are the width
                for key, entry in self.wrappers.items():
                    if key[:4] == shape:
                        self._plan(entry, name)

    def _set_ring(self, pages: int, sequences: int) -> None:
        # Ring caches hold `sequences` rows of `pages` pages, then their scratch page (meta.Ring).
        self.ring_pages, self.ring_scratch = pages, sequences * pages

    def _next(self) -> int:
        self.generation += 1
        return self.generation

    def _set(self, name: str, layout: _Layout, graph_rows: int | None) -> None:
        self.layouts[name] = layout
        self.graph_rows[name] = graph_rows

    def _plan(self, entry: _Entry, name: str) -> None:
        layout = self.layouts[name]
        entry.plan(layout)
        entry.generation = layout.generation

    def _wrapper(self, name: str, meta: AttnMeta, key: tuple, make: Callable[[int | None], _Entry]):
        """The wrapper of forward `name` (rows of meta's shape) under `key`, planned for the
        forward's current layout; `make(graph rows)` builds it (a captured wrapper's buffers and
        row count are fixed by its first plan: one per shape)."""
        rows = self.graph_rows.get(name)
        key = (name, rows, meta.q_index.shape[1], meta.block_tables.shape[1], *key)
        entry = self.wrappers.get(key)
        if entry is None:
            entry = self.wrappers[key] = make(rows)
        if entry.generation != self.layouts[name].generation:
            if capturing(self.device):
                raise RuntimeError(f"flashinfer wrapper for {key} was not planned before capture")
            self._plan(entry, name)
        return entry

    def _buffers(self, rows: int, indices: int) -> dict[str, torch.Tensor]:
        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        return dict(qo_indptr=buf(rows + 1), kv_indptr=buf(rows + 1), kv_indices=buf(indices), kv_len_arr=buf(rows))

    # -- inside the forward (and the graph) ----------------------------------------------------
    def write(self, cache: torch.Tensor, meta: AttnMeta, values: torch.Tensor) -> None:
        # Under a split every cache written is a latent cache (build.py: MLA pairs only).
        split = self.split
        slots = meta.slots if not split else meta.shared("split_slots", lambda: split.write_rows(meta.slots, -1))
        scatter_triton(cache, slots, values)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
               scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        if meta.name.endswith(RING):
            raise ValueError("flashinfer's GQA path reads whole caches, not rings (reads_rings(latent=False))")
        max_pages = meta.block_tables.shape[1]
        args = dict(num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[1], head_dim_qk=q.shape[2],
                    page_size=meta.page_size, causal=causal, sm_scale=scale,
                    window_left=window - 1 if window else -1, q_data_type=q.dtype, kv_data_type=k_cache.dtype)

        def make(rows: int | None) -> _Entry:
            prefill = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper
            if rows is None:
                wrapper = prefill(self.workspace, "NHD")
            else:  # static index buffers sized for the captured batch: plan copies each layout into them
                b = self._buffers(rows, rows * (max_pages + 1))
                wrapper = prefill(self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=b["qo_indptr"],
                                  paged_kv_indptr_buf=b["kv_indptr"], paged_kv_indices_buf=b["kv_indices"],
                                  paged_kv_last_page_len_buf=b["kv_len_arr"])
            return _Entry(wrapper, lambda layout: wrapper.plan(*layout.paged()[:4], **args))

        key = ("gqa", causal, window, scale, q.shape[1], k_cache.shape[1], q.shape[2], q.dtype, k_cache.dtype)
        wrapper = self._wrapper(meta.name, meta, key, make).wrapper
        paged = (k_cache.view(-1, meta.page_size, *k_cache.shape[1:]),
                 v_cache.view(-1, meta.page_size, *v_cache.shape[1:]))
        return wrapper.run(q.contiguous(), paged)

    def attend_latent(self, q: torch.Tensor, cache: torch.Tensor, v_width: int, meta: AttnMeta,
                      scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        """Absorbed MLA; see the module doc. A sliding layer's block must be dense, non-causal and
        no longer than the window (the DFlash2-MLA drafter's; build.py refuses others here). Under
        a latent split every rank's heads attend over the positions this rank keeps
        (flashinfer_split.py), merged across the ranks by their log-sum-exps."""
        name = meta.name.removesuffix(RING)
        ring = meta.name.endswith(RING)
        if window is not None and (causal or not meta.dense or window < meta.q_index.shape[1]):
            raise ValueError("flashinfer's latent path takes sliding windows over dense non-causal blocks no "
                             "longer than the window (a shorter window bounds a block's keys on the right too)")
        split = self.split
        if split:
            q = parallel.all_gather_dim1(q)
        ways = split.ways if split else 1
        ps = meta.page_size // ways if window is None else 1
        max_pages = meta.block_tables.shape[1]
        args = dict(num_heads=q.shape[1], head_dim_ckv=v_width, head_dim_kpe=q.shape[2] - v_width, page_size=ps,
                    causal=causal, sm_scale=scale, q_data_type=q.dtype, kv_data_type=cache.dtype)
        scratch = self.ring_scratch if ring else self.scratch_page

        def make(rows: int | None) -> _Entry:
            mla = self.flashinfer.mla.BatchMLAPagedAttentionWrapper
            if rows is None:
                wrapper = mla(self.workspace)
            else:
                # Split, a captured causal forward hands the wrapper one sequence a query.
                seqs = rows * meta.q_index.shape[1] if split and causal and window is None else rows
                wrapper = mla(self.workspace, use_cuda_graph=True,
                              **self._buffers(seqs, seqs * (window if window else max_pages + 1)))
            entry = _Entry(wrapper, lambda layout: None)

            def plan(layout: _Layout) -> None:
                if split:
                    split_rows = layout.split_rows(split, causal, window, self.ring_pages if ring else None, scratch,
                                                   one_per_query=rows is not None)
                    entry.keep(split_rows, self.device)
                    csr = split_rows.csr
                elif window is None:
                    qo, kv_ptr, indices, _, kv_len = layout.paged()
                    csr = qo, kv_ptr, indices, kv_len
                else:
                    csr = layout.window(window, self.ring_pages if ring else None, scratch)
                wrapper.plan(*csr, **args)
            entry.plan = plan
            return entry

        key = ("mla", ring, causal, window, scale, q.shape[1], q.shape[2], v_width, q.dtype, cache.dtype)
        entry = self._wrapper(name, meta, key, make)
        paged = cache.view(-1, ps, cache.shape[-1])
        if not split:
            q_nope, q_pe, ckv, kpe = q[..., :v_width], q[..., v_width:], paged[..., :v_width], paged[..., v_width:]
            if window is None:
                return entry.wrapper.run(q_nope, q_pe, ckv, kpe)
            out, lse = entry.wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
            strip = edge_strip(q, cache, v_width, meta, scale, window)
            return merge_attention(out, lse[..., None], *strip)[0].to(q.dtype)
        rows = entry.rows
        q_in = q.index_select(0, rows["order"]) if "order" in rows else q
        out, lse = entry.wrapper.run(q_in[..., :v_width], q_in[..., v_width:], paged[..., :v_width],
                                     paged[..., v_width:], return_lse=True, return_lse_base_on_e=True)
        if "order" in rows:
            out, lse = out.index_select(0, rows["inverse"]), lse.index_select(0, rows["inverse"])
        # A dead row's output is whatever the kernel made of the scratch key: replaced, not weighted.
        dead = rows["dead"]
        out = out.masked_fill(dead[:, None, None], 0.0)
        lse = lse.masked_fill(dead[:, None], float("-inf"))
        if window is not None:
            out, lse = merge_attention(out, lse[..., None], *edge_strip(q, cache, v_width, meta, scale, window, split))
            lse = lse[..., 0]
        return merge_across_ranks(out, lse).to(q.dtype)
