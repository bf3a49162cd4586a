"""The Triton cache the GPU check carries: every kernel its stages run (kernels/ and fla's KDA
kernels), compiled on a machine without a GPU for the device (one H200, sm_90a; Triton 3.6 on
Python 3.12), so that the device compiles nothing.

How, without a GPU:
- Triton's active driver is replaced by one that answers as an H200 does (target cuda 90, warp
  32, its shared memory and SM count), and the torch.cuda probes that fla reads at import (name,
  capability, properties) answer the same, so fla picks the config lists and constants it picks
  on the device;
- every `kernel[grid](...)` compiles without launching (JITFunction.run with warmup), and each
  op of kernels/ (and kernels/kda.py's fla calls) is shadowed: its Triton version compiles, its
  torch twin computes the result the workload goes on with;
- the workloads are each stage's own (WORKLOADS): the kernel test files under pytest, the engine
  tests of tests/test_gpu.py on the CPU (the same pairs, dtypes and requests), the Kimi-K3 pair
  at one TP8 rank's widths as benchmarks/kimi_gpu_check.py makes it;
- fla's autotuned kernels are pinned to one config each (no GPU to time them): the first config
  fla lists for an H200 that has 4 warps, else its first. The table goes in the manifest and the
  device pins the same ($DFLASH_FLA_CONFIGS, kernels/kda.py), so it compiles no other;
- each kernel's launcher (a C module Triton builds with gcc at a kernel's first launch) and
  Triton's driver module are built as well, against this Python 3.12's headers.

Triton's cache key holds Triton's build (its Python files and libtriton for this Python), the
kernel's source and first line, the specialisation, the options and the cache-invalidating
environment; the group files name their members by absolute path. So the cache is built in
carried_cache.CACHE_DIR, the device copies it back there, and the manifest records Triton's key
and backend, which the device's preflight compares with its own.

  python benchmarks/triton_cache.py build [STAGE...]   # .triton_cache/ and benchmarks/triton_cache.json
  python benchmarks/triton_cache.py check [STAGE...]   # .triton_cache/ serves every stage, compiling forbidden

Both need the device's Triton and Python (benchmarks/device_twin.sh runs them in its venv) and
fla from the carried wheel on PYTHONPATH. tests/test_triton_cache.py fails in CI when a file of
kernels/ changed after the build.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["TRITON_INTERPRET"] = "0"  # tests/conftest.py would turn the interpreter on without CUDA

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from benchmarks.carried_cache import (CACHE_DIR, MANIFEST, STRICT_ENV, NotCarried, kernel_sources,  # noqa: E402
                                      triton_identity)

OUT = ROOT / ".triton_cache"
H200 = dict(name="NVIDIA H200", capability=(9, 0), max_shared_mem=232448, multiprocessor_count=132)


# -- an H200 that is not there ---------------------------------------------------------------------
class FakeH200:
    """The parts of Triton's CUDA driver that compiling, fla's probes and the binder read."""

    def __init__(self) -> None:
        self.utils = self

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", H200["capability"][0] * 10 + H200["capability"][1], 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_device_properties(self, device: int) -> dict:
        return dict(max_shared_mem=H200["max_shared_mem"], multiprocessor_count=H200["multiprocessor_count"],
                    max_num_regs=65536, warpSize=32)

    def get_device_interface(self):
        return torch.cuda

    def is_active(self) -> bool:
        return True


def emulate_h200() -> None:
    """Before fla is imported: Triton's driver and torch.cuda's probes answer as an H200's.
    torch.cuda.is_available stays False, so the project's own code keeps to the CPU."""
    triton.runtime.driver.set_active(FakeH200())
    props = types.SimpleNamespace(name=H200["name"], major=H200["capability"][0], minor=H200["capability"][1],
                                  multi_processor_count=H200["multiprocessor_count"],
                                  shared_memory_per_block_optin=H200["max_shared_mem"], total_memory=141 << 30)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.get_device_capability = lambda *a, **k: H200["capability"]
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0


# -- compiling without launching -------------------------------------------------------------------
class Compiled:
    """What the workloads compiled (or found), by stage; the kernels missing when compiling is forbidden."""

    def __init__(self) -> None:
        self.stage = ""
        self.kernels: dict[str, dict[str, dict]] = {}  # stage -> cache key -> row
        self.binaries: dict[str, object] = {}           # cache key -> CompiledKernel
        self.missing: dict[str, set[str]] = {}

    def ran(self, fn: JITFunction, kernel, seconds: float) -> None:
        self.binaries[kernel.hash] = kernel
        row = dict(kernel=fn.fn.__name__, module=fn.fn.__module__, seconds=round(seconds, 2),
                   shared=kernel.metadata.shared, num_warps=kernel.metadata.num_warps)
        self.kernels.setdefault(self.stage, {}).setdefault(kernel.hash, row)

    def lacked(self, fn: JITFunction) -> None:
        self.missing.setdefault(self.stage, set()).add(fn.fn.__name__)


