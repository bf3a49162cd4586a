"""MXFP4 and block-FP8 dequantization: hand-computed vectors, loading, TP slices, refusals.

Expected numbers are written out from the format definitions, never computed by quant.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dflash_batch import parallel
from dflash_batch.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from dflash_batch.models.loader import load_weights
from dflash_batch.models.quant import MXFP4, QuantizedWeight, check_config, dequant_fp8_block, dequant_mxfp4

U8, F8 = torch.uint8, torch.float8_e4m3fn
FLOATS = [torch.float32, torch.bfloat16, torch.float64]


def u8(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=U8)


# --- MXFP4 vectors -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_every_fp4_code_low_nibble_first(dtype):
    # Bytes 0x10, 0x32, ... put codes 0..15 in column order; 0x01, 0x23, ... swap each pair.
    packed = u8([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE, 0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]])
    expected = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
                              0.5, 0.0, 1.5, 1.0, 3.0, 2.0, 6.0, 4.0, -0.5, -0.0, -1.5, -1.0, -3.0, -2.0, -6.0, -4.0]],
                            dtype=dtype)
    out = dequant_mxfp4(packed, u8([[127]]), dtype)  # scale 2^0
    assert out.dtype == dtype
    assert torch.equal(out, expected)
    # Code 8 is negative zero: columns 8 and 25 carry the sign bit, columns 0 and 17 do not.
    assert torch.equal(torch.signbit(out), torch.signbit(expected))
    assert torch.signbit(out[0, 8]) and torch.signbit(out[0, 25])
    assert not torch.signbit(out[0, 0]) and not torch.signbit(out[0, 17])


def test_groups_of_32_columns_and_rows_have_their_own_scales():
    # Row 0: scales 130 (x8) and 124 (x1/8); row 1: 127 (x1) and 128 (x2). Same bytes in both rows:
    # 0x2B -> (-1.5, 1), 0x7C -> (-2, 6) in group 0; 0x5E -> (-4, 3), 0xF1 -> (0.5, -6) in group 1.
    row = [0x2B, 0x7C] + [0] * 14 + [0x5E, 0xF1] + [0] * 14
    out = dequant_mxfp4(u8([row, row]), u8([[130, 124], [127, 128]]), torch.float32)
    expected = torch.zeros(2, 64)
    expected[0, [0, 1, 2, 3, 32, 33, 34, 35]] = torch.tensor([-12.0, 8.0, -16.0, 48.0, -0.5, 0.375, 0.0625, -0.75])
    expected[1, [0, 1, 2, 3, 32, 33, 34, 35]] = torch.tensor([-1.5, 1.0, -2.0, 6.0, -8.0, 6.0, 1.0, -12.0])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_finite_exponent(dtype):
    # 254 -> 2^127. Codes 2 (1.0) and 3 (1.5) stay finite in fp32 and bf16.
    out = dequant_mxfp4(u8([[0x32]]), u8([[254]]), dtype)
    assert torch.equal(out, torch.tensor([[1.7014118346046923e38, 2.5521177519070385e38]], dtype=dtype))
    # Codes 4 (2.0) and 7 (6.0) give 2^128 and 6 * 2^127: past the fp32/bf16 max, so refused.
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight: 2 of 2 dequantized values are not finite"):
        dequant_mxfp4(u8([[0x74]]), u8([[254]]), dtype, name="experts.0.w1.weight")


def test_max_exponent_is_finite_in_float64():
    out = dequant_mxfp4(u8([[0x74]]), u8([[254]]), torch.float64)
    assert torch.equal(out, torch.tensor([[3.402823669209385e38, 1.0208471007628154e39]], dtype=torch.float64))


@pytest.mark.parametrize("dtype", FLOATS)
def test_min_exponent_is_exact_subnormal(dtype):
    # 0 -> 2^-127. 0x21 -> codes 1 (0.5), 2 (1.0); 0x87 -> codes 7 (6.0), 8 (-0.0).
    out = dequant_mxfp4(u8([[0x21, 0x87]]), u8([[0]]), dtype)
    # 2^-128, 2^-127, 6 * 2^-127, -0
    expected = torch.tensor([[2.938735877055719e-39, 5.877471754111438e-39, 3.5264830524668625e-38, -0.0]], dtype=dtype)
    assert torch.equal(out, expected) and torch.signbit(out[0, 3])
    assert 0 < out[0, 1] < torch.finfo(torch.float32).tiny  # 2^-127 is subnormal in fp32 (and bf16)


def test_underflow_rounds_to_zero_without_error():
    out = dequant_mxfp4(u8([[0x21]]), u8([[0]]), torch.float16)
    assert torch.equal(out, torch.zeros(1, 2, dtype=torch.float16))


def test_nan_scale_is_refused():
    with pytest.raises(ValueError, match=r"x\.weight_scale: 1 E8M0 scales are 255, which is NaN"):
        dequant_mxfp4(u8([[0x11] * 16, [0x11] * 16]), u8([[127], [255]]), name="x.weight")


@pytest.mark.parametrize("packed, scale, message", [
    (torch.zeros(2, 16), u8([[127], [127]]), r"x\.weight_packed: dtype torch\.float32, expected torch\.uint8"),
    (torch.zeros(2, 16, dtype=torch.int8), u8([[127], [127]]), r"x\.weight_packed: dtype torch\.int8"),
    (torch.zeros(2, 16, dtype=U8), torch.zeros(2, 1), r"x\.weight_scale: dtype torch\.float32, expected torch\.uint8"),
    (torch.zeros(2, 32, dtype=U8), u8([[127], [127]]), r"x\.weight_scale: shape \[2, 1\], expected \[2, 2\]"),
    # Packed rows cut short (a truncated tensor) no longer match the scale rows.
    (torch.zeros(1, 16, dtype=U8), u8([[127], [127]]),
     r"x\.weight_scale: shape \[2, 1\], expected \[1, 1\].*x\.weight_packed \[1, 16\]"),
    (torch.zeros(32, dtype=U8), u8([[127]]), r"x\.weight_packed: shape \[32\], expected 2-D"),
])
def test_mxfp4_refuses_malformed_tensors_by_name(packed, scale, message):
    with pytest.raises(ValueError, match=message):
        dequant_mxfp4(packed, scale, name="x.weight")


# --- block FP8 vectors ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_fp8_blocks_with_partial_edges(dtype):
    # 130 x 129: blocks of rows 0-127 | 128-129 and columns 0-127 | 128, each with its own scale.
    weight = torch.ones(130, 129)
    weight[0, 0], weight[127, 127], weight[128, 0], weight[129, 128], weight[0, 128] = 1.5, -2.0, 448.0, 0.5, -0.75
    scale_inv = torch.tensor([[2.0, 0.5], [3.0, 0.25]])
    out = dequant_fp8_block(weight.to(F8), scale_inv, dtype)
    expected = torch.empty(130, 129, dtype=dtype)
    expected[:128, :128], expected[:128, 128:], expected[128:, :128], expected[128:, 128:] = 2.0, 0.5, 3.0, 0.25
    # 1.5 * 2, -2 * 2, 448 * 3, 0.5 * 0.25, -0.75 * 0.5
    expected[0, 0], expected[127, 127], expected[128, 0] = 3.0, -4.0, 1344.0
    expected[129, 128], expected[0, 128] = 0.125, -0.375
    assert torch.equal(out, expected)


@pytest.mark.parametrize("weight, scale_inv, message", [
    (torch.ones(130, 129, dtype=torch.bfloat16), torch.ones(2, 2),
     r"x\.weight: dtype torch\.bfloat16, expected torch\.float8_e4m3fn"),
    (torch.ones(130, 129).to(F8), torch.ones(2, 2, dtype=torch.bfloat16),
     r"x\.weight_scale_inv: dtype torch\.bfloat16, expected torch\.float32"),
    (torch.ones(130, 129).to(F8), torch.ones(1, 2), r"x\.weight_scale_inv: shape \[1, 2\], expected \[2, 2\]"),
])
def test_fp8_refuses_malformed_tensors_by_name(weight, scale_inv, message):
    with pytest.raises(ValueError, match=message):
        dequant_fp8_block(weight, scale_inv, name="x.weight")


def test_fp8_refuses_nan_and_overflow():
    with pytest.raises(ValueError, match=r"x\.weight: 4 of 4 dequantized values are not finite"):
        dequant_fp8_block(torch.ones(2, 2).to(F8), torch.tensor([[float("nan")]]), name="x.weight")
    with pytest.raises(ValueError, match=r"x\.weight: 1 of 4 dequantized values are not finite in torch\.float32"):
        dequant_fp8_block(torch.tensor([[448.0, 1.0], [1.0, 1.0]]).to(F8), torch.tensor([[1e36]]), torch.float32,
                          name="x.weight")


# --- partial reads -------------------------------------------------------------------------------

class Recorded:
    """A safetensors-slice stand-in that records which part of the tensor was read."""

    def __init__(self, tensor: torch.Tensor, reads: list):
        self.tensor, self.reads = tensor, reads

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index):
        self.reads.append(tuple((s.start, s.stop) for s in index))
        return self.tensor[index]


@pytest.mark.parametrize("cols, packed_read, scale_read", [
    ((32, 96), (16, 48), (1, 3)),  # group-aligned: exactly the slice
    ((48, 96), (16, 48), (1, 3)),  # unaligned: from the start of the group holding column 48
    ((0, 40), (0, 32), (0, 2)),
])
def test_mxfp4_reads_only_the_blocks_covering_a_slice(cols, packed_read, scale_read):
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (4, 64), generator=gen, dtype=U8)
    scale = torch.randint(120, 135, (4, 4), generator=gen, dtype=U8)
    reads = []
    tensors = {"w.weight_packed": Recorded(packed, reads), "w.weight_scale": Recorded(scale, reads)}
    part = QuantizedWeight("w.weight", MXFP4).load(tensors.__getitem__, (slice(None), slice(*cols)), torch.float32)
    assert torch.equal(part, dequant_mxfp4(packed, scale, torch.float32)[:, cols[0]:cols[1]])
    assert reads == [((0, 4), packed_read), ((0, 4), scale_read)]


# --- loading checkpoints -------------------------------------------------------------------------

class TwoLinears(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.up = ColumnParallelLinear(hidden, inner)
        self.down = RowParallelLinear(inner, hidden)


def save(directory: Path, files: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Write tensors as the named .safetensors files, with an index when there is more than one."""
    directory.mkdir(parents=True, exist_ok=True)
    for file, tensors in files.items():
        save_file(tensors, directory / file)
    if len(files) > 1:
        weight_map = {name: file for file, tensors in files.items() for name in tensors}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def mxfp4_tensors(hidden: int, inner: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (out, cols) in {"up": (inner, hidden), "down": (hidden, inner)}.items():
        tensors[f"{name}.weight_packed"] = torch.randint(0, 256, (out, cols // 2), generator=gen, dtype=U8)
        tensors[f"{name}.weight_scale"] = torch.randint(120, 135, (out, -(-cols // 32)), generator=gen, dtype=U8)
    return tensors


def fp8_tensors(hidden: int, inner: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (out, cols) in {"up": (inner, hidden), "down": (hidden, inner)}.items():
        tensors[f"{name}.weight"] = torch.randn(out, cols, generator=gen).to(F8)
        tensors[f"{name}.weight_scale_inv"] = torch.rand(-(-out // 128), -(-cols // 128), generator=gen) + 0.5
    return tensors


def full_weights(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    names = ("up.weight", "down.weight")
    if "up.weight_packed" in tensors:
        return {n: dequant_mxfp4(tensors[f"{n}_packed"], tensors[f"{n}_scale"], dtype) for n in names}
    return {n: dequant_fp8_block(tensors[n], tensors[f"{n}_scale_inv"], dtype) for n in names}


def split_files(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Data in one file, scales in another: every pair spans two files."""
    scales = {n: t for n, t in tensors.items() if "scale" in n}
    return {"data.safetensors": {n: t for n, t in tensors.items() if n not in scales}, "scales.safetensors": scales}


@pytest.mark.parametrize("make, hidden, inner", [
    (mxfp4_tensors, 64, 96),  # TP2: 48 input columns per rank, not group-aligned
    (mxfp4_tensors, 64, 128),  # TP2: 64 per rank, aligned
    (fp8_tensors, 200, 300),  # TP2: 150 rows / columns per rank, not block-aligned
    (fp8_tensors, 200, 256),  # TP2: 128 per rank, aligned
])
@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_checkpoint_loads_each_ranks_slice(tmp_path, monkeypatch, make, hidden, inner, tp):
    tensors = make(hidden, inner)
    path = save(tmp_path / "ckpt", split_files(tensors))
    full = full_weights(tensors, torch.bfloat16)
    part = inner // tp
    monkeypatch.setattr(parallel, "world_size", lambda: tp)
    for rank in range(tp):
        monkeypatch.setattr(parallel, "rank", lambda r=rank: r)
        model = TwoLinears(hidden, inner).to(torch.bfloat16)
        load_weights(model, path)
        assert torch.equal(model.up.weight, full["up.weight"][rank * part:(rank + 1) * part])
        assert torch.equal(model.down.weight, full["down.weight"][:, rank * part:(rank + 1) * part])


def test_every_bad_tensor_is_named_at_once(tmp_path):
    tensors = mxfp4_tensors(64, 96)
    tensors["up.weight_packed"] = tensors["up.weight_packed"].float()  # mislabelled: not uint8
    tensors["down.weight_scale"] = tensors["down.weight_scale"][:, :2].contiguous()  # 2 groups, 96 columns need 3
    files = {"a.safetensors": {n: t for n, t in tensors.items() if n != "down.weight_packed"},
             "b.safetensors": {"down.weight_packed": tensors["down.weight_packed"]}}
    path = save(tmp_path, files)
    data = (path / "b.safetensors").read_bytes()
    (path / "b.safetensors").write_bytes(data[:-1])  # truncated by one byte
    with pytest.raises(ValueError) as err:
        load_weights(TwoLinears(64, 96), path)
    message = str(err.value)
    assert "invalid: up.weight_packed: dtype torch.float32, expected torch.uint8" in message
    assert "invalid: down.weight_scale: shape [64, 2], expected [64, 3]" in message
    assert "truncated: down.weight_packed in b.safetensors" in message


def test_packed_width_must_match_the_model(tmp_path):
    tensors = mxfp4_tensors(64, 96)
    path = save(tmp_path, {"model.safetensors": tensors})
    with pytest.raises(ValueError, match=r"invalid: up\.weight_packed: shape \[96, 32\] holds a MXFP4 weight of "
                                         r"shape \[96, 64\], expected \[96, 62\]"):
        load_weights(TwoLinears(62, 96), path)


def test_missing_scales_are_named(tmp_path):
    # A float8 weight without its scales must be refused, not loaded unscaled.
    tensors = {"up.weight_packed": mxfp4_tensors(64, 96)["up.weight_packed"],
               "down.weight": fp8_tensors(64, 96)["down.weight"]}
    with pytest.raises(ValueError) as err:
        load_weights(TwoLinears(64, 96), save(tmp_path, {"model.safetensors": tensors}))
    assert "missing: up.weight_scale" in str(err.value)
    assert "missing: down.weight_scale_inv" in str(err.value)


def test_weight_stored_twice_is_unexpected(tmp_path):
    tensors = mxfp4_tensors(64, 96) | {"up.weight": torch.zeros(96, 64)}
    with pytest.raises(ValueError, match=r"unexpected: up\.weight"):
        load_weights(TwoLinears(64, 96), save(tmp_path, {"model.safetensors": tensors}))


def test_nan_scale_in_checkpoint_is_named(tmp_path):
    tensors = mxfp4_tensors(64, 96)
    tensors["down.weight_scale"][3, 1] = 255
    with pytest.raises(ValueError, match=r"down\.weight_scale: 1 E8M0 scales are 255"):
        load_weights(TwoLinears(64, 96), save(tmp_path, {"model.safetensors": tensors}))


def test_quantization_config():
    mxfp4 = {"quant_method": "compressed-tensors",
             "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}}
    check_config({"quantization_config": mxfp4})
    check_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    check_config({})
    int4 = {"quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 32}}}}
    with pytest.raises(ValueError, match="group_0.*only compressed-tensors scheme supported is MXFP4"):
        check_config({"quantization_config": int4})
    with pytest.raises(ValueError, match="'awq' is not supported"):
        check_config({"quantization_config": {"quant_method": "awq"}})
