#!/usr/bin/env bash
# The GPU check: one device command whose first list decides whether the GPU path holds. Runs from
# the repository root on a machine with a GPU and no package registry (the device: Python 3.12,
# CUDA torch 2.11, Triton 3.6, nvcc), with .whl/ (benchmarks/prepare_wheels.sh), .flashinfer_aot/
# (benchmarks/prebuild_flashinfer.py build) and .triton_cache/ (benchmarks/triton_cache.py build)
# carried beside the tracked tree: nothing is compiled on the device.
#
#   bash benchmarks/gpu_check.sh [--plan] [OUT_DIR]
#
# The first list (limits summing to at most FIRST=420 s) holds what decides "GPU works", in order of
# evidence: the torch backend on the GPU against the CPU's oracle for both families (it shares the
# CPU's code, so a failure there is the GPU's), flashinfer GQA and MLA against the torch backend,
# CUDA graphs == eager and speculative greedy == target-only greedy under graphs for both families
# (every test of tests/test_gpu.py is selected by one of its stages: tests/test_gpu_check_plan.py),
# then the Kimi-K3 pair at one TP8 rank's widths with its round table. The stages after it run only
# while the command is inside DEADLINE (default 480 s: a device call of timeout_s 500 after a start
# of about 3 minutes leaves about 4 of the 15 for one short rerun on the warm machine).
#
# Every stage writes its numbers to OUT_DIR/STAGE.json as each section ends (pytest stages: one
# line per test as it finishes; the Kimi-K3 stage: its criteria) and prints one JSON line: a
# verdict read from those numbers (a stage whose tests did not all pass, or whose criteria are not
# all met, fails whatever its exit code), its seconds against its limit, and the Triton kernels it
# found missing from the carried cache (each also named on stderr the moment it is missed).
# --plan prints the lists, limits and criteria (and, where pytest runs, the tests each stage selects)
# and exits; ONLY="STAGE..." runs those stages alone (benchmarks/device_twin.sh runs install and
# preflight on a CPU machine).
set -u
cd "$(dirname "$0")/.."
PLAN_ONLY=0
[[ ${1:-} == --plan ]] && { PLAN_ONLY=1; shift; }
OUT=${1:-${OUT:-/tmp/gpu_check}}
FIRST=420
DEADLINE=${DEADLINE:-480}
SITE=${SITE:-/tmp/gpu_check_site}   # the carried wheels go here, never into the image's site-packages
PY=${PYTHON:-python3}  # the image's python3 holds torch (a plain `python` may be absent)
TRITON_CACHE=/tmp/dflash_triton_cache  # benchmarks/carried_cache.py CACHE_DIR: where it was built
GPU_TEST="$PY -m pytest -q -p no:cacheprovider -m gpu --timeout 100 tests/test_gpu.py"

# The plan: NAME LIMIT LIST CRITERION COMMAND. LIST: first (sums to <= FIRST) or then (while time
# is left). A stage whose name starts with "&" runs beside the others (Kimi-K3's 3 GB of
# checkpoints are written while tests run); the stage that needs it waits for it, and the plan
# counts that wait.
STAGES=()
add() { STAGES+=("$1|$2|$3|$4|$5"); }
# flashinfer loads a module from its package's data/aot/ before it would compile one (jit/env.py,
# jit/core.py); Triton reads the carried cache at the absolute path it was built at.
add install 15 first "the carried wheels install into $SITE, nothing of the image replaced; prebuilt flashinfer modules beside flashinfer; the Triton cache at $TRITON_CACHE" \
  "$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE .whl/*.whl \
   && mkdir -p $SITE/flashinfer/data/aot && cp -r .flashinfer_aot/*/ $SITE/flashinfer/data/aot/ \
   && rm -rf $TRITON_CACHE && cp -r .triton_cache $TRITON_CACHE"
add preflight 30 first "a GPU, CUDA_HOME with nvcc, libcudart; Triton's build, backend and environment those the cache was built with; every flashinfer module loads prebuilt, JIT disabled" \
  "$PY benchmarks/gpu_preflight.py ${PREFLIGHT_ARGS:-}; rc=\$?; $PY benchmarks/prebuild_flashinfer.py check && exit \$rc"