def compile_only(compiled: Compiled) -> None:
    """Every launch compiles (or loads from the cache) and launches nothing; a kernel the cache
    lacks while compiling is forbidden (NotCarried) is noted and skipped."""
    run = JITFunction.run

    def warmup(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except NotCarried:
            compiled.lacked(self)
            return None
        compiled.ran(self, kernel, time.perf_counter() - t0)
        return kernel

    JITFunction.run = warmup


def choose_fla_configs(chosen: dict[str, dict]) -> None:
    """At an autotuned kernel's first call, pin it to the first config (of those fla lists for this
    GPU and its pruning keeps) with 4 warps, else the first; `chosen` gets the table."""
    run = Autotuner.run

    def pinned(self, *args, **kwargs):
        name = self.base_fn.__name__
        if name not in chosen:
            self.nargs = dict(zip(self.arg_names, args))
            configs = self.prune_configs(kwargs)
            config = next((c for c in configs if c.num_warps == 4), configs[0])
            chosen[name] = dict(kwargs=config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages,
                                listed=len(self.configs))
            self.configs = [config]
        kernel = run(self, *args, **kwargs)
        if kernel is not None and kernel.metadata.shared > H200["max_shared_mem"]:
            raise RuntimeError(f"{name}'s pinned config {chosen[name]} needs {kernel.metadata.shared} bytes of shared "
                               f"memory, more than an H200's {H200['max_shared_mem']}")
        return kernel

    Autotuner.run = pinned


def refuse_autotuning(compiled: Compiled) -> None:
    """An autotuned kernel not pinned to one config would be timed over its list on the device:
    noted as missing (with the pin the device reads, $DFLASH_FLA_CONFIGS, each has one)."""
    run = Autotuner.run

    def pinned_only(self, *args, **kwargs):
        if len(self.configs) > 1:
            compiled.missing.setdefault(compiled.stage, set()).add(f"{self.base_fn.__name__} (autotuned, not pinned)")
            return None
        return run(self, *args, **kwargs)

    Autotuner.run = pinned_only


# -- the kernels' ops, shadowed ---------------------------------------------------------------------
def shadowed(triton_fn, torch_fn):
    """triton_fn compiles (no launch: compile_only); torch_fn, given the arguments it takes,
    returns (or writes) the result."""
    takes = inspect.signature(torch_fn).parameters

    def op(*args, **kwargs):
        triton_fn(*args, **kwargs)
        return torch_fn(*args, **{k: v for k, v in kwargs.items() if k in takes})

    op.__name__ = triton_fn.__name__
    return op


def shadow_kernels() -> None:
    """kernels.ops picks the shadowed Triton ops on any device; the test files' direct imports of
    the *_triton functions and kernels/kda.py's fla calls are shadowed too. fla is used for a
    float32 state pool, as on a GPU (dflash_batch/models/layers/kda.py kda_kernels)."""
    from dflash_batch.kernels import kda, ops
    from dflash_batch.models.layers import kda as kda_layer

    shadow = types.SimpleNamespace(name="triton")
    for op in ("sample", "accept", "prepare", "scatter", "attn_res", "moe_mxfp4"):
        module = sys.modules[getattr(ops.TRITON, op).__module__]
        fn = shadowed(getattr(ops.TRITON, op), getattr(ops.TORCH, op))
        setattr(shadow, op, fn)
        setattr(module, f"{op}_triton", fn)
    ops.for_device = lambda device: shadow
    recurrent = shadowed(kda.recurrent, kda_layer.kda_recurrent)
    chunked = shadowed(kda.chunked, kda_layer.kda_chunked)
    kda.recurrent, kda.chunked = recurrent, chunked
    torch_kernels = kda_layer.kda_kernels
    kda_layer.kda_kernels = lambda state: (recurrent, chunked) if state.dtype == torch.float32 else torch_kernels(state)


# -- each stage's workload ----------------------------------------------------------------------------
def kernel_tests(work: Path) -> None:
    """gpu_check.sh's `kernels` stage: the kernel test files."""
    import pytest

    files = ["tests/test_kernels.py", "tests/test_kernels_moe.py", "tests/test_kernels_attn_res.py",
             "tests/test_kernels_kda.py"]
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *(str(ROOT / f) for f in files)])
    if code not in (0, 1):  # failures are the shadows' business; a collection error is not
        raise RuntimeError(f"pytest exited {code} on the kernel test files")


