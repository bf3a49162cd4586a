"""Triton when it is installed; stand-ins that keep every kernel module importable when it is not
(CPU machines without Triton use the torch references only)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = tl = None


def jit(fn):
    """triton.jit, or a stand-in that refuses to launch."""
    if triton is not None:
        return triton.jit(fn)

    class _Missing:
        def __getitem__(self, grid):
            raise RuntimeError(f"{fn.__name__} needs Triton, which is not installed")

    return _Missing()


def available() -> bool:
    return triton is not None
