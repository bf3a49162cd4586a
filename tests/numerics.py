"""How float results are compared, so that a test holds on any x86 CPU and thread count.

float32 results differ in their last bits between CPUs (Intel and AMD kernels block matmuls
differently) and thread counts (reduction order), by more where values are large: float32 is
compared with an absolute tolerance scaled to the expected tensor's magnitude, REL32 x
max|expected| (plus REL32 relative). Rounding over these tiny models stays near 1e-6 of the
magnitude; a real error (a wrong mask, rotation, norm or state) moves results by O(1) of it.

float64 runs (the models run in float64 for exactness tests) are compared at REL64 of the
magnitude: rounding is ~1e-15, so the same errors stand out by ten orders of magnitude, and an
equivalence that holds only approximately (a state committed one row off) is caught too.
"""

from __future__ import annotations

import torch

REL32 = 1e-4
REL64 = 1e-10


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float | None = None, msg: str | None = None) -> None:
    """`actual` within rel x max|expected| of `expected` (rel: REL64 for float64, else REL32)."""
    if rel is None:
        rel = REL64 if expected.dtype == torch.float64 and actual.dtype == torch.float64 else REL32
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=rel * max(scale, 1e-30), rtol=rel, msg=msg)
