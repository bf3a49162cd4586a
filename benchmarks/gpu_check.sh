#!/usr/bin/env bash
# The GPU check, on a machine with one GPU and no package registry (Python 3.12, CUDA torch,
# Triton, nvcc), from the repository root with .whl/ carried (benchmarks/prepare_wheels.sh
# fills it). Each stage has its own timeout and prints one JSON line, so a failing stage does
# not hide the rest; the tables come last. Under 8 minutes.
#   bash benchmarks/gpu_check.sh [OUT_DIR]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=$(nproc) FLASHINFER_WORKSPACE_BASE=$OUT/flashinfer
unset TRITON_INTERPRET

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "{\"stage\": \"$name\", \"rc\": $?, \"seconds\": $((SECONDS - t0))}"
  tail -n 4 "$OUT/$name.log" | sed 's/^/    /'
}

stage install 45 python -m pip install -q --no-index --no-deps .whl/*.whl
# flashinfer compiles its kernels at first use (minutes): compile them in the background while
# the Triton kernels are checked against their torch references.
(stage warmup 200 python benchmarks/flashinfer_warmup.py > "$OUT/warmup.json") &
stage kernels 150 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_moe.py tests/test_kernels_attn_res.py tests/test_kernels_kda.py
wait
cat "$OUT/warmup.json"
stage gpu_tests 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
stage table_torch 60 python benchmarks/gpu_check.py --backend torch --out "$OUT/table_torch.json"
stage table_flashinfer 60 python benchmarks/gpu_check.py --backend flashinfer --out "$OUT/table_flashinfer.json"
for table in table_torch table_flashinfer; do
  echo "== $table"
  sed -n '/^| kernel/,$p' "$OUT/$table.log"
done
