"""kernels/moe_mxfp4.py: the torch reference equals a float64 oracle written from the MXFP4 spec
and Kimi-K3's routed-expert loop (bitwise, in bfloat16); the Triton version equals the reference
(on the CPU under TRITON_INTERPRET=1, small fixed tiles) on odd sizes, partial scale groups,
T = 1, experts without tokens and experts with several row tiles."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_batch.kernels import _triton
from dflash_batch.kernels.moe_mxfp4 import E2M1_VALUES, dequant_mxfp4, moe_mxfp4_torch, moe_mxfp4_triton
from dflash_batch.models import kimi_k3, quant

needs_triton = pytest.mark.skipif(not _triton.available(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, TOP_K, N, BETA, LINEAR_BETA = 5, 2, 72, 4.0, 25.0


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mxfp4(g: torch.Generator, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E stacked random MXFP4 weights [E, rows, cols]: every byte value (so every nibble, low and
    high) occurs, and scales span 2^-7 .. 2^3 so that every product stays finite."""
    packed = torch.randint(0, 256, (E, rows, cols // 2), generator=g, dtype=torch.uint8)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scale = torch.randint(120, 131, (E, rows, math.ceil(cols / 32)), generator=g, dtype=torch.uint8)
    scale.view(-1)[:11] = torch.arange(120, 131, dtype=torch.uint8)
    return packed, scale


def routing(g: torch.Generator, T: int, route: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, TOP_K] (distinct per token) and positive weights [T, TOP_K]. route: "random" over
    all experts, "skip" never picks expert 2, "pair" picks experts 1 and 3 for every token (each
    then has T rows: several row tiles, the last partial)."""
    allowed = {"random": list(range(E)), "skip": [0, 1, 3, 4], "pair": [1, 3]}[route]
    choice = torch.stack([torch.randperm(len(allowed), generator=g)[:TOP_K] for _ in range(T)])
    ids = torch.tensor(allowed)[choice]
    weights = torch.rand(T, TOP_K, generator=g) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def case(seed: int, T: int, K: int, I: int, route: str, dtype: torch.dtype, n: int = N) -> dict:
    g = gen(seed)
    w1, w1_scale = mxfp4(g, I, K)
    w3, w3_scale = mxfp4(g, I, K)
    w2, w2_scale = mxfp4(g, n, I)
    ids, weights = routing(g, T, route)
    x = 0.1 * torch.randn(T, K, generator=g)  # gate and up land across SiTU's curved range
    return dict(x=x.to(dtype), ids=ids, weights=weights.to(dtype), w1=w1, w1_scale=w1_scale, w3=w3,
                w3_scale=w3_scale, w2=w2, w2_scale=w2_scale, beta=BETA, linear_beta=LINEAR_BETA)


# -- the reference --------------------------------------------------------------------------------
def e2m1(code: int) -> float:
    """FP4 E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign, exponent, mantissa = (-1.0) ** (code >> 3), (code >> 1) & 3, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))


E2M1_VALUES_SPEC = [e2m1(c) for c in range(16)]


def oracle_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One [out, in] matrix in float64, straight from the spec."""
    table = torch.tensor(E2M1_VALUES_SPEC, dtype=torch.float64)
    out, half = packed.shape
    w = torch.empty(out, 2 * half, dtype=torch.float64)
    w[:, 0::2] = table[(packed & 0xF).long()]  # low nibble: even column
    w[:, 1::2] = table[(packed >> 4).long()]
    column_scale = 2.0 ** (scale.double() - 127)[:, torch.arange(2 * half) // 32]
    return w * column_scale


def oracle(x, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, beta, linear_beta) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * W2_e(SiTU(W1_e x_t, W3_e x_t)), token by token, in float64."""
    x, weights = x.double(), weights.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = oracle_weight(w1[e], w1_scale[e]) @ x[t]
            up = oracle_weight(w3[e], w3_scale[e]) @ x[t]
            h = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * linear_beta * torch.tanh(up / linear_beta)
            out[t] += weights[t, j] * (oracle_weight(w2[e], w2_scale[e]) @ h)
    return out


