"""Routed MoE experts straight from MXFP4 weights: out[t] = sum_j weights[t, j] * W2_e(SiTU(W1_e x_t,
W3_e x_t)), e = ids[t, j], with each expert's matrices dequantized on the fly (Kimi-K3's
`LatentMoE` routed path, `dflash_batch/models/kimi_k3.py`, without dequantizing at load time).

Layout (as in the checkpoint, `dflash_batch/models/quant.py`): a weight [out, in] is `packed`
uint8 [out, in/2], two FP4 E2M1 codes per byte, the low nibble being the even column, and `scale`
uint8 [out, ceil(in/32)], one E8M0 scale 2^(s - 127) per 32 input columns (the last group may be
partial). Experts are stacked on a leading dim: w1/w3 [E, I, K/2] with scales [E, I, ceil(K/32)],
w2 [E, N, I/2] with scales [E, N, ceil(I/32)]. K and I must be even.

Decisions:
- Rounding points are kimi_k3's with weights dequantized to x's dtype: each projection's output
  is rounded to x's dtype (an nn.Linear in that dtype), SiTU runs in float32 (float64 for a
  float64 reference) and is rounded back, and y * weight is rounded once. An MXFP4 value times its
  scale has two significant bits, so the dequantized weights are exact in float32 and bfloat16
  (over- or underflow aside) and both versions see the same weights.
- The torch reference dequantizes one expert at a time (never all E) and follows
  `LatentMoE.forward`: experts in ascending order, `index_add_` in x's dtype.
- The Triton version sorts the flattened (token, slot) pairs by expert (a stable argsort) and
  cuts each expert's run into tiles of BLOCK_M rows; the tile table is built with tensor ops from
  a static bound on the tile count (cdiv(T*k, BLOCK_M) + min(E, T*k)), so nothing reads back to
  the host and tiles past the real count exit at once. Experts without tokens get no tile.
- Kernel 1, per (tile, BLOCK_N columns of I): gate and up tiles from one pass over K. A packed
  byte tile splits into its low (even columns) and high (odd columns) nibbles, each multiplied
  against x's even / odd columns by its own tl.dot, so every byte is loaded once and no
  interleave is needed. Nibbles and scales are decoded with exact arithmetic (the scale is built
  from its float32 bit pattern). SiTU is fused; h is stored in x's dtype per sorted row.
- Kernel 2, per (tile, BLOCK_N columns of N): the same GEMM over h with w2, times the routing
  weight, written to the (token, slot) row; a float32 sum over slots then gives out. No atomics:
  the result is deterministic. Accumulation is float32 and float32 dots run in IEEE precision
  (not TF32: slow, but float32 is for tests), so float32 results match the reference to
  rounding; float64 is refused (use the reference). Under the interpreter bfloat16 tiles are
  multiplied in float32 (its tl.dot mishandles bfloat16), exactly the same products.
- tanh is 1 - 2/(exp(2z) + 1) in its overflow-free form (Triton has no portable tanh), good to
  about 1e-7 absolute.
- E8M0 scale 255 (NaN in the OCP MX spec) is not checked: the checkpoint loader refuses it, and a
  check here would read back to the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_batch.kernels._triton import jit, tl, triton

# FP4 E2M1 code -> value. Bit 3 is the sign, so code 8 is negative zero (quant.py's table).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # input columns per E8M0 scale


def _e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    # 2^(s-127) is the fp32 bit pattern s << 23, except s = 0: the subnormal 2^-127 is 1 << 22.
    s = scale.to(torch.int32)
    return torch.where(s == 0, 1 << 22, s << 23).view(torch.float32)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One matrix: packed uint8 [out, in/2] and scale uint8 [out, ceil(in/32)] -> [out, in] in dtype
    (computed in float32, or float64 for float64, then rounded once)."""
    compute = torch.promote_types(dtype, torch.float32)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(1)  # low nibble = even column
    values = torch.tensor(E2M1_VALUES, dtype=compute, device=packed.device)[codes.long()]
    scales = _e8m0_to_float32(scale).to(compute).repeat_interleave(GROUP, dim=1)[:, :values.shape[1]]
    return (values * scales).to(dtype)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """kimi_k3.situ: (beta*tanh(g/beta)*sigmoid(g)) * (linear_beta*tanh(u/linear_beta)) in at least
    float32, rounded to gate's dtype."""
    wide = torch.promote_types(gate.dtype, torch.float32)
    g, u = gate.to(wide), up.to(wide)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * linear_beta * torch.tanh(u / linear_beta)).to(gate.dtype)


