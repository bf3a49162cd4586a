"""Map a checkpoint's `architectures[0]` (config.json) to the class that implements it here."""

from __future__ import annotations

from dflash_batch.models.dflash import DFlash2Drafter, DFlashDrafter
from dflash_batch.models.kimi_k3 import KimiK3ForConditionalGeneration
from dflash_batch.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "KimiK3ForConditionalGeneration": KimiK3ForConditionalGeneration,
    "DFlashDraftModel": DFlashDrafter,
    "DFlash2DraftModel": DFlash2Drafter,
}


def model_class(config: dict) -> type:
    archs = config.get("architectures") or [None]
    cls = ARCHITECTURES.get(archs[0])
    if cls is None:
        raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return cls