add "&kimi_checkpoints" 200 first "the Kimi-K3 pair's checkpoints written (beside the tests)" \
  "$PY benchmarks/kimi_gpu_check.py --dir /tmp/kimi_pair --make-only"
add torch_qwen 50 first "Qwen3 pair, torch backend: GPU tokens == CPU tokens; graphs == eager, greedy and sampled (TP2 and PP2 over NCCL too where there are two GPUs, PP2 captured and in two lanes)" \
  "$GPU_TEST -k 'torch_backend or tp2 or pp2'"
add torch_kimi 90 first "Kimi-K3 pair (fla KDA, Triton MoE and AttnRes): fla chunked == fp64 within the TF32 bound; GPU == CPU tokens; graphs == eager; spec greedy == target greedy under graphs (and where there are two GPUs: two data-parallel groups with the experts over both, dispatched over NCCL, == one GPU)" \
  "$GPU_TEST -k 'kimi or kda'"
add flashinfer 80 first "flashinfer GQA and MLA == torch backend on the same caches; the latent split's halves merged by their log-sum-exps == the whole cache under a graph; engine == torch engine; graphs == eager; spec greedy == target greedy under graphs" \
  "FLASHINFER_DISABLE_JIT=1 $GPU_TEST -k flashinfer"
add kimi_flashinfer 130 first "Kimi-K3 at TP8 widths, flashinfer: prefill logits within 5e-2 of the CPU's fp32 (bf16); graph == eager and spec greedy == target-only on every sequence (peaked head); round-time table" \
  "FLASHINFER_DISABLE_JIT=1 $PY benchmarks/kimi_gpu_check.py --backend flashinfer --dir /tmp/kimi_pair --out $OUT/kimi_flashinfer.json"
add kernels 60 then "every Triton kernel == its torch reference on the GPU" \
  "$PY -m pytest -q -p no:cacheprovider --timeout 60 tests/test_kernels.py tests/test_kernels_moe.py tests/test_kernels_attn_res.py tests/test_kernels_kda.py"
add table_torch 60 then "Qwen3 table, torch backend: kernels vs torch; graph == eager per batch" \
  "$PY benchmarks/gpu_check.py --backend torch --out $OUT/table_torch.json"
add table_flashinfer 60 then "Qwen3 table, flashinfer backend" \
  "FLASHINFER_DISABLE_JIT=1 $PY benchmarks/gpu_check.py --backend flashinfer --out $OUT/table_flashinfer.json"
add kimi_torch 130 then "Kimi-K3 at TP8 widths, torch backend: as kimi_flashinfer" \
  "$PY benchmarks/kimi_gpu_check.py --backend torch --dir /tmp/kimi_pair --out $OUT/kimi_torch.json"
add kimi_schedule 200 then "Kimi-K3 at TP8 widths, flashinfer, graphs: a round's ms at batch 1/4/16/64 for k = 0..7 drafts verified; the k auto picks at the card's acceptance (ONLY=kimi_schedule: a command of its own; its verify widths 2-7 are not in the Triton cache)" \
  "FLASHINFER_DISABLE_JIT=1 $PY benchmarks/kimi_gpu_check.py --schedule --backend flashinfer --dir /tmp/kimi_pair --out $OUT/kimi_schedule.json"

# Wall time of the first list: its limits in order; a stage beside the others ends at its start +
# limit, and the first stage that needs it (kimi_*) starts no earlier.
total=0; beside_end=0
echo "== plan: limits in seconds; the first list must fit $FIRST s, the rest runs while the command is inside $DEADLINE s"
printf '%-18s %5s %6s  %s\n' stage limit by criterion
for s in "${STAGES[@]}"; do
  IFS='|' read -r name limit list criterion _ <<< "$s"
  if [[ $list == then ]]; then
    printf '%-18s %5s %6s  %s\n' "$name" "$limit" "then" "$criterion"; continue
  fi
  if [[ $name == '&'* ]]; then
    (( total + limit > beside_end )) && beside_end=$((total + limit))
  else
    [[ $name == kimi_* ]] && (( beside_end > total )) && total=$beside_end
    total=$((total + limit))
  fi
  printf '%-18s %5s %6s  %s\n' "$name" "$limit" "$total" "$criterion"
