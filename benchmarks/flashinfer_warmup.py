"""Compile (JIT, nvcc) the flashinfer modules the GPU check uses, before the tests need them: the
paged prefill kernels for bf16, 64-wide heads, with and without a sliding window."""

from __future__ import annotations

import time

import torch

import flashinfer

t0 = time.time()
ws = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
k = torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
q = torch.zeros(9, 4, 64, dtype=torch.bfloat16, device="cuda")
i32 = dict(dtype=torch.int32)
for causal, window in ((True, -1), (False, -1), (False, 23)):
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(torch.tensor([0, 9], **i32), torch.tensor([0, 2], **i32), torch.tensor([0, 1], **i32),
           torch.tensor([16], **i32), num_qo_heads=4, num_kv_heads=2, head_dim_qk=64, page_size=16,
           causal=causal, window_left=window, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    w.run(q, (k, k))
    print(f"causal={causal} window_left={window}: ready at {time.time() - t0:.0f} s", flush=True)
