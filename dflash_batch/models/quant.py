"""Dequantize MXFP4 and block-FP8 checkpoint weights to the parameter dtype at load time (CPU).

A weight `X.weight` may be stored in one of two quantized forms:

- MXFP4 (compressed-tensors; Kimi-K3's routed experts): `X.weight_packed` uint8 [out, in/2] holds
  two FP4 E2M1 codes per byte, the low nibble being the even column; `X.weight_scale` uint8
  [out, ceil(in/32)] holds one E8M0 scale 2^(e - 127) per 32 consecutive input columns.
- Block FP8 (DeepSeek style): `X.weight` float8_e4m3fn [out, in] and `X.weight_scale_inv` float32
  [ceil(out/128), ceil(in/128)], one multiplier per 128x128 block; edge blocks may be partial.

Decisions:
- The format is read off the tensors (names, dtypes, shapes); the scale shape pins the group or
  block size. `check_config` only refuses schemes whose tensors could pass for these but mean
  something else (e.g. INT4 in compressed-tensors).
- Arithmetic runs in float32 (float64 for float64 results), then rounds once to the target dtype.
  An MXFP4 product has at most two significant bits, so it is exact whenever representable,
  fp32 subnormals included (2^-128 is the smallest).
- Non-finite results are refused, naming the tensor: an E8M0 scale of 255 (NaN in the OCP MX
  spec), FP8 NaN codes or non-finite scales, and products that overflow the target dtype
  (6 x 2^127 overflows fp32 and bf16; it is finite in float64). A quantizer fed finite weights
  never produces these, so they mean a corrupt checkpoint, and one inf weight would silently
  poison every output. Underflow is not an error: tiny values round to subnormals or zero.
- A tensor-parallel slice is read as the whole scale blocks that cover it, dequantized, then
  trimmed. Any slice works, aligned or not; an unaligned one reads at most one block extra per side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dflash_batch.kernels.moe_mxfp4 import dequant_mxfp4 as mxfp4_values

E8M0_NAN = 255


class TensorMeta(Protocol):
    """What checking needs of a stored tensor; a torch.Tensor or a safetensors header entry."""

    shape: Sequence[int]
    dtype: torch.dtype | str


@dataclass(frozen=True)
class Format:
    name: str
    data_suffix: str  # appended to the weight's name to name the stored data
    scale_suffix: str
    data_dtype: torch.dtype
    scale_dtype: torch.dtype
    block: tuple[int, int]  # (rows, input columns) sharing one scale
    per_column: int  # weight columns per stored data column


MXFP4 = Format("MXFP4", "_packed", "_scale", torch.uint8, torch.uint8, (1, 32), 2)
FP8_BLOCK = Format("block FP8", "", "_scale_inv", torch.float8_e4m3fn, torch.float32, (128, 128), 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _problems(fmt: Format, weight: str, data: TensorMeta, scale: TensorMeta,
              shape: Sequence[int] | None = None) -> list[str]:
    """What is wrong with a stored (data, scale) pair for a weight of `shape`, each naming its
    tensor. Without `shape`, the weight's shape is taken from the data."""
    names = (weight + fmt.data_suffix, weight + fmt.scale_suffix)
    problems = [f"{n}: dtype {t.dtype}, expected {want} for {fmt.name}"
                for n, t, want in zip(names, (data, scale), (fmt.data_dtype, fmt.scale_dtype))
                if t.dtype != want]
    flat = [f"{n}: shape {list(t.shape)}, expected 2-D" for n, t in zip(names, (data, scale)) if len(t.shape) != 2]
    if shape is not None and len(shape) != 2:
        flat.append(f"{names[0]}: {fmt.name} stores 2-D weights, but the model's is {list(shape)}")
    if flat:
        return problems + flat
    holds = [data.shape[0], data.shape[1] * fmt.per_column]
    out, cols = shape if shape is not None else holds
    if holds != [out, cols]:
        problems.append(f"{names[0]}: shape {list(data.shape)} holds a {fmt.name} weight of shape {holds}, "
                        f"expected {[out, cols]}")
    want = [_cdiv(out, fmt.block[0]), _cdiv(cols, fmt.block[1])]
    if list(scale.shape) != want:
        # Without a model shape the data sets the expectation, so name it too: it may be the one cut short.
        of = (f"a weight of shape {[out, cols]}" if shape is not None
              else f"the {holds} weight in {names[0]} {list(data.shape)}")
        problems.append(f"{names[1]}: shape {list(scale.shape)}, expected {want}: one scale per "
                        f"{fmt.block[0]}x{fmt.block[1]} block of {of}")
    return problems


def _check(fmt: Format, weight: str, data: torch.Tensor, scale: torch.Tensor) -> None:
    problems = _problems(fmt, weight, data, scale)
    if problems:
        raise ValueError("; ".join(problems))


