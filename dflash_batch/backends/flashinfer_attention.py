"""Paged GQA attention through flashinfer on the GPU: every forward (prefill chunks, verify,
draft) goes through BatchPrefillWithPagedKVCacheWrapper over the same caches the torch backend
uses, viewed as [pages, page_size, kv_heads, head_dim] (NHD). Cache writes go through the
project's Triton scatter (slot -1 skipped).

flashinfer plans on the host: `plan` / `plan_round` record each named forward's layout (query
rows per sequence, its pages, key lengths) outside any graph. A wrapper exists per (forward,
mask variant) and, for captured rounds, per batch size (use_cuda_graph over static index
buffers, as SGLang and vLLM do); it is planned when its forward's layout changes: lazily on
first use in an eager forward, and by plan_round itself before a graph replays (the replay
calls no Python). The drafter's sliding layers use window_left = window - 1: keys at most
window - 1 before the query. flashinfer has no bound on the right, which a non-causal block sees
only when the window is shorter than the block (build.py refuses that pairing here). flashinfer
aligns queries to the end of the keys, so a draft block cut short by max_new_tokens sees its
window (and, for causal drafters, its causal edge) shifted by the rows it lacks: its drafts may
differ from the torch backend's in that last round, never the output, which verification decides.

Import-safe without flashinfer: it is imported when the backend is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_batch.backends.meta import AttnMeta
from kernels.scatter import scatter_triton


@dataclass
class _Layout:
    """A forward's CSR layout on the host (int32), as flashinfer's plan takes it."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    generation: int

    @classmethod
    def build(cls, q_lens: list[int], kv_lens: list[int], pages: list[list[int]], page_size: int,
              generation: int) -> _Layout:
        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32)

        q_ptr, kv_ptr, indices, last = [0], [0], [], []
        for q, kv, table in zip(q_lens, kv_lens, pages):
            n = -(-kv // page_size)
            indices += table[:n]
            q_ptr.append(q_ptr[-1] + q)
            kv_ptr.append(kv_ptr[-1] + n)
            last.append(kv - (n - 1) * page_size)
        return cls(i32(q_ptr), i32(kv_ptr), i32(indices), i32(last), generation)


class FlashInferAttention:
    name = "flashinfer"
    rings = False  # sliding layers keep whole caches here (their window is masked, not cut)

    def __init__(self, device: torch.device | str, workspace_bytes: int = 256 << 20):
        import flashinfer

        self.flashinfer = flashinfer
        self.device = torch.device(device)
        # One float workspace for every wrapper: forwards run one after another on one stream.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.layouts: dict[str, _Layout] = {}
        self.graph_rows: dict[str, int | None] = {}  # rows of the graph a forward is captured in
        self.wrappers: dict[tuple, tuple] = {}       # key -> (wrapper, plan arguments, planned generation)
        self.generation = 0

    # -- host side, outside any graph ----------------------------------------------------------
    def plan(self, meta: AttnMeta) -> None:
        """An eager forward built on the host (a prefill chunk): its layout from the meta."""
        T = meta.num_rows
        q_lens = (meta.q_index < T).sum(-1).tolist()
        self._set(meta.name, _Layout.build(q_lens, meta.kv_lens.tolist(), meta.block_tables.tolist(),
                                           meta.page_size, self._next()), None)

    def plan_round(self, batch, n: int, kv_lens: dict[str, list[int]], graph: bool) -> None:
        """A round's forwards over rows 0..n-1 of `batch`: rows past the lists are padding, given
        the scratch page (flashinfer needs every sequence to have keys)."""
        block, ps = batch.block, batch.page_size
        for name, lens in kv_lens.items():
            pad = [block] * (n - len(lens))
            scratch = [batch.scratch_page] * -(-block // ps)
            tables = [batch.host_tables[r] or scratch for r in range(len(lens))] + [scratch] * len(pad)
            self._set(name, _Layout.build([block] * n, lens + pad, tables, ps, self._next()), n if graph else None)
            # plan fills each wrapper's pinned host buffer and copies it to the device
            # asynchronously; the previous round's read-back has synchronised, so that copy of
            # the last plan is done before this one overwrites the buffer.
            if graph:  # a replay calls no Python: plan its wrappers now
                for key, (wrapper, args, planned) in list(self.wrappers.items()):
                    if key[0] == name and key[1] == n:
                        self._plan(key, wrapper, args)

    def _next(self) -> int:
        self.generation += 1
        return self.generation

    def _set(self, name: str, layout: _Layout, graph_rows: int | None) -> None:
        self.layouts[name] = layout
        self.graph_rows[name] = graph_rows

    def _plan(self, key: tuple, wrapper, args: dict) -> None:
        layout = self.layouts[key[0]]
        wrapper.plan(layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.last_page_len, **args)
        self.wrappers[key] = (wrapper, args, layout.generation)

    def _wrapper(self, meta: AttnMeta, q: torch.Tensor, k_cache: torch.Tensor, scale: float, causal: bool,
                 window: int | None):
        rows = self.graph_rows.get(meta.name)
        args = dict(num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[1], head_dim_qk=q.shape[2],
                    page_size=meta.page_size, causal=causal, sm_scale=scale,
                    window_left=window - 1 if window else -1, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        # A captured wrapper's buffers and row count are fixed by its first plan: one per shape.
        key = (meta.name, rows, meta.q_index.shape[1], meta.block_tables.shape[1], causal, window, scale,
               q.shape[1], k_cache.shape[1], q.shape[2], q.dtype)
        entry = self.wrappers.get(key)
        if entry is None:
            wrapper = self._new_wrapper(rows, meta.block_tables.shape[1])
            entry = (wrapper, args, -1)
        if entry[2] != self.layouts[meta.name].generation:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"flashinfer wrapper for {key} was not planned before capture")
            self._plan(key, entry[0], args)
        return self.wrappers[key][0]

    def _new_wrapper(self, rows: int | None, max_pages: int):
        prefill = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper
        if rows is None:
            return prefill(self.workspace, "NHD")

        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        # Static index buffers sized for the captured batch: plan copies each layout into them.
        return prefill(self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=buf(rows + 1),
                       paged_kv_indptr_buf=buf(rows + 1), paged_kv_indices_buf=buf(rows * (max_pages + 1)),
                       paged_kv_last_page_len_buf=buf(rows))

    # -- inside the forward (and the graph) ----------------------------------------------------
    def write(self, cache: torch.Tensor, meta: AttnMeta, values: torch.Tensor) -> None:
        scatter_triton(cache, meta.slots, values)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
               scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        wrapper = self._wrapper(meta, q, k_cache, scale, causal, window)
        paged = (k_cache.view(-1, meta.page_size, *k_cache.shape[1:]),
                 v_cache.view(-1, meta.page_size, *v_cache.shape[1:]))
        return wrapper.run(q.contiguous(), paged)

    def attend_latent(self, q: torch.Tensor, cache: torch.Tensor, v_width: int, meta: AttnMeta,
                      scale: float, causal: bool = True, window: int | None = None) -> torch.Tensor:
        raise NotImplementedError("MLA attention on flashinfer comes with the MLA path; "
                                  "resolve_engine keeps MLA models on the torch backend")