def torch_qwen(work: Path) -> None:
    """tests/test_gpu.py's torch-backend tests: the Qwen3 pair in float32, greedy and sampled."""
    from dflash_batch.engine.engine import Engine
    from tests.test_gpu import load, outcomes, qwen_pair

    engine = Engine(*load(qwen_pair(work), "cpu"), device="cpu")
    outcomes(engine, 7)
    outcomes(engine, 9, temperature=1.0, top_p=0.9)


def qwen_bf16(work: Path) -> None:
    """tests/test_gpu.py's flashinfer engine tests: the Qwen3 pair in bfloat16 (flashinfer's own
    kernels are prebuilt apart), greedy, sampled and target-only."""
    from dflash_batch.engine.engine import Engine
    from tests.test_gpu import load, outcomes, qwen_pair

    engine = Engine(*load(qwen_pair(work), "cpu", torch.bfloat16), device="cpu", dtype=torch.bfloat16)
    outcomes(engine, 7, logprobs=2)
    outcomes(engine, 7)
    outcomes(engine, 9, temperature=1.0, top_p=0.9)
    outcomes(engine, 9, speculation=False, logprobs=2)


def torch_kimi(work: Path) -> None:
    """tests/test_gpu.py's Kimi-K3 tests: fla's chunked kernel at its test shapes, the tiny pair
    in float32 greedy, sampled and target-only."""
    from dflash_batch.kernels import kda
    from dflash_batch.engine.engine import Engine
    from tests.test_gpu import kimi_outcomes, kimi_pair, load

    for T in (1, 100, 1000):
        H, d = 4, 128
        q, k, v, g = (torch.randn(T, H, d) for _ in range(4))
        kda.chunked(q, k, v, g, torch.rand(T, H), torch.randn(H, d, d))
    engine = Engine(*load(kimi_pair(work / "kimi"), "cpu"), device="cpu")
    kimi_outcomes(engine)
    kimi_outcomes(engine, temperature=1.0, top_p=0.9)
    kimi_outcomes(engine, speculation=False)


def kimi_tp8(work: Path) -> None:
    """benchmarks/kimi_gpu_check.py's pair (one TP8 rank's widths) in bfloat16: a prefill, rounds
    with and without drafts. Only widths and dtypes reach the kernels (their row counts are not
    specialised), so two sequences of 64 tokens stand for its batches of 512."""
    from benchmarks import kimi_gpu_check as check
    from dflash_batch.engine.engine import Engine

    dirs = check.make_pair(work / "kimi_tp8", small=False)
    target, drafter = check.load_pair(dirs, torch.bfloat16, "cpu")
    engine = Engine(target, drafter, device="cpu", dtype=torch.bfloat16)
    vocab = target.vocab_size
    for speculation in (True, False):
        reqs = [check.Request((str(i), 0), p, check.SamplingParams(max_new_tokens=6, seed=i, logprobs=2))
                for i, p in enumerate(check.prompts(2, vocab, 64))]
        list(engine.generate(reqs, check.Bucket(0, "0-2048", 2048, 2, speculation, None)))


def qwen_tables(work: Path) -> None:
    """benchmarks/gpu_check.py's tables: its kernel comparison, rounds eager at two batch sizes,
    speculative and target-only (graphs and flashinfer change no Triton kernel)."""
    from benchmarks import gpu_check as table

    table.DEVICE = "cpu"
    table.kernel_errors()
    models = table.load_models(work)
    for batch in (1, 4):
        table.timed(table.engine(models, "torch", False, []), batch, True, new=4)
    table.timed(table.engine((models[0], None), "torch", False, []), 4, False, new=4)


# gpu_check.sh's stages that run Triton kernels, and what each runs (kimi_torch runs
# kimi_flashinfer's kernels: attention is torch's or flashinfer's, neither Triton).
WORKLOADS = {"torch_qwen": torch_qwen, "torch_kimi": torch_kimi, "flashinfer": qwen_bf16, "kimi_flashinfer": kimi_tp8,
             "kernels": kernel_tests, "tables": qwen_tables}


# -- launchers ----------------------------------------------------------------------------------------
def launcher_source(kernel) -> str:
    """The C source Triton's CudaLauncher builds for a kernel (its key in the cache)."""
    from triton.backends.nvidia.driver import make_launcher

    src = kernel.src
    index = lambda x: (src.fn.arg_names.index(x),) if isinstance(x, str) else x  # noqa: E731
    constants = {index(i): v for i, v in getattr(src, "constants", {}).items()}
    return make_launcher(constants, dict(src.signature), getattr(kernel.metadata, "tensordesc_meta", None))


