"""The flashinfer backend on any machine: it imports without flashinfer (flashinfer is imported
when the backend is built, on a GPU host), and lays a forward out as flashinfer's plan takes it."""

from __future__ import annotations

import torch

from dflash_batch.backends.flashinfer_attention import _Layout


def layout() -> _Layout:
    return _Layout(q_lens=[8, 1, 3], kv_lens=[20, 16, 33], tables=[[5, 6, 7], [9], [1, 2, 3, 4]], rows=[0, 2, None],
                   page_size=16, generation=1)


def test_paged_layout_by_definition():
    """Query rows and pages per sequence, the last page's fill and the key lengths; a sequence's
    pages past its keys are left out (a batch row owns more pages than its sequence uses)."""
    qo_indptr, kv_indptr, kv_indices, last_page_len, kv_len = layout().paged()
    assert qo_indptr.tolist() == [0, 8, 9, 12]
    assert kv_indptr.tolist() == [0, 2, 3, 6]
    assert kv_indices.tolist() == [5, 6, 9, 1, 2, 3]
    assert last_page_len.tolist() == [4, 16, 1]
    assert kv_len.tolist() == [20, 16, 33]
    assert {t.dtype for t in (qo_indptr, kv_indptr, kv_indices, last_page_len, kv_len)} == {torch.int32}


def test_window_layout_by_definition():
    """Page size 1: the slots of each sequence's last `window` positions, in its pages, or in its
    batch row's ring (row r: ring pages r * 2 ..; a padding sequence: the scratch page 7)."""
    _, kv_indptr, slots, kv_len = layout().window(18, None, scratch_page=0)
    assert kv_indptr.tolist() == [0, 18, 34, 52] and kv_len.tolist() == [18, 16, 18]
    # sequence 0: positions 2..19 on pages 5 (2..15) and 6 (16..19); 1: 0..15 on page 9; 2: 15..32
    assert slots.tolist() == ([5 * 16 + p for p in range(2, 16)] + [6 * 16 + p for p in range(4)]
                              + [9 * 16 + p for p in range(16)]
                              + [1 * 16 + 15] + [2 * 16 + p for p in range(16)] + [3 * 16])
    _, _, ring_slots, _ = layout().window(18, 2, scratch_page=7)
    # row 0 owns ring pages 0, 1 (position p on page (p // 16) % 2); row 2 owns 4, 5
    assert ring_slots.tolist() == ([0 * 16 + p for p in range(2, 16)] + [1 * 16 + p for p in range(4)]
                                   + [4 * 16 + p for p in range(16)]
                                   + [7 * 16 + 15] + [7 * 16 + p for p in range(16)] + [7 * 16])
