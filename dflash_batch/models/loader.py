"""Load Hugging Face safetensors checkpoints into our models, one tensor-parallel slice per rank.

Files are memory-mapped and each rank reads only its own slice of each tensor, so a rank never
holds the full weights. Every mismatch between checkpoint and model is reported at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dflash_batch import parallel
from dflash_batch.models.registry import model_class


def load_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON in {file}: {e}") from None


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the .safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if single.exists():
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _rank_slice(shape: list[int], shard_dim: int | None) -> tuple[slice, ...]:
    index = [slice(None)] * len(shape)
    if shard_dim is not None:
        part = shape[shard_dim] // parallel.world_size()
        index[shard_dim] = slice(parallel.rank() * part, (parallel.rank() + 1) * part)
    return tuple(index)


def load_weights(model: nn.Module, path: str | Path) -> None:
    path = Path(path)
    rename = getattr(model, "checkpoint_name", lambda name: name)
    params = dict(model.named_parameters())
    files = _checkpoint_files(path)

    # Plan: which checkpoint tensor fills which parameter; collect every problem before reading data.
    plan: dict[Path, list[tuple[str, nn.Parameter, int | None]]] = {}
    unexpected, mismatched, filled = [], [], set()
    for ckpt_name, file in files.items():
        name = rename(ckpt_name)
        if name is None:
            continue
        if name not in params or name in filled:
            unexpected.append(ckpt_name)
            continue
        filled.add(name)
        plan.setdefault(file, []).append((ckpt_name, params[name], getattr(params[name], "shard_dim", None)))
    missing = sorted(set(params) - filled)

    for file, entries in plan.items():
        with safe_open(file, "pt") as f:
            for ckpt_name, param, shard_dim in entries:
                shape = f.get_slice(ckpt_name).get_shape()
                expected = list(param.shape)
                if shard_dim is not None:
                    expected[shard_dim] *= parallel.world_size()
                if shape != expected:
                    mismatched.append(f"{ckpt_name}: checkpoint {shape} vs model {expected}")

    if missing or unexpected or mismatched:
        lines = [f"checkpoint {path} does not match {type(model).__name__}:"]
        lines += [f"  missing: {n}" for n in missing]
        lines += [f"  unexpected: {n}" for n in sorted(unexpected)]
        lines += [f"  shape mismatch: {m}" for m in sorted(mismatched)]
        raise ValueError("\n".join(lines))

    for file, entries in plan.items():
        with safe_open(file, "pt") as f:
            for ckpt_name, param, shard_dim in entries:
                tensor_slice = f.get_slice(ckpt_name)
                part = tensor_slice[_rank_slice(tensor_slice.get_shape(), shard_dim)]
                param.data.copy_(part.to(param.dtype))


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> nn.Module:
    config = load_config(path)
    # Build parameters directly in their final dtype and device, so a large model never exists
    # as a full fp32 copy. No blanket .to(dtype) afterwards: it would also round float32
    # buffers such as RoPE's inv_freq down to bf16.
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config)(config)
    load_weights(model, path)
    return model.eval()
