"""Compile (JIT, nvcc) the flashinfer modules the GPU check uses, before the tests need them: the
paged prefill kernels for bf16, 64-wide heads, with and without a sliding window, and the MLA
kernel for bf16 at a 512 + 64 latent."""

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
mla = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws)
latent = torch.zeros(32, 1, 576, dtype=torch.bfloat16, device="cuda")
ql = torch.zeros(9, 16, 576, dtype=torch.bfloat16, device="cuda")
mla.plan(torch.tensor([0, 9], **i32), torch.tensor([0, 2], **i32), torch.tensor([0, 1], **i32),
         torch.tensor([32], **i32), num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=16, causal=True,
         sm_scale=0.1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
paged = latent.view(-1, 16, 576)
mla.run(ql[..., :512], ql[..., 512:], paged[..., :512], paged[..., 512:])
print(f"MLA 512 + 64: ready at {time.time() - t0:.0f} s", flush=True)
