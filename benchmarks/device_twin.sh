#!/usr/bin/env bash
# The device twin: the device's Python side rebuilt on a CPU machine, and every stage of the GPU
# check that needs no GPU run in it, before a change to the GPU path is called ready (not in CI:
# the CUDA wheels are 4 GB).
#   - a throwaway Python 3.12 venv with CUDA torch 2.11 and Triton 3.6 from the package registry,
#     and the image's other packages that the check imports (never flashinfer, fla or dflash);
#   - the carried tree measured against the device call's 64 MiB (tracked files, .whl/, .flashinfer_aot/,
#     .triton_cache/);
#   - gpu_check.sh's install and preflight stages as the device runs them (--no-index, --target),
#     the venv's own packages compared before and after (the install must not touch them);
#   - every module of dflash_batch (dflash_batch.kernels included) imported, with flashinfer, fla and tvm_ffi;
#   - `pytest --collect-only -m gpu tests/test_gpu.py`;
#   - the prebuilt flashinfer modules loaded with JIT disabled (the preflight's second half);
#   - each stage's Triton kernels (benchmarks/triton_cache.py check) from the carried cache, with
#     compiling forbidden: every kernel and launcher there, none missing;
#   - the plan: one first list within 420 s.
# Fills .whl/ (benchmarks/prepare_wheels.sh), .flashinfer_aot/ (benchmarks/prebuild_flashinfer.py
# build: about 25 minutes of nvcc on 2 cores) and .triton_cache/ (benchmarks/triton_cache.py build:
# 1 to 20 minutes on 2 cores, as loaded) where they are absent; all three are kept for the device call.
#   bash benchmarks/device_twin.sh [TWIN_DIR]     (default /tmp/dflash_twin; the venv is kept there)
set -uo pipefail
cd "$(dirname "$0")/.."
TWIN=${1:-/tmp/dflash_twin}
OUT=$TWIN/out
rm -rf "$OUT" "$TWIN/site" "$TWIN/build_site" && mkdir -p "$OUT"
fail=0
row() { printf '| %-34s | %-6s | %s |\n' "$1" "$2" "$3" >> "$OUT/summary.md"; [[ $2 == ok ]] || fail=1; }
printf '| step | result | detail |\n|---|---|---|\n' > "$OUT/summary.md"

py312=  # the first that runs: a pyenv shim is on PATH even where its version is not selected
for candidate in $(command -v python3.12) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  "$candidate" -c pass 2> /dev/null && { py312=$candidate; break; }
done
[[ -n $py312 ]] || { echo "no Python 3.12 here (the device's): install one (pyenv, apt python3.12)" >&2; exit 1; }
PY=$TWIN/venv/bin/python3
if [[ ! -x $PY ]]; then
  t0=$SECONDS
  "$py312" -m venv "$TWIN/venv" || exit 1
  "$PY" -m pip install -q torch==2.11.0 triton==3.6.0 numpy scipy pytest pytest-timeout hypothesis click einops ninja \
    nvidia-ml-py packaging requests tabulate tqdm safetensors pyarrow pyyaml tokenizers tiktoken jinja2 matplotlib \
    typing-extensions filelock 2> >(grep -v "is ignored: it is neither" >&2) || exit 1
  echo "venv built in $((SECONDS - t0)) s"
fi
row "python, torch, triton" ok "$("$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)' 2>/dev/null)"

[[ -d .whl ]] || bash benchmarks/prepare_wheels.sh > /dev/null
if [[ ! -f .flashinfer_aot/manifest.json ]]; then  # built once (kept, git-ignored): the venv's flashinfer, nvcc
  echo "building flashinfer's modules into .flashinfer_aot/ (nvcc: about 25 minutes on 2 cores)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$TWIN/build_site" .whl/*.whl
  PATH=$TWIN/venv/bin:$PATH PYTHONPATH=$TWIN/build_site "$PY" benchmarks/prebuild_flashinfer.py build || exit 1
fi
if [[ ! -d .triton_cache ]]; then  # built once (kept, git-ignored): this venv's Triton, the carried fla
  echo "building the Triton cache into .triton_cache/ (1 to 20 minutes on 2 cores, as loaded)"
  rm -rf "$TWIN/build_site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$TWIN/build_site" .whl/*.whl
  PYTHONPATH=$TWIN/build_site "$PY" benchmarks/triton_cache.py build || exit 1
fi
carried=$({ git ls-files -z | du -cb --files0-from=- | tail -n 1; du -cb .whl .flashinfer_aot .triton_cache | tail -n 1; } | awk '{s += $1} END {printf "%.1f", s / 2^20}')
awk -v c="$carried" 'BEGIN {exit !(c <= 64)}' && r=ok || r=FAIL
row "carried (tree + .whl + prebuilt)" $r "$carried MiB of 64 ($(ls .whl | wc -l) wheels $(du -sm .whl | cut -f1) MiB, $(ls -d .flashinfer_aot/*/ | wc -l) flashinfer modules $(du -sm .flashinfer_aot | cut -f1) MiB, Triton cache $(du -sm .triton_cache | cut -f1) MiB)"