def _finite(w: torch.Tensor, dtype: torch.dtype, weight: str) -> torch.Tensor:
    out = w.to(dtype)
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        raise ValueError(f"{weight}: {bad} of {out.numel()} dequantized values are not finite in {dtype} "
                         "(overflow, or NaN in the stored data or scales)")
    return out


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                  name: str = "weight") -> torch.Tensor:
    """[out, in/2] packed FP4 codes and [out, ceil(in/32)] E8M0 scales -> [out, in] in dtype
    (the arithmetic is kernels.moe_mxfp4's, which the MoE kernels share; here checked).

    `name` is the weight's name (`X.weight`); errors name `X.weight_packed` / `X.weight_scale`."""
    _check(MXFP4, name, packed, scale)
    nan = int((scale == E8M0_NAN).sum())
    if nan:
        raise ValueError(f"{name}{MXFP4.scale_suffix}: {nan} E8M0 scales are 255, which is NaN in the OCP MX spec")
    return _finite(mxfp4_values(packed, scale, torch.promote_types(dtype, torch.float32)), dtype, name)


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                      name: str = "weight") -> torch.Tensor:
    """[out, in] float8_e4m3fn weight times one float32 scale per 128x128 block -> [out, in] in dtype."""
    _check(FP8_BLOCK, name, weight, scale_inv)
    out, cols = weight.shape
    rows_per, cols_per = FP8_BLOCK.block
    compute = torch.promote_types(dtype, torch.float32)
    scales = scale_inv.to(compute).repeat_interleave(rows_per, 0)[:out].repeat_interleave(cols_per, 1)[:, :cols]
    return _finite(weight.to(compute) * scales, dtype, name)


@dataclass(frozen=True)
class QuantizedWeight:
    """The weight `name`, stored in `format` as data plus scales."""

    name: str
    format: Format

    @property
    def names(self) -> tuple[str, str]:
        """Checkpoint names of the stored data and scales."""
        return self.name + self.format.data_suffix, self.name + self.format.scale_suffix

    def problems(self, tensors: Mapping[str, TensorMeta], shape: Sequence[int]) -> list[str]:
        """Loader report lines for filling a parameter whose full (unsharded) shape is `shape`."""
        data, scale = self.names
        absent = [f"missing: {n} ({self.format.name} pair of {other})"
                  for n, other in ((data, scale), (scale, data)) if n not in tensors]
        if absent:
            return absent
        return [f"invalid: {p}" for p in _problems(self.format, self.name, tensors[data], tensors[scale], shape)]

    def load(self, read: Callable[[str], Any], index: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        """Dequantize the part `index` of the full weight. `read` maps a checkpoint name to a
        safetensors slice, so only the blocks covering `index` are read."""
        data_name, scale_name = self.names
        data, scale = read(data_name), read(scale_name)
        k = self.format.per_column
        out, cols = data.get_shape()[0], data.get_shape()[1] * k
        (r0, r1, _), (c0, c1, _) = index[0].indices(out), index[1].indices(cols)
        # Widen to whole scale blocks, so every value read comes with its scale; trim afterwards.
        br, bc = self.format.block
        row_blocks, col_blocks = slice(r0 // br, _cdiv(r1, br)), slice(c0 // bc, _cdiv(c1, bc))
        rows = slice(row_blocks.start * br, min(row_blocks.stop * br, out))
        first, last = col_blocks.start * bc, min(col_blocks.stop * bc, cols)
        dequant = dequant_mxfp4 if self.format is MXFP4 else dequant_fp8_block
        w = dequant(data[rows, first // k:last // k], scale[row_blocks, col_blocks], dtype, self.name)
        return w[r0 - rows.start:r1 - rows.start, c0 - first:c1 - first]


def find_quantized(tensors: Mapping[str, TensorMeta]) -> dict[str, QuantizedWeight]:
    """The quantized weights in a checkpoint, keyed by the name of the weight each stands for.

    A float8 tensor is taken as block-FP8 data even without its scales, so a checkpoint that
    lost them is reported missing `X.weight_scale_inv` instead of loading unscaled values."""
    found = {}
    for name, meta in tensors.items():
        if name.endswith(".weight" + MXFP4.data_suffix):
            weight = name.removesuffix(MXFP4.data_suffix)
            found[weight] = QuantizedWeight(weight, MXFP4)
        elif name.endswith(".weight" + FP8_BLOCK.scale_suffix):
            weight = name.removesuffix(FP8_BLOCK.scale_suffix)
            found[weight] = QuantizedWeight(weight, FP8_BLOCK)
        elif meta.dtype == FP8_BLOCK.data_dtype:
            found[name] = QuantizedWeight(name, FP8_BLOCK)
    return found


def check_config(config: Mapping) -> None:
    """Refuse quantization schemes whose tensors could pass for MXFP4 or block FP8 but mean
    something else, such as INT4 codes packed in compressed-tensors' weight_packed."""
    quant = config.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        for group, spec in quant.get("config_groups", {}).items():
            weights = spec.get("weights") or {}
            if (weights.get("type"), weights.get("num_bits")) != ("float", 4):
                raise ValueError(f"quantization_config group {group!r} has weights {weights}; the only "
                                 "compressed-tensors scheme supported is MXFP4 (4-bit float, group 32)")
    elif method != "fp8":
        raise ValueError(f"quantization_config quant_method {method!r} is not supported; supported: "
                         "compressed-tensors MXFP4 and fp8 with 128x128 blocks")