def module_sources(kernels: list) -> dict[str, str]:
    """name -> C source of every module Triton compiles with gcc on the device: its driver's
    utilities and each kernel's launcher."""
    from triton.backends.nvidia import driver

    out = {"cuda_utils": Path(driver.dirname, "driver.c").read_text()}
    for source in {launcher_source(k) for k in kernels}:  # kernels of one signature share theirs
        out[f"__triton_launcher:{hashlib.sha256(source.encode()).hexdigest()[:16]}"] = source
    return out


def module_path(name: str, source: str) -> Path:
    """Where compile_module_from_src keeps a module built from `source`."""
    import sysconfig

    from triton.runtime.build import platform_key
    from triton.runtime.cache import _base32

    key = hashlib.sha256((source + platform_key()).encode()).hexdigest()
    return Path(CACHE_DIR, _base32(key), name.split(":")[0] + sysconfig.get_config_var("EXT_SUFFIX"))


def cuda_stub(sources: list[str], work: Path) -> Path:
    """A directory holding a libcuda.so.1 that defines every cu* function the sources name: linked
    against it, a module records libcuda.so.1 as needed (against an empty one the linker drops it,
    and the module would not load on the device); the device's driver provides the real one."""
    names = sorted(set(re.findall(r"\bcu[A-Z]\w*", "".join(sources))))
    (work / "stub.c").write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in names))
    subprocess.run(["cc", "-shared", "-fPIC", str(work / "stub.c"), "-Wl,-soname,libcuda.so.1", "-o",
                    str(work / "libcuda.so.1")], check=True)
    return work


def build_modules(sources: dict[str, str], work: Path) -> float:
    """Each module compiled into the cache (gcc, Python 3.12's headers) against cuda_stub."""
    from triton.backends.nvidia import driver
    from triton.runtime.build import compile_module_from_src

    stub = cuda_stub(list(sources.values()), work)
    os.environ["TRITON_LIBCUDA_PATH"] = str(stub)
    t0 = time.perf_counter()
    for name, source in sources.items():
        with contextlib.suppress(ImportError):  # built and cached; loading it needs the driver
            compile_module_from_src(src=source, name=name.split(":")[0], library_dirs=[driver.libdevice_dir, str(stub)],
                                    include_dirs=driver.include_dirs, libraries=driver.libraries)
    return time.perf_counter() - t0


LOAD = """
import importlib.util, sys
failed = []
for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[1].split(".")[0]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception as e:
        failed.append(f"{path}: {e}")
print("\\n".join(failed))
"""


def unloadable(sources: dict[str, str], work: Path) -> list[str]:
    """The carried C modules that do not load into this Python (the device's: 3.12) beside a
    libcuda.so.1 defining their cu* functions (cuda_stub), as the device's driver does: a module
    that does not name libcuda.so.1 as needed, a wrong Python ABI or a missing symbol shows here."""
    paths = [str(module_path(n, s)) for n, s in sources.items() if module_path(n, s).exists()]
    stub = cuda_stub(list(sources.values()), work)
    done = subprocess.run([sys.executable, "-c", LOAD, *paths], capture_output=True, text=True,
                          env={**os.environ, "LD_LIBRARY_PATH": str(stub)})
    return [line for line in (done.stdout + done.stderr).splitlines() if line]


# -- build and check ------------------------------------------------------------------------------
def prepare(strict: bool) -> Compiled:
    os.environ["TRITON_CACHE_DIR"] = CACHE_DIR
    os.environ["TRITON_STORE_BINARY_ONLY"] = "1"  # the cubin and its metadata: what a launch reads
    if strict:
        os.environ["TRITON_CACHE_MANAGER"] = "benchmarks.carried_cache:CarriedCache"
        os.environ[STRICT_ENV] = "1"
    emulate_h200()
    import fla

    wanted = (ROOT / "benchmarks" / "prepare_wheels.sh").read_text().split("fla-core==")[1].split()[0]
    if fla.__version__ != wanted:
        raise SystemExit(f"fla {fla.__version__} from {fla.__file__}, not the carried {wanted}: put the carried "
                         "wheels on PYTHONPATH (benchmarks/device_twin.sh does)")
    compiled = Compiled()
    compile_only(compiled)
    shadow_kernels()
    torch.manual_seed(0)
    return compiled


