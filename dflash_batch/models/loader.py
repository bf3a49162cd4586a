"""Load Hugging Face safetensors checkpoints into our models, one tensor-parallel slice per rank.

Files are memory-mapped and each rank reads only its own slice of each tensor, so a rank never
holds the full weights. Quantized weights (MXFP4, block FP8; see quant.py) are dequantized to
the parameter dtype as they are read, unless the model keeps them as stored (parameters named
`X.weight_packed` / `X.weight_scale`: Kimi-K3's MXFP4 routed experts). Every mismatch between checkpoint and model is found from
the file headers alone and reported at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from dflash_batch import parallel
from dflash_batch.models import quant
from dflash_batch.models.layers.expert_parallel import Placement
from dflash_batch.models.registry import model_class


def load_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON in {file}: {e}") from None


# safetensors header dtype codes; an unknown code is kept as its string, which no check accepts.
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
           "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class _Stored:
    """A checkpoint tensor as its file header describes it: enough to check it unread."""

    file: Path
    dtype: torch.dtype | str
    shape: list[int]


def _read_header(file: Path) -> tuple[dict[str, _Stored], list[str]]:
    """The tensors a .safetensors file lists, and report lines for those it is too short to hold."""
    total = file.stat().st_size
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= total - 8:
            raise ValueError(f"{file} has no valid safetensors header: its first 8 bytes claim a header of "
                             f"{size} bytes in a file of {total}")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} has no valid safetensors header: {e}") from None
    data_bytes = file.stat().st_size - 8 - size
    tensors, truncated = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _Stored(file, _DTYPES.get(entry["dtype"], entry["dtype"]), entry["shape"])
        end = entry["data_offsets"][1]
        if end > data_bytes:
            truncated.append(f"truncated: {name} in {file.name} (ends at data byte {end}, file holds {data_bytes})")
    return tensors, truncated


def _checkpoint_tensors(path: Path) -> tuple[dict[str, _Stored], list[str]]:
    """Every checkpoint tensor by name, read from file headers, and report lines for truncated ones."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    elif (path / "model.safetensors").exists():
        weight_map = None
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    tensors, truncated = {}, []
    for file in sorted(set(weight_map.values())) if weight_map else [path / "model.safetensors"]:
        listed, short = _read_header(file)
        # The index decides which file holds a tensor, should two files list it.
        tensors |= {n: t for n, t in listed.items() if weight_map is None or weight_map.get(n) == file}
        truncated += short
    return tensors, truncated


