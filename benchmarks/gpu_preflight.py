"""One line that says what the GPU check runs on: which nvcc and CUDA_HOME, which libcudart,
which GPU, the versions of torch, Triton, flashinfer and fla, and whether this Triton is the one
the carried Triton cache was built for (its build, CUDA backend and environment, as recorded in
benchmarks/triton_cache.json: otherwise every kernel would compile here) and the cache is where
it was built (`prebuild_flashinfer.py check`, run after it, loads the prebuilt flashinfer
modules). Exits 1 when something the check needs is missing, after printing everything it found.

python benchmarks/gpu_preflight.py [--no-gpu]   # --no-gpu: the device twin, on a CPU machine
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def libcudart() -> str | None:
    """The libcudart the flashinfer modules resolve at load: the one torch's CUDA build brings
    (already in the process), else the toolkit's, else the loader's."""
    loaded = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcudart" in line]
    if loaded:
        return loaded[0]
    home = os.environ.get("CUDA_HOME", "")
    found = sorted(Path(home).glob("lib64/libcudart.so*")) if home else []
    return str(found[0]) if found else ctypes.util.find_library("cudart")


def carried_triton_cache(problems: list[str]) -> int:
    """Kernels in the carried cache; a Triton that is not the one it was built for is a problem."""
    from benchmarks.carried_cache import CACHE_DIR, MANIFEST, triton_identity

    built = json.loads(MANIFEST.read_text())
    for key, here in triton_identity().items():
        if built[key] != here:
            problems.append(f"the Triton cache was built for {key} {built[key]!r}, here it is {here!r}: every kernel "
                            "would compile")
    kernels = len(list(Path(CACHE_DIR).glob("*/__grp__*.json")))
    if not kernels:
        problems.append(f"no carried Triton cache in {CACHE_DIR}")
    return kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-gpu", action="store_true", help="a CPU machine (the device twin): no GPU expected")
    a = ap.parse_args()
    problems = []
    nvcc = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME")
    if not home or not Path(home, "bin", "nvcc").exists():
        problems.append("CUDA_HOME unset or without bin/nvcc")
    nvcc_version = None
    if home and Path(home, "bin", "nvcc").exists():
        out = subprocess.run([f"{home}/bin/nvcc", "--version"], capture_output=True, text=True).stdout
        nvcc_version = out.strip().splitlines()[-1] if out else None
    gpu = None
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # loads the CUDA runtime, so libcudart shows in the maps
        p = torch.cuda.get_device_properties(0)
        gpu = dict(name=p.name, sm=f"{p.major}{p.minor}", gib=round(p.total_memory / 2**30), count=torch.cuda.device_count())
    elif not a.no_gpu:
        problems.append("no CUDA device")
    if not version("flashinfer-python"):
        problems.append("flashinfer not installed")
    triton_kernels = carried_triton_cache(problems)
    line = dict(nvcc=nvcc, cuda_home=home, nvcc_version=nvcc_version, libcudart=libcudart(), gpu=gpu,
                torch=torch.__version__, torch_cuda=torch.version.cuda, triton=version("triton"),
                flashinfer=version("flashinfer-python"), fla=version("fla-core"),
                triton_cache_kernels=triton_kernels,
                jit_disabled=bool(os.environ.get("FLASHINFER_DISABLE_JIT")), problems=problems)
    print(json.dumps(line))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