def moe_mxfp4_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w1: torch.Tensor, w1_scale: torch.Tensor, w3: torch.Tensor, w3_scale: torch.Tensor,
                    w2: torch.Tensor, w2_scale: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """x [T, K], ids [T, k] int64 in [0, E), weights [T, k] (x's dtype), w1/w3 uint8 [E, I, K/2] with
    scales [E, I, ceil(K/32)], w2 uint8 [E, N, I/2] with scale [E, N, ceil(I/32)] -> out [T, N]."""
    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        gate = torch.nn.functional.linear(xe, dequant_mxfp4(w1[e], w1_scale[e], x.dtype))
        up = torch.nn.functional.linear(xe, dequant_mxfp4(w3[e], w3_scale[e], x.dtype))
        return torch.nn.functional.linear(situ(gate, up, beta, linear_beta), dequant_mxfp4(w2[e], w2_scale[e], x.dtype))

    return routed_sum(x, ids, weights, w2.shape[1], w1.shape[0], expert)


def routed_sum(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, width: int, experts: int,
               expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_j weights[t, j] * expert(ids[t, j], x_t) [T, width] over ids in [0, experts), one expert
    at a time in ascending order, summed in x's dtype (LatentMoE's order, whatever its experts are
    stored as). Only the experts chosen run: it groups rows by expert on the host."""
    out = x.new_zeros(x.shape[0], width)
    rows_per_expert = torch.bincount(ids.flatten(), minlength=experts).tolist()
    for e in (e for e, n in enumerate(rows_per_expert) if n):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, expert(e, x[rows]) * weights[rows, slot, None])
    return out


@jit
def _tanh(z):
    # sign(z) * (1 - t) / (1 + t) with t = exp(-2|z|) <= 1: never overflows.
    t = tl.exp(-2.0 * tl.abs(z))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(z < 0, -r, r)


@jit
def _e2m1(code, scale, DTYPE: tl.constexpr):
    """FP4 E2M1 codes (int32) times their float32 scales, in DTYPE; all steps are exact."""
    exponent = (code >> 1) & 3
    half_mantissa = (code & 1).to(tl.float32) * 0.5
    # exponent 0: subnormal m/2; else (1 + m/2) * 2^(exponent-1)
    magnitude = tl.where(exponent == 0, half_mantissa, (1.0 + half_mantissa) * ((1 << exponent) >> 1).to(tl.float32))
    value = tl.where((code & 8) != 0, -magnitude, magnitude)
    return (value * scale).to(DTYPE)


@jit
def _dequant_tile(packed_ptr, scale_ptr, rows, cols, row_mask, col_mask, packed_width, groups, DTYPE: tl.constexpr):
    """Dequantize the byte tile [len(cols), len(rows)] of one expert's weight (transposed, ready
    as the right operand of x @ W^T): rows are output features, cols byte columns. Returns the
    (low nibble = even input columns, high nibble = odd input columns) halves in DTYPE."""
    mask = col_mask[:, None] & row_mask[None, :]
    byte = tl.load(packed_ptr + rows[None, :] * packed_width + cols[:, None], mask=mask, other=0).to(tl.int32)
    # Byte column b holds input columns 2b and 2b+1, both in scale group 2b // 32 = b // 16.
    s = tl.load(scale_ptr + rows[None, :] * groups + (cols // 16)[:, None], mask=mask, other=127)
    s = s.to(tl.int32)
    scale = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)
    return _e2m1(byte & 0xF, scale, DTYPE), _e2m1(byte >> 4, scale, DTYPE)


@jit
def _even_odd(row_ptr, b, mask, DOT: tl.constexpr):
    """Input columns 2b and 2b+1 of the rows at row_ptr [M, 1], in DOT: the left operands of a
    byte tile's two halves."""
    even = tl.load(row_ptr + 2 * b[None, :], mask=mask, other=0.0).to(DOT)
    odd = tl.load(row_ptr + 2 * b[None, :] + 1, mask=mask, other=0.0).to(DOT)
    return even, odd


