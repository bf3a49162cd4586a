"""kernels/attn_res.py: the torch reference is Kimi-K3's attn_res_mix; the Triton kernel (on the CPU
under TRITON_INTERPRET=1) equals the reference in float32 and bfloat16, for odd widths, partial
token blocks, lists, stacked and strided values, and stays finite where the scores run to
thousands (a naive exp overflows float32 past 88)."""

from __future__ import annotations

import pytest
import torch

from dflash_batch.kernels import _triton
from dflash_batch.kernels.attn_res import attn_res_torch, attn_res_triton
from dflash_batch.models.kimi_k3 import attn_res_mix
from dflash_batch.models.layers.dtypes import wide
from dflash_batch.models.layers.linear import ReplicatedLinear
from dflash_batch.models.layers.norm import RMSNorm
from tests.numerics import assert_close

needs_triton = pytest.mark.skipif(not _triton.available(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
REL = 1e-5  # float32: of the output's magnitude
BF16_ULP = 2 ** -7  # one bfloat16 ulp is at most this fraction of a value

pytestmark = pytest.mark.numerics


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_values(N: int, T: int, H: int, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = gen(seed)
    return [scale * torch.randn(T, H, generator=g) for _ in range(N)]


def random_w(H: int, seed: int) -> torch.Tensor:
    """norm.w * proj.w for weights near what training leaves (norm ~1, projection ~H^-1/2)."""
    g = gen(seed)
    return (1 + 0.1 * torch.randn(H, generator=g)) * torch.randn(H, generator=g) * H ** -0.5


@pytest.mark.parametrize("N", [1, 2, 5])
def test_attn_res_torch_equals_kimi_mix(N):
    T, H = 9, 48
    norm = RMSNorm(H, EPS).to(torch.float64)
    proj = ReplicatedLinear(H, 1).to(torch.float64)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=gen(1), dtype=torch.float64))
        proj.weight.copy_(torch.randn(1, H, generator=gen(2), dtype=torch.float64))
    values = [v.double() for v in random_values(N, T, H, N)]
    want = attn_res_mix(values[-1], values[:-1], norm, proj)
    got = attn_res_torch(values, wide(norm.weight) * wide(proj.weight)[0], EPS)
    assert got.dtype == torch.float64
    assert_close(got, want, rel=1e-12)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 128, 100])
@pytest.mark.parametrize("T", [1, 13])
@pytest.mark.parametrize("N", [1, 2, 5])
def test_attn_res_triton_equals_torch(N, T, H, dtype):
    values = [v.to(dtype) for v in random_values(N, T, H, 100 * N + T)]
    w = random_w(H, H)
    want = attn_res_torch(values, w, EPS)
    # block_t=4: T=13 spans four programs, the last one partial.
    got = attn_res_triton([v.to(DEVICE) for v in values], w.to(DEVICE), EPS, block_t=4).cpu()
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert_close(got, want, rel=REL)
    else:  # one bfloat16 ulp: the interpreter truncates float32 to bfloat16 where GPUs round to nearest
        assert_close(got.float(), want.float(), rel=BF16_ULP)


@needs_triton
@pytest.mark.parametrize("form", ["stacked", "strided"])
def test_attn_res_triton_takes_stacked_and_strided_values(form):
    N, T, H = 5, 13, 100
    wider = torch.stack(random_values(N, T, H + 28, 7))  # [N, T, H + 28]
    values = wider[..., :H] if form == "strided" else wider[..., :H].contiguous()  # rows H + 28 apart
    w = random_w(H, 8)
    want = attn_res_torch(values, w, EPS)
    assert_close(attn_res_triton(values.to(DEVICE), w.to(DEVICE), EPS).cpu(), want, rel=REL)
    assert_close(attn_res_triton(list(values.to(DEVICE)), w.to(DEVICE), EPS).cpu(), want, rel=REL)


@needs_triton
@pytest.mark.parametrize("dominant", [0, 2, 4])
def test_attn_res_triton_is_stable_when_one_score_dominates(dominant):
    """Values of magnitude 1e3 and w of magnitude 10: scores in the hundreds to a thousand, one
    value (aligned with w) scoring ~H * rms(w) = 1280, far above the rest. The mix is that value,
    wherever it stands (first: later values only add; later: the running sums are rescaled)."""
    N, T, H = 5, 13, 128
    w = 10 * torch.randn(H, generator=gen(3))
    values = random_values(N, T, H, 4, scale=1e3)
    values[dominant] = 1e3 * torch.rand(T, 1, generator=gen(5)) * w / w.norm()
    want = attn_res_torch(values, w, EPS)
    got = attn_res_triton([v.to(DEVICE) for v in values], w.to(DEVICE), EPS, block_t=4).cpu()
    assert torch.isfinite(got).all()
    assert_close(got, want, rel=REL)
    assert_close(want, values[dominant], rel=REL)