done
echo "== first list: $total s of $FIRST"
if (( total > FIRST )); then
  echo "refused: the first list needs $total s, more than $FIRST s" >&2
  exit 2
fi
if (( PLAN_ONLY )); then
  # What each pytest stage selects (collected on this machine, not run): tests/test_gpu_check_plan.py
  # reads these lines and proves every test of tests/test_gpu.py is selected by the first list.
  for s in "${STAGES[@]}"; do
    IFS='|' read -r name _ list _ cmd <<< "$s"
    [[ $cmd == *"-m pytest"* ]] || continue
    echo "== selects $name ($list): $cmd"
    [[ ${PLAN_COUNTS:-1} == 1 ]] || continue
    # (--timeout is pytest-timeout's, which a CPU machine may lack; collecting needs no limit)
    echo "   $(bash -c "$(sed -E 's/--timeout [0-9]+ //' <<< "$cmd") --collect-only" 2>&1 \
      | grep -E "tests? (collected|deselected)|rror" | tail -n 1)"
  done
  exit 0
fi

mkdir -p "$OUT"
export PYTHONPATH=$PWD:$SITE FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_jit
# The carried Triton cache, read where it was built; a kernel missing from it is named at once.
export TRITON_CACHE_DIR=$TRITON_CACHE TRITON_CACHE_MANAGER=benchmarks.carried_cache:CarriedCache \
  DFLASH_TRITON_MISSES=$OUT/triton_misses.txt DFLASH_FLA_CONFIGS=$PWD/benchmarks/triton_cache.json
unset TRITON_INTERPRET
: > "$OUT/triton_misses.txt"
# flashinfer finds the toolkit through CUDA_HOME, else through `which nvcc`, which may be a wrapper
# script outside the toolkit (then it links against a directory without libcudart).
if [[ -z ${CUDA_HOME:-} ]]; then
  for d in /usr/local/cuda /usr/local/cuda-*; do [[ -x $d/bin/nvcc ]] && { export CUDA_HOME=$d; break; }; done
fi

run_stage() {  # run_stage NAME LIMIT CRITERION COMMAND
  local name=$1 limit=$2 criterion=$3 t0=$SECONDS rc misses
  misses=$(wc -l < "$OUT/triton_misses.txt")
  rm -f "$OUT/$name.json"
  DFLASH_TEST_REPORT=$OUT/$name.json timeout "$limit" bash -c "$4" > "$OUT/$name.log" 2>&1
  rc=$?
  $PY benchmarks/gpu_check_verdict.py "$name" "$rc" "$((SECONDS - t0))" "$limit" "$criterion" "$OUT" "$misses"
  tail -n 4 "$OUT/$name.log" | sed 's/^/    /'
}

beside=""
for s in "${STAGES[@]}"; do
  IFS='|' read -r name limit list criterion cmd <<< "$s"
  [[ -n ${ONLY:-} && " $ONLY " != *" ${name#&} "* ]] && continue
  if [[ $list == then ]] && (( SECONDS + limit > DEADLINE )); then
    echo "{\"stage\": \"$name\", \"verdict\": \"NOT RUN\", \"why\": \"$SECONDS s + its $limit s would pass the $DEADLINE s deadline\"}"
    continue
  fi
  if [[ $name == '&'* ]]; then
    name=${name#&}
    (run_stage "$name" "$limit" "$criterion" "$cmd" > "$OUT/$name.verdict") &
    beside="$beside $name"
    continue
  fi
  if [[ $name == kimi_* && -n $beside ]]; then
    wait
    for b in $beside; do cat "$OUT/$b.verdict"; done
    beside=""
  fi
  run_stage "$name" "$limit" "$criterion" "$cmd"
done
wait
table() { [[ -f $OUT/$1.log ]] && { echo "== $1"; sed -n "/^| $2/,\$p" "$OUT/$1.log"; }; }
table table_torch kernel; table table_flashinfer kernel
table kimi_flashinfer batch; table kimi_torch batch
exit 0