@dataclass(frozen=True)
class _Plain:
    """A weight stored as itself; `quant.QuantizedWeight` is the other kind of source."""

    name: str

    @property
    def names(self) -> tuple[str]:
        return (self.name,)

    def problems(self, tensors: dict[str, _Stored], shape: list[int]) -> list[str]:
        stored = tensors[self.name].shape
        return [] if stored == shape else [f"shape mismatch: {self.name}: checkpoint {stored} vs model {shape}"]

    def load(self, read: Callable[[str], Any], index: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        return read(self.name)[index].to(dtype)


def _sources(tensors: dict[str, _Stored], kept: Callable[[str], bool]) -> list[tuple[str, _Plain | quant.QuantizedWeight]]:
    """(weight name, how it is stored) for every weight in the checkpoint. A quantized weight the
    model keeps as stored (`kept(data name)`: MXFP4 experts) is read as its plain tensors."""
    quantized = {w: q for w, q in quant.find_quantized(tensors).items()
                 if not (q.format.data_suffix and kept(q.names[0]))}
    paired = {n for q in quantized.values() for n in q.names}
    return [(n, _Plain(n)) for n in tensors if n not in paired] + list(quantized.items())


def _rank_slice(shape: list[int], shard_dim: int | None) -> tuple[slice, ...]:
    index = [slice(None)] * len(shape)
    if shard_dim is not None:
        part = shape[shard_dim] // parallel.world_size()
        index[shard_dim] = slice(parallel.rank() * part, (parallel.rank() + 1) * part)
    return tuple(index)


def _full_shape(param: nn.Parameter) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "shard_dim", None) is not None:
        shape[param.shard_dim] *= parallel.world_size()
    return shape


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: a whole parameter, or one part of a packed one (rows
    `rows` of the parameter on this rank; `shape` is the part's full checkpoint shape)."""

    name: str
    param: nn.Parameter
    shape: list[int]
    rows: slice | None = None

    def fill(self, tensor: torch.Tensor) -> None:
        (self.param.data if self.rows is None else self.param.data[self.rows]).copy_(tensor)


def _targets(model: nn.Module) -> dict[str, _Target]:
    """Every checkpoint-side name the model expects, with where its tensor goes. A parameter
    with `packed` [(part, full rows), ...] (linear.MergedColumnLinear) stands for one checkpoint
    tensor per part, named as sibling modules of the packed one."""
    targets = {}
    for name, param in model.named_parameters():
        packed = getattr(param, "packed", None)
        if packed is None:
            targets[name] = _Target(name, param, _full_shape(param))
            continue
        module, leaf = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
        start = 0
        for part, rows in packed:  # parts stacked along dim 0; each cut along shard_dim
            local = rows // parallel.world_size() if param.shard_dim == 0 else rows
            shape = [rows, *_full_shape(param)[1:]]
            targets[f"{module}.{part}.{leaf}"] = _Target(name, param, shape, slice(start, start + local))
            start += local
    return targets


def checkpoint_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the names load_weights reads them by (packed parameters split
    into their parts), for a model built on one rank."""
    state = {name: p.detach() for name, p in model.named_parameters() if getattr(p, "packed", None) is None}
    for name, target in _targets(model).items():
        if target.rows is not None:
            state[name] = target.param.detach()[target.rows]
    return state


def load_weights(model: nn.Module, path: str | Path) -> None:
    path = Path(path)
    rename = getattr(model, "checkpoint_name", lambda name: name)
    targets = _targets(model)
    tensors, problems = _checkpoint_tensors(path)

    # Plan: which source fills which parameter; collect every problem before reading data.
    # Sources report their own problems as "kind: detail" lines naming checkpoint tensors.
    plan: list[tuple[_Plain | quant.QuantizedWeight, _Target]] = []
    unexpected, filled = [], set()
    for weight, source in _sources(tensors, lambda stored: rename(stored) in targets):
        name = rename(weight)
        if name is None:
            continue
        if name not in targets or name in filled:
            unexpected += [n for n in source.names if n in tensors]
            continue
        filled.add(name)
        target = targets[name]
        plan.append((source, target))
        expected = list(target.shape)
        if getattr(target.param, "checkpoint_padded", False) and weight in tensors:
            # Stored longer than the model uses (Kimi's A_log pads heads with zeros): the rank
            # slice is cut from the first entries, so only a shorter checkpoint is an error.
            expected[0] = max(expected[0], tensors[weight].shape[0])
        problems += source.problems(tensors, expected)
    missing = sorted(set(targets) - filled)

    if missing or unexpected or problems:
        lines = [f"checkpoint {path} does not match {type(model).__name__}:"]
        lines += [f"  missing: {n}" for n in missing]
        lines += [f"  unexpected: {n}" for n in sorted(unexpected)]
        lines += [f"  {p}" for p in sorted(problems)]
        raise ValueError("\n".join(lines))

    with ExitStack() as stack:
        opened = {}

        def read(name: str) -> Any:
            file = tensors[name].file
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(file, "pt"))
            return opened[file].get_slice(name)

        # File by file, so each file's pages are read together; a pair may span two files.
        for source, target in sorted(plan, key=lambda entry: tensors[entry[0].names[0]].file):
            index = _rank_slice(target.shape, getattr(target.param, "shard_dim", None))
            target.fill(source.load(read, index, target.param.dtype))


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(path: str | Path, dtype: torch.dtype, device: torch.device | str,
                expert_placement: Placement | None = None) -> nn.Module:
    """The checkpoint's model from its config.json, its weights not read (on the meta device: what
    it would hold, sizing.py). `expert_placement`: the routed experts sharded whole by it."""
    config = load_config(path)
    if expert_placement is not None:
        config["expert_placement"] = expert_placement
    quant.check_config(config)
    # Build parameters directly in their final dtype and device, so a large model never exists
    # as a full fp32 copy. No blanket .to(dtype) afterwards: it would also round float32
    # buffers such as RoPE's inv_freq down to bf16.
    with torch.device(device), default_dtype(dtype):
        return model_class(config)(config)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               expert_placement: Placement | None = None) -> nn.Module:
    model = build_model(path, dtype, device, expert_placement)
    load_weights(model, path)
    return model.eval()
