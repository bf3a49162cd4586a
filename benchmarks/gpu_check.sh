#!/usr/bin/env bash
# The GPU check, on a machine with one GPU and no package registry (Python 3.12, CUDA torch,
# Triton, nvcc), from the repository root with .whl/ carried (benchmarks/prepare_wheels.sh
# fills it). Each stage has its own timeout and prints one JSON line, so a failing stage does
# not hide the rest; the tables come last. Parts (default: core kimi, under 10 minutes, one
# device command; qwen adds 2):
#   core   kernels/ against their torch references, tests/test_gpu.py (both families)
#   qwen   the Qwen3 table (benchmarks/gpu_check.py, torch and flashinfer backends)
#   kimi   the Kimi-K3 table at one TP8 rank's widths (benchmarks/kimi_gpu_check.py, flashinfer)
#   kimi_torch   the same on the torch backend
#   bash benchmarks/gpu_check.sh [OUT_DIR [PART...]]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/gpu_check}}
shift || true
PARTS=" ${*:-core kimi} "
mkdir -p "$OUT"
# flashinfer's JIT build tree stays off OUT_DIR (what the device tool brings back).
export PYTHONPATH=$PWD FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=$(nproc) FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_jit
unset TRITON_INTERPRET

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "{\"stage\": \"$name\", \"rc\": $?, \"seconds\": $((SECONDS - t0))}"
  tail -n 4 "$OUT/$name.log" | sed 's/^/    /'
}
want() { [[ "$PARTS" == *" $1 "* ]]; }
table() { echo "== $1"; sed -n "/^| $2/,\$p" "$OUT/$1.log"; }

stage install 45 python -m pip install -q --no-index --no-deps .whl/*.whl
# flashinfer compiles its kernels at first use (minutes): compile them in the background while
# the Triton kernels are checked against their torch references (and the Kimi-K3 checkpoints,
# 3 GB of random weights, are written).
(stage warmup 200 python benchmarks/flashinfer_warmup.py > "$OUT/warmup.json") &
if want kimi || want kimi_torch; then
  (stage kimi_checkpoints 200 python benchmarks/kimi_gpu_check.py --dir /tmp/kimi_pair --make-only \
    > "$OUT/kimi_checkpoints.json") &
fi
if want core; then
  stage kernels 150 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_moe.py \
    tests/test_kernels_attn_res.py tests/test_kernels_kda.py
fi
wait
cat "$OUT/warmup.json" "$OUT"/kimi_checkpoints.json 2>/dev/null
want core && stage gpu_tests 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
if want qwen; then
  stage table_torch 60 python benchmarks/gpu_check.py --backend torch --out "$OUT/table_torch.json"
  stage table_flashinfer 60 python benchmarks/gpu_check.py --backend flashinfer --out "$OUT/table_flashinfer.json"
fi
# Kimi-K3 at one TP8 rank's widths; the backends share one pair of checkpoints (written once).
want kimi && stage kimi_flashinfer 180 python benchmarks/kimi_gpu_check.py --backend flashinfer --dir /tmp/kimi_pair \
  --out "$OUT/kimi_flashinfer.json"
want kimi_torch && stage kimi_torch 180 python benchmarks/kimi_gpu_check.py --backend torch --dir /tmp/kimi_pair \
  --out "$OUT/kimi_torch.json"
if want qwen; then table table_torch kernel; table table_flashinfer kernel; fi
want kimi && table kimi_flashinfer batch
want kimi_torch && table kimi_torch batch
exit 0
