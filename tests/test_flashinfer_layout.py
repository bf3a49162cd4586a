"""The flashinfer backend on any machine: it imports without flashinfer (flashinfer is imported
when the backend is built, on a GPU host), and lays a forward out as flashinfer's plan takes it."""

from __future__ import annotations

import torch

from dflash_batch.backends.flashinfer_attention import _Layout


def test_layout_by_definition():
    """Query rows and pages per sequence, and the last page's fill; a sequence's pages past its
    keys are left out (a batch row owns more pages than its sequence uses)."""
    layout = _Layout.build(q_lens=[8, 1, 3], kv_lens=[20, 16, 33], pages=[[5, 6, 7], [9], [1, 2, 3, 4]],
                           page_size=16, generation=1)
    assert layout.qo_indptr.tolist() == [0, 8, 9, 12]
    assert layout.kv_indptr.tolist() == [0, 2, 3, 6]
    assert layout.kv_indices.tolist() == [5, 6, 9, 1, 2, 3]
    assert layout.last_page_len.tolist() == [4, 16, 1]
    assert {t.dtype for t in (layout.qo_indptr, layout.kv_indptr, layout.kv_indices)} == {torch.int32}
