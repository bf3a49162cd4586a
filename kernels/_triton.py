"""Triton when it is installed; stand-ins that keep every kernel module importable when it is not
(CPU machines without Triton use the torch references only)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = tl = None


def jit(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """triton.jit, or a stand-in that refuses to launch. `do_not_specialize` names the integer
    arguments that change from call to call (row and sequence counts, table widths): Triton
    would otherwise compile a variant per value class (1, a multiple of 16, other), so the
    kernels the GPU check compiles ahead (benchmarks/triton_cache.py) would depend on the batch.
    Use as `@jit` or `@jit(do_not_specialize=(...))`."""
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize)
    if triton is not None:
        return triton.jit(fn, do_not_specialize=list(do_not_specialize))

    class _Missing:
        def __getitem__(self, grid):
            raise RuntimeError(f"{fn.__name__} needs Triton, which is not installed")

    return _Missing()


def available() -> bool:
    return triton is not None
