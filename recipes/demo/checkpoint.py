"""Write a trained container's weights as a Hugging Face checkpoint directory that
`dflash_batch.models.loader.load_model` reads: config.json + model.safetensors (the target's
directory also holds the tokenizer files, written there by the tokenizer step).

The target's tensors get the `language_model.` prefix of the real Kimi-K3 checkpoint. The
tensors the real checkpoint keeps in float32 (KDA's A_log, dt_bias, convs and o_norm, the
router bias) stay float32 whatever `dtype`; the rest is stored in `dtype`. Routed experts are
stored as plain `experts.{e}.w{1,2,3}.weight` tensors (the loader takes them as is; the real
checkpoint's MXFP4 packing would only lose precision here).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dflash_batch.models.loader import checkpoint_state_dict

FP32_SUFFIXES = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
                 "o_norm.weight", "gate.e_score_correction_bias")


def save(model: nn.Module, config: dict, directory: str | Path, dtype: torch.dtype = torch.float32,
         prefix: str = "") -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in checkpoint_state_dict(model).items():
        keep = name.endswith(FP32_SUFFIXES)
        tensors[prefix + name] = t.detach().to(torch.float32 if keep else dtype).contiguous().clone()
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], "torch_dtype": config["torch_dtype"]}
    (d / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def size_mb(directory: str | Path) -> float:
    return sum(f.stat().st_size for f in Path(directory).iterdir()) / 1e6
