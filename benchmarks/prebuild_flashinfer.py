"""flashinfer's kernels for the GPU check, compiled ahead of time on a machine with nvcc and no GPU,
so that the device's few minutes are not spent in nvcc (a JIT build of these modules takes longer
than the whole check may run).

The modules are the ones the check's wrappers ask for on an H200 (sm_90a, flashinfer's "fa3"
backends), named by flashinfer's own spec functions with the arguments its wrappers pass them:
  mla          BatchMLAPagedAttentionWrapper, bf16, latent 512 + 64 (Kimi-K3 and its drafter)
  gqa          BatchPrefillWithPagedKVCacheWrapper, bf16, 64-wide heads (the tiny Qwen3 pair)
  gqa_window   the same with a sliding window (the Qwen3 drafter's sliding layers)

  python benchmarks/prebuild_flashinfer.py build [--out .flashinfer_aot] [MODULE...]
  python benchmarks/prebuild_flashinfer.py check                            # every module loads prebuilt

`build` writes OUT/URI/URI.so and OUT/manifest.json (seconds per compile unit, from ninja's log);
gpu_check.sh copies OUT's modules where flashinfer looks before it compiles (the installed package's
data/aot/: jit/core.py JitSpec.aot_path); `check` loads each with JIT disabled and fails naming any module flashinfer would still compile. The device runs with
FLASHINFER_DISABLE_JIT=1, so a missing module is an error at once, not minutes of nvcc.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")

import torch  # noqa: E402

MODULES = ("mla", "gqa", "gqa_window")
BF16, I32 = torch.bfloat16, torch.int32


def spec(name: str):
    """flashinfer's JitSpec for one module, with the argument order of the wrapper that loads it
    (mla/_core.py BatchMLAPagedAttentionWrapper.plan, prefill.py BatchPrefillWithPagedKVCacheWrapper.plan)."""
    from flashinfer.jit.attention.modules import gen_batch_mla_module, gen_batch_prefill_module

    if name == "mla":  # backend, dtype_q, dtype_kv, dtype_o, dtype_idx, ckv, kpe, use_profiler
        return gen_batch_mla_module("fa3", BF16, BF16, BF16, I32, 512, 64, False)
    if name in ("gqa", "gqa_window"):  # ... head_dim_qk, head_dim_vo, pos_encoding NONE, window, soft cap, fp16 qk
        return gen_batch_prefill_module("fa3", BF16, BF16, BF16, I32, 64, 64, 0, name == "gqa_window", False, False)
    raise ValueError(f"unknown module {name!r}; known: {', '.join(MODULES)}")


def cuda_home() -> str:
    """CUDA_HOME, or the toolkit that `nvcc --version` belongs to (the nvcc on PATH may be a wrapper
    script outside the toolkit, and flashinfer links libcudart from $CUDA_HOME/lib64)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    for root in sorted(Path("/usr/local").glob("cuda*"), reverse=True):
        if (root / "bin" / "nvcc").exists() and list((root / "lib64").glob("libcudart.so*")):
            return str(root)
    raise SystemExit("no CUDA toolkit found: set CUDA_HOME to the directory holding bin/nvcc and lib64/libcudart.so")


def unit_seconds(spec) -> dict[str, float]:
    """Seconds per compile unit of one module, from ninja's log (start and end in ms per output;
    one log for every module, the latest line per output counts)."""
    log = spec.build_dir.parent / ".ninja_log"
    out = {}
    for line in log.read_text().splitlines()[1:] if log.exists() else []:
        start, end, _, target, _ = line.split("\t")
        if Path(target).parent.name == spec.name:
            out[Path(target).name.removeprefix(spec.name + "_")] = round((int(end) - int(start)) / 1000, 1)
    return out


def cuda_stub(work: Path) -> Path:
    """A directory holding an empty libcuda.so (soname libcuda.so.1) for the linker: flashinfer links
    -lcuda, which a toolkit without a driver lacks. The driver's own libcuda.so.1 is what the module
    loads on the device; the stub only lets the link record that name."""
    stubs = work / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-shared", "-x", "c", "/dev/null", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so")],
                   check=True)
    return stubs


def curand_include() -> Path:
    """FA3's headers include cutlass utilities that include curand_kernel.h: the toolkit's when it
    has one, else the nvidia-curand wheel's (CUDA torch brings it)."""
    if Path(os.environ["CUDA_HOME"], "include", "curand_kernel.h").exists():
        return Path(os.environ["CUDA_HOME"], "include")
    nvidia = importlib.util.find_spec("nvidia")
    for root in nvidia.submodule_search_locations if nvidia else []:
        for header in sorted(Path(root).glob("*/include/curand_kernel.h")):
            return header.parent
    raise SystemExit("curand_kernel.h is in neither $CUDA_HOME/include nor an nvidia-curand wheel "
                     "(pip install nvidia-curand)")


def build(out: Path, work: Path, names: list[str]) -> None:
    os.environ["CUDA_HOME"] = cuda_home()
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count()))
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(work.resolve())  # read by flashinfer.jit.env at import
    if not list(Path(os.environ["CUDA_HOME"]).glob("lib64/stubs/libcuda.so")):
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{cuda_stub(work.resolve())}"
    os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = f"-isystem {curand_include()}"
    from flashinfer.jit.core import build_jit_specs

    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"modules": {}}
    nvcc = subprocess.run([f"{os.environ['CUDA_HOME']}/bin/nvcc", "--version"], capture_output=True, text=True)
    manifest.update(flashinfer=__import__("flashinfer").__version__, arch=os.environ["FLASHINFER_CUDA_ARCH_LIST"],
                    nvcc=nvcc.stdout.strip().splitlines()[-1], jobs=int(os.environ["MAX_JOBS"]))
    for name in names:
        s = spec(name)
        t0 = time.time()
        build_jit_specs([s], verbose=False, skip_prebuilt=False)
        seconds = round(time.time() - t0, 1)
        dest = out / s.name / f"{s.name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(s.jit_library_path, dest)
        manifest["modules"][name] = dict(uri=s.name, seconds=seconds, mib=round(dest.stat().st_size / 2**20, 1),
                                         units=unit_seconds(s))
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"{name}: {s.name} in {seconds:.0f} s, {dest.stat().st_size / 2**20:.1f} MiB", flush=True)


def check(names: list[str]) -> int:
    """Each module found where flashinfer looks first, and loaded from there with JIT disabled (a
    module it would compile fails here, naming itself)."""
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    failed = 0
    for name in names:
        s = spec(name)
        try:
            s.build_and_load()
            print(f"{name}: loaded prebuilt from {s.aot_path}")
        except Exception as e:  # noqa: BLE001 (every failure is reported the same way)
            failed += 1
            print(f"{name}: NOT LOADED ({type(e).__name__}: {str(e).splitlines()[0]})")
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["build", "check"])
    ap.add_argument("modules", nargs="*", default=list(MODULES), metavar="MODULE", help=", ".join(MODULES))
    ap.add_argument("--out", type=Path, default=Path(".flashinfer_aot"))
    ap.add_argument("--work", type=Path, default=Path("build/flashinfer_jit"), help="nvcc's objects (kept: a rerun "
                    "compiles only what changed)")
    args = ap.parse_args()
    if unknown := set(args.modules) - set(MODULES):
        ap.error(f"unknown modules {sorted(unknown)}; known: {', '.join(MODULES)}")
    if args.action == "build":
        build(args.out, args.work, args.modules)
    else:
        sys.exit(check(args.modules))


if __name__ == "__main__":
    main()