def run_workloads(compiled: Compiled, stages: list[str]) -> dict[str, float]:
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages:
            compiled.stage, t0 = stage, time.perf_counter()
            WORKLOADS[stage](Path(tmp) / stage)
            seconds[stage] = round(time.perf_counter() - t0, 1)
            print(f"{stage}: {len(compiled.kernels.get(stage, {}))} kernels in {seconds[stage]:.0f} s", flush=True)
    return seconds


def build(stages: list[str]) -> None:
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
    os.environ.pop("DFLASH_FLA_CONFIGS", None)  # the configs are chosen here, not read from the last build
    compiled = prepare(strict=False)
    chosen: dict[str, dict] = {}
    choose_fla_configs(chosen)
    t0 = time.perf_counter()
    seconds = run_workloads(compiled, stages)
    with tempfile.TemporaryDirectory() as tmp:
        sources = module_sources(list(compiled.binaries.values()))
        modules_s = build_modules(sources, Path(tmp))
    shutil.rmtree(OUT, ignore_errors=True)
    shutil.copytree(CACHE_DIR, OUT, ignore=shutil.ignore_patterns("lock", "tmp.*"))
    files = [p for p in OUT.rglob("*") if p.is_file()]
    manifest = dict(
        cache_dir=CACHE_DIR, **triton_identity(), fla=__import__("fla").__version__, sources=kernel_sources(),
        fla_configs={k: {f: v[f] for f in ("kwargs", "num_warps", "num_stages")} for k, v in sorted(chosen.items())},
        fla_configs_listed={k: v["listed"] for k, v in sorted(chosen.items())},
        build=dict(seconds=round(time.perf_counter() - t0), workload_seconds=seconds, modules=len(sources),
                   modules_seconds=round(modules_s), files=len(files),
                   mib=round(sum(p.stat().st_size for p in files) / 2**20, 1)),
        stages={s: sorted(rows.values(), key=lambda r: (r["module"], r["kernel"]))
                for s, rows in compiled.kernels.items()})
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    b = manifest["build"]
    print(f"{len(compiled.binaries)} kernels and {b['modules']} C modules ({b['modules_seconds']} s of gcc) in "
          f"{b['seconds']} s; {OUT.name}/: {b['files']} files, {b['mib']} MiB; manifest {MANIFEST.relative_to(ROOT)}")


def check(stages: list[str]) -> int:
    """Each stage's workload from the carried cache, compiling forbidden: the kernels it needs
    that are missing, and the launcher modules missing, named."""
    manifest = json.loads(MANIFEST.read_text())
    if not OUT.is_dir():
        print(f"no {OUT.name}/: build it (python benchmarks/triton_cache.py build)")
        return 1
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
    shutil.copytree(OUT, CACHE_DIR)
    os.environ["DFLASH_FLA_CONFIGS"] = str(MANIFEST)
    compiled = prepare(strict=True)
    refuse_autotuning(compiled)
    identity = triton_identity()
    differs = [f"{k}: built {manifest[k]!r}, here {v!r}" for k, v in identity.items() if manifest[k] != v]
    run_workloads(compiled, stages)
    launchers = module_sources(list(compiled.binaries.values()))
    lacking = sorted({n.split(":")[0] for n, s in launchers.items() if not module_path(n, s).exists()})
    with tempfile.TemporaryDirectory() as tmp:
        failing = unloadable(launchers, Path(tmp))
    print(f"| stage | kernels from the cache | missing |\n|---|---|---|")
    for stage in stages:
        missing = sorted(compiled.missing.get(stage, ()))
        print(f"| {stage} | {len(compiled.kernels.get(stage, {}))} | {len(missing)} {' '.join(missing)} |")
    print(f"C modules: {len(launchers) - len(lacking)} of {len(launchers)} carried, "
          f"{len(launchers) - len(lacking) - len(failing)} load into Python {sys.version.split()[0]} against a stub "
          "libcuda.so.1" + (f"; missing {lacking}" if lacking else "") + "".join(f"\n  not loaded: {f}" for f in failing))
    for line in differs:
        print(f"Triton differs from the build's: {line}")
    return 1 if differs or lacking or failing or any(compiled.missing.values()) else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["build", "check"])
    ap.add_argument("stages", nargs="*", default=list(WORKLOADS), metavar="STAGE", help=", ".join(WORKLOADS))
    a = ap.parse_args()
    if unknown := set(a.stages) - set(WORKLOADS):
        ap.error(f"unknown stages {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    if a.action == "build":
        build(a.stages)
    else:
        sys.exit(check(a.stages))


if __name__ == "__main__":
    main()