"$PY" -m pip freeze > "$OUT/before.txt"
PATH=$TWIN/venv/bin:$PATH SITE=$TWIN/site ONLY="install preflight" PREFLIGHT_ARGS=--no-gpu \
  bash benchmarks/gpu_check.sh "$OUT" > "$OUT/stages.txt" 2>&1
"$PY" -m pip freeze > "$OUT/after.txt"
for stage in install preflight; do
  line=$(grep "\"stage\": \"$stage\"" "$OUT/stages.txt")
  [[ $line == *'"verdict": "pass"'* ]] && r=ok || r=FAIL
  row "gpu_check.sh stage $stage" $r "$(sed -E 's/.*"seconds": ([0-9]+).*/\1 s/' <<< "$line")"
done
cmp -s "$OUT/before.txt" "$OUT/after.txt" && r=ok || r=FAIL
row "image's packages untouched" $r "$(wc -l < "$OUT/before.txt") packages before and after"
row "prebuilt modules" "$(grep -q 'NOT LOADED' "$OUT/preflight.log" && echo FAIL || echo ok)" \
  "$(grep -c 'loaded prebuilt' "$OUT/preflight.log") loaded with FLASHINFER_DISABLE_JIT=1, none compiled"
grep -o '"cuda_home": "[^"]*", "nvcc_version": "[^"]*", "libcudart": "[^"]*"' "$OUT/preflight.log" | sed 's/^/    /'

export PYTHONPATH=$PWD:$TWIN/site FLASHINFER_CUDA_ARCH_LIST=9.0a
"$PY" - > "$OUT/imports.txt" 2>&1 <<'EOF'
import importlib, pkgutil
import dflash_batch, dflash_batch.kernels  # the kernels: a namespace package walk_packages does not enter
names = ["flashinfer", "fla", "tvm_ffi", "flashinfer.mla"]
for package in (dflash_batch, dflash_batch.kernels):
    names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(len(names) - len(failed), "of", len(names), "modules imported")
print("\n".join(failed))
raise SystemExit(1 if failed else 0)
EOF
r=$([[ $? == 0 ]] && echo ok || echo FAIL)
row "imports" $r "$(head -n 1 "$OUT/imports.txt")"

"$PY" -m pytest --collect-only -q -p no:cacheprovider -m gpu tests/test_gpu.py > "$OUT/collect.txt" 2>&1
r=$([[ $? == 0 ]] && echo ok || echo FAIL)
row "pytest --collect-only -m gpu" $r "$(tail -n 1 "$OUT/collect.txt")"

# Every stage's Triton kernels against the carried cache, compiling forbidden (a kernel or launcher
# that is not there is refused and named).
"$PY" benchmarks/triton_cache.py check > "$OUT/triton_check.txt" 2>&1
r=$?
grep '^| ' "$OUT/triton_check.txt" | tail -n +2 | while IFS='|' read -r _ stage found missing _; do
  printf '| %-34s | %-6s | %s |\n' "Triton cache: stage${stage% }" "$([[ ${missing// /} == 0 ]] && echo ok || echo FAIL)" \
    "$((found)) kernels from the cache, compiling forbidden; missing: $(xargs <<< "$missing")" >> "$OUT/summary.md"
done
row "Triton cache: launchers, Triton" "$([[ $r == 0 ]] && echo ok || echo FAIL)" "$(grep '^C modules' "$OUT/triton_check.txt")$(grep -h '^Triton differs' "$OUT/triton_check.txt" | tr '\n' ' ')"

PATH=$TWIN/venv/bin:$PATH bash benchmarks/gpu_check.sh --plan "$OUT" > "$OUT/plan.txt" 2>&1
r=$([[ $? == 0 ]] && echo ok || echo FAIL)
row "plan: the first list" $r "$(grep '^== first list' "$OUT/plan.txt" | sed 's/== first list: //'), $(grep -c '(first)' "$OUT/plan.txt") pytest stages (tests/test_gpu_check_plan.py: they select every test of tests/test_gpu.py)"

cat "$OUT/plan.txt"
echo
cat "$OUT/summary.md"
exit $fail
