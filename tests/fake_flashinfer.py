"""flashinfer's MLA wrapper as its source documents it (flashinfer 0.6.13, mla/_core.py and
include/flashinfer/attention/mla.cuh), in torch, so the backend's planning, slot lists, graph
buffers and edge-strip merge run on the CPU:

- plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
  page_size, causal, sm_scale, q_data_type, kv_data_type): sequence b's queries are rows
  qo_indptr[b]..; its keys the first kv_len_arr[b] tokens of pages kv_indices[kv_indptr[b]..],
  in order. With use_cuda_graph the layout is copied into the caller's buffers (too small:
  an error), and run reads those buffers, as a replayed graph would.
- run(q_nope, q_pe, ckv [pages, page_size, ckv], kpe [pages, page_size, kpe]): softmax over
  (q_nope . ckv + q_pe . kpe) * sm_scale of ckv; causal: key i visible to query j iff
  i + qo_len <= kv_len + j (bottom-right); return_lse: base 2 unless return_lse_base_on_e.

Strict where the real one is undefined: a query with no visible key raises.
"""

from __future__ import annotations

import math
import sys
import types

import torch

from tests.emulated_graphs import kernel


class BatchMLAPagedAttentionWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend: str = "auto"):
        self.use_cuda_graph = use_cuda_graph
        self.bufs = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        given = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)
        for name, value in given.items():
            assert value.dtype == torch.int32, name
        if self.use_cuda_graph:
            for name, value in given.items():
                buf = self.bufs[name]
                if name != "kv_indices" and len(buf) != len(value):
                    raise ValueError(f"{name}: the graph's buffer holds {len(buf)}, the plan {len(value)}")
                buf[:len(value)].copy_(value)  # raises when the buffer is too small
        else:
            self.bufs = {name: value.clone() for name, value in given.items()}
        self.args = dict(heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe, page_size=page_size, causal=causal,
                         scale=sm_scale, q_dtype=q_data_type, kv_dtype=kv_data_type)
        self.plans += 1

    @kernel  # one device kernel: a captured round records the call; its replay reads the planned buffers
    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, profiler_buffer=None,
            kv_len=None, page_table=None, return_lse_base_on_e=False):
        a = self.args
        assert q_nope.shape[1:] == (a["heads"], a["ckv"]) and q_pe.shape[1:] == (a["heads"], a["kpe"])
        assert ckv_cache.shape[1:] == (a["page_size"], a["ckv"]) and kpe_cache.shape[1:] == (a["page_size"], a["kpe"])
        assert q_nope.dtype == a["q_dtype"] and ckv_cache.dtype == a["kv_dtype"]
        assert q_nope.stride(-1) == q_pe.stride(-1) == ckv_cache.stride(-1) == kpe_cache.stride(-1) == 1
        qo, kv_ptr, indices, kv_lens = (self.bufs[n].tolist() for n in ("qo_indptr", "kv_indptr", "kv_indices",
                                                                         "kv_len_arr"))
        q = torch.cat([q_nope, q_pe], -1).double()
        keys = torch.cat([ckv_cache, kpe_cache], -1).double()
        o = torch.zeros(q.shape[0], a["heads"], a["ckv"], dtype=torch.float64)
        lses = torch.zeros(q.shape[0], a["heads"], dtype=torch.float64)
        for b in range(len(qo) - 1):
            k = keys[indices[kv_ptr[b]:kv_ptr[b + 1]]].reshape(-1, keys.shape[-1])[:kv_lens[b]]
            rows = q[qo[b]:qo[b + 1]]
            scores = torch.einsum("qhw,kw->qhk", rows, k) * a["scale"]
            if a["causal"]:
                i, j = torch.arange(len(k)), torch.arange(len(rows))
                visible = i[None, :] + len(rows) <= kv_lens[b] + j[:, None]
                if not visible.any(-1).all():
                    raise ValueError(f"sequence {b}: a query sees no key")
                scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            if len(k) == 0:
                raise ValueError(f"sequence {b}: no keys")
            lse_b = torch.logsumexp(scores, -1)
            o[qo[b]:qo[b + 1]] = torch.einsum("qhk,kv->qhv", torch.exp(scores - lse_b[..., None]), k[:, :a["ckv"]])
            lses[qo[b]:qo[b + 1]] = lse_b if return_lse_base_on_e else lse_b / math.log(2)
        o = o.to(q_nope.dtype)
        return (o, lses.float()) if return_lse else o


def module() -> types.ModuleType:
    """A `flashinfer` module holding this module's wrapper."""
    fake = types.ModuleType("flashinfer")
    fake.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper)
    return fake


def install(monkeypatch) -> types.ModuleType:
    """Make `import flashinfer` give this module's wrapper (for the test's duration)."""
    fake = module()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    return fake