def test_e2m1_table_is_the_spec_and_the_loaders():
    assert list(E2M1_VALUES) == E2M1_VALUES_SPEC


@pytest.mark.parametrize("T, K, I, route", [(1, 96, 48, "random"), (9, 80, 40, "skip")])
def test_reference_equals_the_float64_oracle(T, K, I, route):
    inputs = case(T, T, K, I, route, torch.float64)
    want = oracle(**inputs)
    got = moe_mxfp4_torch(**inputs)
    assert got.dtype == torch.float64 and got.shape == (T, N)
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())


def test_reference_rounds_like_kimi_k3_in_bfloat16():
    """Bitwise the routed loop of kimi_k3.LatentMoE.forward over kimi_k3.Expert modules holding the
    loader's dequantized weights (quant.dequant_mxfp4)."""
    K, I = 80, 40
    inputs = case(3, 17, K, I, "skip", torch.bfloat16, n=K)  # an Expert maps back to its input width
    x, ids, weights = inputs["x"], inputs["ids"], inputs["weights"]
    config = {"activation_situ_beta": BETA, "activation_situ_linear_beta": LINEAR_BETA}
    experts = []
    for e in range(E):
        expert = kimi_k3.Expert(config, K, I, reduce=False).to(torch.bfloat16)
        for name in ("w1", "w3", "w2"):
            getattr(expert, name).weight.copy_(
                quant.dequant_mxfp4(inputs[name][e], inputs[name + "_scale"][e], torch.bfloat16))
        experts.append(expert)
    want = torch.zeros(x.shape[0], K, dtype=torch.bfloat16)
    for e in ids.unique().tolist():  # as in LatentMoE.forward
        rows, slot = (ids == e).nonzero(as_tuple=True)
        want.index_add_(0, rows, experts[e](x[rows]) * weights[rows, slot, None])
    assert torch.equal(moe_mxfp4_torch(**inputs), want)
    for name in ("w1", "w2"):  # and the kernel module's dequant is the loader's
        assert torch.equal(dequant_mxfp4(inputs[name][4], inputs[name + "_scale"][4], torch.float32),
                           quant.dequant_mxfp4(inputs[name][4], inputs[name + "_scale"][4], torch.float32))


# -- Triton ----------------------------------------------------------------------------------------
def on_device(inputs: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@needs_triton
@pytest.mark.parametrize("T, K, I, route", [(1, 96, 48, "random"), (7, 80, 40, "skip"), (33, 96, 40, "pair"),
                                            (33, 80, 48, "skip")])
def test_triton_equals_torch_float32(T, K, I, route):
    inputs = case(100 + T, T, K, I, route, torch.float32)
    want = moe_mxfp4_torch(**inputs)
    got = moe_mxfp4_triton(**on_device(inputs), block_m=16, block_n=32, block_k=32).cpu()
    assert got.dtype == torch.float32 and got.shape == (T, N)
    # float32 rounding differs in the last bits between summation orders (and CPUs).
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@needs_triton
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 1e-4), (torch.bfloat16, 2.5e-2)])
def test_triton_equals_torch_half(dtype, tol):
    """Same rounding points: float16 agrees to its last bits (the slot sums differ in order; a
    skipped rounding point would move it by about 3e-4).
    bfloat16's bound is for Triton 3.9's interpreter, whose float32 -> bfloat16 casts truncate
    (the GPU rounds to nearest even; with such casts the interpreter's result is bitwise the
    reference's): each rounding point loses up to 2^-7, about 1.3% of the output's norm here."""
    inputs = case(7, 20, 96, 48, "random", dtype)
    want = moe_mxfp4_torch(**inputs).double()
    got = moe_mxfp4_triton(**on_device(inputs), block_m=16, block_n=32, block_k=32).cpu()
    assert got.dtype == dtype
    assert float((got.double() - want).norm() / want.norm()) < tol


@needs_triton
def test_triton_refuses_float64():
    with pytest.raises(ValueError, match="float64"):
        moe_mxfp4_triton(**on_device(case(0, 1, 96, 48, "random", torch.float64)))