@jit
def _packed_dot(acc, even, odd, packed_ptr, scale_ptr, n, b, n_mask, b_mask, packed_width, groups,
                DOT: tl.constexpr):
    """acc + (the rows' columns) @ W^T over one byte tile of a packed weight: output features n,
    byte columns b, each half of a byte against its own columns, every byte loaded once."""
    lo, hi = _dequant_tile(packed_ptr, scale_ptr, n, b, n_mask, b_mask, packed_width, groups, DOT)
    acc = tl.dot(even, lo, acc, input_precision="ieee")
    return tl.dot(odd, hi, acc, input_precision="ieee")


@jit
def _gate_up_kernel(x_ptr, pair_ptr, tile_expert_ptr, tile_begin_ptr, tile_end_ptr,
                    w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, K, I, groups, top_k, beta, linear_beta,
                    DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
    """h[r, n] = SiTU(x W1_e^T, x W3_e^T)[r, n] for the sorted rows r of one tile (expert e) and a
    BLOCK_N slice of the I columns; BLOCK_KB packed bytes (2 * BLOCK_KB input columns) per step,
    multiplied in DOT."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:  # past the real tile count
        return
    DTYPE = x_ptr.dtype.element_ty
    r = tl.load(tile_begin_ptr + tile) + tl.arange(0, BLOCK_M)
    r_mask = r < tl.load(tile_end_ptr + tile)
    token = tl.load(pair_ptr + r, mask=r_mask, other=0) // top_k
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < I
    packed_width = K // 2
    w1_ptr += expert.to(tl.int64) * I * packed_width
    w3_ptr += expert.to(tl.int64) * I * packed_width
    s1_ptr += expert.to(tl.int64) * I * groups
    s3_ptr += expert.to(tl.int64) * I * groups
    x_row = x_ptr + token.to(tl.int64)[:, None] * K
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, packed_width, BLOCK_KB):
        b = start + tl.arange(0, BLOCK_KB)
        b_mask = b < packed_width
        x_even, x_odd = _even_odd(x_row, b, r_mask[:, None] & b_mask[None, :], DOT)  # read once, for both
        gate = _packed_dot(gate, x_even, x_odd, w1_ptr, s1_ptr, n, b, n_mask, b_mask, packed_width, groups, DOT)
        up = _packed_dot(up, x_even, x_odd, w3_ptr, s3_ptr, n, b, n_mask, b_mask, packed_width, groups, DOT)
    # The projections round to x's dtype (nn.Linear's output), SiTU runs in float32.
    g = gate.to(DTYPE).to(tl.float32)
    u = up.to(DTYPE).to(tl.float32)
    h = beta * _tanh(g / beta) * tl.sigmoid(g) * linear_beta * _tanh(u / linear_beta)
    tl.store(h_ptr + r.to(tl.int64)[:, None] * I + n[None, :], h.to(DTYPE), mask=r_mask[:, None] & n_mask[None, :])


@jit
def _down_kernel(h_ptr, pair_ptr, weight_ptr, tile_expert_ptr, tile_begin_ptr, tile_end_ptr,
                 w2_ptr, s2_ptr, y_ptr, I, N, groups,
                 DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
    """y[pair, n] = weight[pair] * (h W2_e^T)[r, n] for the sorted rows r (pairs) of one tile and a
    BLOCK_N slice of the N columns."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    DTYPE = h_ptr.dtype.element_ty
    r = tl.load(tile_begin_ptr + tile) + tl.arange(0, BLOCK_M)
    r_mask = r < tl.load(tile_end_ptr + tile)
    pair = tl.load(pair_ptr + r, mask=r_mask, other=0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    packed_width = I // 2
    w2_ptr += expert.to(tl.int64) * N * packed_width
    s2_ptr += expert.to(tl.int64) * N * groups
    h_row = h_ptr + r.to(tl.int64)[:, None] * I
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, packed_width, BLOCK_KB):
        b = start + tl.arange(0, BLOCK_KB)
        b_mask = b < packed_width
        h_even, h_odd = _even_odd(h_row, b, r_mask[:, None] & b_mask[None, :], DOT)
        acc = _packed_dot(acc, h_even, h_odd, w2_ptr, s2_ptr, n, b, n_mask, b_mask, packed_width, groups, DOT)
    # y rounds to x's dtype (nn.Linear), then y * weight rounds once (the exact product of two
    # values of x's dtype fits float32).
    weight = tl.load(weight_ptr + pair, mask=r_mask, other=0.0).to(tl.float32)
    y = (acc.to(DTYPE).to(tl.float32) * weight[:, None]).to(DTYPE)
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * N + n[None, :], y, mask=r_mask[:, None] & n_mask[None, :])


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """tl.dot's operand type: x's dtype, except bfloat16 under Triton's interpreter, whose tl.dot
    multiplies bfloat16's raw uint16 bits (Triton 3.9): there float32, which holds bfloat16 values
    and their products exactly, so the result is the same up to summation order."""
    if dtype == torch.bfloat16:
        return tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def _tiles(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """The (token, slot) pairs sorted by expert and the tile table over them, without a host sync:
    pair [T*k] (flat index t*k + j of each sorted row) and, per tile, its expert (-1 past the
    real count) and its [begin, end) rows (end: the expert's last row + 1)."""
    flat = ids.reshape(-1)
    pair = torch.argsort(flat, stable=True)
    # Not bincount: on CUDA it reads the ids' range back to the host (a sync, refused in a capture).
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    # sum_e ceil(c_e / M) <= cdiv(sum c_e, M) + (experts with tokens)
    bound = -(-flat.numel() // block_m) + min(experts, flat.numel())
    i = torch.arange(bound, device=ids.device)
    expert = torch.searchsorted(tile_ends, i, right=True)
    real = expert < experts
    e = expert.clamp(max=experts - 1)
    begin = ends[e] - counts[e] + (i - tile_ends[e] + tiles[e]) * block_m
    return pair, torch.where(real, expert, -1), begin, ends[e]


def moe_mxfp4_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     w1: torch.Tensor, w1_scale: torch.Tensor, w3: torch.Tensor, w3_scale: torch.Tensor,
                     w2: torch.Tensor, w2_scale: torch.Tensor, beta: float, linear_beta: float,
                     block_m: int = 16, block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """The Triton twin of `moe_mxfp4_torch` (x float32, bfloat16 or float16). Blocks are powers of
    two, block_m and block_n at least 16 and block_k (input columns per step) at least 32, as
    tl.dot needs 16 in every dim."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"moe_mxfp4_triton takes float32, bfloat16 or float16, not {x.dtype}; "
                         "use moe_mxfp4_torch")
    T, K = x.shape
    top_k = ids.shape[1]
    experts, I, _ = w1.shape
    N = w2.shape[1]
    if K % 2 or I % 2:
        raise ValueError(f"MXFP4 packs two columns per byte: K={K} and I={I} must be even")
    if T == 0:
        return x.new_zeros(0, N)
    x, weights = x.contiguous(), weights.to(x.dtype).contiguous()
    pair, tile_expert, tile_begin, tile_end = _tiles(ids, experts, block_m)
    h = torch.empty(T * top_k, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T * top_k, N, dtype=x.dtype, device=x.device)
    blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KB=block_k // 2)
    # DOT is worked out among the arguments, after kernel[grid]: without Triton that raises first.
    _gate_up_kernel[(tile_expert.numel(), -(-I // block_n))](
        x, pair, tile_expert, tile_begin, tile_end, w1.contiguous(), w1_scale.contiguous(), w3.contiguous(),
        w3_scale.contiguous(), h, K, I, -(-K // GROUP), top_k, float(beta), float(linear_beta),
        DOT=_dot_dtype(x.dtype), **blocks)
    _down_kernel[(tile_expert.numel(), -(-N // block_n))](
        h, pair, weights, tile_expert, tile_begin, tile_end, w2.contiguous(), w2_scale.contiguous(), y, I, N,
        -(-I // GROUP), DOT=_dot_dtype(x.dtype), **blocks)
    return y.view(T, top_k, N).sum(1, dtype=torch.float32).to(x.dtype)
