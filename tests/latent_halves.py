"""What one GPU can show of the latent split (backends/latent_split.py) through flashinfer's MLA
wrapper: attention over a sequence's latents kept in two interleaved halves (positions p with p mod
2 == r, slot s at row s div 2 of half r: each page of P slots a page of P/2 there), each half's
output merged by the log-sum-exps the wrapper returns, equals attention over the whole cache.
The GPU check runs it on flashinfer under a CUDA graph (tests/test_gpu.py); the CPU on
tests/fake_flashinfer.py's wrapper (tests/test_flashinfer_latent.py)."""

from __future__ import annotations

import torch

from dflash_batch.backends.torch_attention import merge_attention

PAGE, HEADS, CKV, KPE = 16, 16, 512, 64
LENGTHS = [37, 2, 100, 64]  # keys of each decoding sequence (each half holds some)


def _run(wrapper_cls, cache: torch.Tensor, q: torch.Tensor, lengths: list[int], page: int, graphs: bool):
    """One decode query a sequence over its first lengths[b] slots of pages b*8.. of `cache`
    [slots, 576]: (out [n, heads, 512], natural log-sum-exp [n, heads])."""
    device, n = q.device, len(lengths)
    pages = [-(-length // page) for length in lengths]
    i32 = dict(dtype=torch.int32, device=device)
    qo = torch.arange(n + 1, **i32)
    kv_ptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], **i32)
    indices = torch.tensor([b * 8 + p for b, count in enumerate(pages) for p in range(count)], **i32)
    kv_len = torch.tensor(lengths, **i32)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    bufs = dict(qo_indptr=torch.empty_like(qo), kv_indptr=torch.empty_like(kv_ptr),
                kv_indices=torch.empty(n * 8, **i32), kv_len_arr=torch.empty_like(kv_len))
    wrapper = wrapper_cls(workspace, use_cuda_graph=True, **bufs) if graphs else wrapper_cls(workspace)
    wrapper.plan(qo, kv_ptr, indices, kv_len, HEADS, CKV, KPE, page, False, (128 + 64) ** -0.5, q.dtype, cache.dtype)
    paged = cache.view(-1, page, CKV + KPE)

    def attend():
        return wrapper.run(q[..., :CKV], q[..., CKV:], paged[..., :CKV], paged[..., CKV:], return_lse=True,
                           return_lse_base_on_e=True)
    if not graphs:
        return attend()
    attend()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attend()
    out.zero_()
    graph.replay()
    return out, lse


def split_halves_error(wrapper_cls, device: str, graphs: bool) -> tuple[float, float, float]:
    """(the merged halves' largest error against the whole, the log-sum-exps' largest error, and the
    error of merging the halves without their log-sum-exps: a plain average)."""
    g = torch.Generator(device=device).manual_seed(0)
    cache = (torch.randn(len(LENGTHS) * 8 * PAGE, CKV + KPE, generator=g, device=device) * 0.5).to(torch.bfloat16)
    q = (torch.randn(len(LENGTHS), HEADS, CKV + KPE, generator=g, device=device) * 0.5).to(torch.bfloat16)
    whole, whole_lse = _run(wrapper_cls, cache, q, LENGTHS, PAGE, graphs)
    parts = []
    for r in (0, 1):
        half = cache.view(-1, 2, CKV + KPE)[:, r].contiguous()  # slot s -> half s mod 2, row s div 2
        parts.append(_run(wrapper_cls, half, q, [(length - r + 1) // 2 for length in LENGTHS], PAGE // 2, graphs))
    (a, lse_a), (b, lse_b) = parts
    merged, lse = merge_attention(a.float(), lse_a[..., None], b.float(), lse_b[..., None])
    plain = (a.float() + b.float()) / 2
    return ((merged - whole.float()).abs().max().item(), (lse[..., 0] - whole_lse).abs().max().item(),
            (plain - whole.float()).abs().max().item())
