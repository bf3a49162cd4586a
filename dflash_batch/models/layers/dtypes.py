"""The precision numerics-sensitive steps (norms, gates, recurrent state, logits) compute in."""

from __future__ import annotations

import torch


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: half-precision models compute these steps in float32, a float64 model
    (the exactness tests run the models in float64) stays in float64."""
    return torch.promote_types(dtype, torch.float32)


def wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(wide_dtype(x.dtype))
