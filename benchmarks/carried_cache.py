"""The Triton cache the GPU check carries (benchmarks/triton_cache.py builds it), as the device
reads it: Triton's own file cache, except that a kernel or launcher not in it is named at once.

gpu_check.sh copies .triton_cache/ to CACHE_DIR (the absolute path it was built at: Triton's
group files name their members by absolute path, so a cache elsewhere misses) and sets
TRITON_CACHE_MANAGER=benchmarks.carried_cache:CarriedCache, which every process's Triton loads
at its first compile. On a miss it prints one line to stderr and appends it to
$DFLASH_TRITON_MISSES (the check counts them per stage); with $DFLASH_TRITON_STRICT=1 it raises
NotCarried instead of letting Triton compile (the device twin's check runs so).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from triton.runtime.cache import FileCacheManager

CACHE_DIR = "/tmp/dflash_triton_cache"
MISSES_ENV, STRICT_ENV = "DFLASH_TRITON_MISSES", "DFLASH_TRITON_STRICT"
LAUNCHERS = ("__triton_launcher", "cuda_utils")  # C modules Triton builds with gcc, in its cache
ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "benchmarks" / "triton_cache.json"
NOT_KERNEL_CODE = {"tests", "benchmarks", "recipes", "build", "docs"}


class NotCarried(RuntimeError):
    """A kernel or launcher the carried cache lacks, with compiling forbidden."""


def not_carried(what: str, key: str) -> None:
    line = f"triton cache: {what} is not carried (key {key[:16]})"
    if os.environ.get(STRICT_ENV) == "1":
        raise NotCarried(line)
    print(f"{line}: compiling it here", file=sys.stderr, flush=True)
    if path := os.environ.get(MISSES_ENV):
        with open(path, "a") as f:
            f.write(line + "\n")


class CarriedCache(FileCacheManager):
    """compile() asks get_group for `{kernel}.json`; a launcher build asks get_file for its module,
    and puts it when there was none or the one there did not load."""

    def get_group(self, filename: str) -> dict[str, str] | None:
        group = super().get_group(filename)
        if not group or filename not in group:
            not_carried(f"kernel {filename.removesuffix('.json')}", self.key)
        return group

    def get_file(self, filename: str) -> str | None:
        path = super().get_file(filename)
        if path is None and filename.startswith(LAUNCHERS):
            not_carried(f"launcher {filename}", self.key)
        return path

    def put(self, data, filename: str, binary: bool = True) -> str:
        # Triton builds a launcher again when the carried one does not load (and only logs it).
        if filename.startswith(LAUNCHERS) and self.has_file(filename):
            not_carried(f"loadable launcher {filename}", self.key)
        return super().put(data, filename, binary)


def kernel_sources() -> dict[str, str]:
    """sha256 by path of every file of each directory of the repository that defines a Triton
    kernel (a function decorated with jit): a kernel's cache key holds its source, its first line
    and those of the functions it calls, so any change there calls for a rebuild. Found by
    looking, not by name, so a kernel package that moves (kernels/ to dflash_batch/kernels/) shows."""
    jit = re.compile(r"^@(?:\w+\.)*jit\b", re.M)
    dirs = {p.parent for p in ROOT.rglob("*.py")
            if not NOT_KERNEL_CODE & set(p.relative_to(ROOT).parts) and not any(part.startswith(".") for part in
                                                                            p.relative_to(ROOT).parts)
            and jit.search(p.read_text())}
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in sorted(dirs) for p in sorted(d.glob("*.py"))}


def triton_identity() -> dict:
    """What of Triton's cache key is this machine's: its build (Python files and libtriton), its
    CUDA backend (ptxas and the arch), the cache-invalidating environment, the Python."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import triton_key
    from triton.runtime.jit import get_cache_invalidating_env_vars

    return dict(triton=triton.__version__, key=hashlib.sha256(triton_key().encode()).hexdigest(),
                backend=make_backend(GPUTarget("cuda", 90, 32)).hash(), env=get_cache_invalidating_env_vars(),
                python=f"{sys.version_info.major}.{sys.version_info.minor}")
