#!/usr/bin/env bash
# The GPU check: one device command that decides whether the GPU path holds. Runs from the
# repository root on a machine with a GPU and no package registry (the device: Python 3.12, CUDA
# torch 2.11, Triton 3.6, nvcc), with .whl/ (benchmarks/prepare_wheels.sh) and .flashinfer_aot/
# (benchmarks/prebuild_flashinfer.py build) carried beside the tracked tree.
#
#   bash benchmarks/gpu_check.sh [--plan] [OUT_DIR] [PART...]
#
# Parts: the default list (core kimi) fits one 540 s command; the second list (qwen kimi_torch tp2)
# is the next command's. Any list whose stage limits sum past 540 s is refused before it starts.
#   core        the GPU path against the CPU's oracles (tests/test_gpu.py, kernels/ tests)
#   kimi        the Kimi-K3 pair at one TP8 rank's widths, flashinfer backend (benchmarks/kimi_gpu_check.py)
#   qwen        the Qwen3 tables (benchmarks/gpu_check.py, torch and flashinfer backends)
#   kimi_torch  the Kimi-K3 table on the torch backend
#   tp2         TP2 over NCCL == TP1 (needs two GPUs; skipped with one)
#   schedule    the speculation schedule's round costs for the Kimi-K3 pair at TP8 widths (a list of its own)
# Stages run in order of evidence: the torch backend on the GPU first (it shares the CPU's code,
# so a failure there is the GPU's), then flashinfer, the tables last. Each prints one JSON line
# (its pass criterion, rc, seconds) and the tail of its log; logs are in OUT_DIR.
# --plan prints the stages, limits and criteria and exits; ONLY="STAGE..." runs those stages alone
# (benchmarks/device_twin.sh runs the plan, install and preflight on a CPU machine).
set -u
cd "$(dirname "$0")/.."
PLAN_ONLY=0
[[ ${1:-} == --plan ]] && { PLAN_ONLY=1; shift; }
OUT=${1:-${OUT:-/tmp/gpu_check}}
shift || true
PARTS=" ${*:-core kimi} "
BUDGET=540
SITE=${SITE:-/tmp/gpu_check_site}   # the carried wheels go here, never into the image's site-packages
PY=${PYTHON:-python3}  # the image's python3 holds torch (a plain `python` may be absent)
want() { [[ "$PARTS" == *" $1 "* ]]; }
GPU_TEST="$PY -m pytest -q -p no:cacheprovider -m gpu --timeout 100 tests/test_gpu.py"

# The plan: NAME LIMIT PART CRITERION COMMAND (PART "-": every list). A stage whose name starts
# with "&" runs beside the others (Kimi-K3's 3 GB of checkpoints are written while tests run);
# the stage that needs it waits for it, and the plan counts that wait.
STAGES=()
add() {  # add NAME LIMIT PARTS CRITERION COMMAND (PARTS: comma-separated, or - for every list)
  local p
  for p in ${3//,/ }; do
    if [[ $p == - ]] || want "$p"; then STAGES+=("$1|$2|$4|$5"); return; fi
  done
}
# flashinfer loads a module from its package's data/aot/ before it would compile one (jit/env.py, jit/core.py).
add install 20 - "the carried wheels install into $SITE, nothing of the image replaced; prebuilt modules beside flashinfer" \
  "$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE .whl/*.whl \
   && mkdir -p $SITE/flashinfer/data/aot && cp -r .flashinfer_aot/*/ $SITE/flashinfer/data/aot/"
add preflight 30 - "a GPU, CUDA_HOME with nvcc, libcudart; every flashinfer module loads prebuilt, JIT disabled" \
  "$PY benchmarks/gpu_preflight.py ${PREFLIGHT_ARGS:-}; rc=\$?; $PY benchmarks/prebuild_flashinfer.py check && exit \$rc"
add "&kimi_checkpoints" 200 kimi,kimi_torch,schedule "the Kimi-K3 pair's checkpoints written" \
  "$PY benchmarks/kimi_gpu_check.py --dir /tmp/kimi_pair --make-only"
add torch_qwen 60 core "Qwen3 pair, torch backend: GPU tokens == CPU tokens; graphs == eager, greedy and sampled" \
  "$GPU_TEST -k 'torch_backend'"
add kernels 60 core "every Triton kernel == its torch reference on the GPU" \
  "$PY -m pytest -q -p no:cacheprovider --timeout 60 tests/test_kernels.py tests/test_kernels_moe.py tests/test_kernels_attn_res.py tests/test_kernels_kda.py"
add torch_kimi 120 core "Kimi-K3 pair (fla KDA, Triton MoE and AttnRes): fla chunked == fp64; GPU == CPU; graphs == eager; spec greedy == target greedy under graphs" \
  "$GPU_TEST -k 'kimi or kda'"
add flashinfer 90 core "flashinfer GQA and MLA == torch backend on the same caches; engine == torch engine; graphs == eager; spec == target under graphs" \
  "FLASHINFER_DISABLE_JIT=1 $GPU_TEST -k flashinfer"
add kimi_flashinfer 150 kimi "Kimi-K3 at TP8 widths, flashinfer: logits within bound of the CPU's fp32; graph == eager; spec == target; round-time table" \
  "FLASHINFER_DISABLE_JIT=1 $PY benchmarks/kimi_gpu_check.py --backend flashinfer --dir /tmp/kimi_pair --out $OUT/kimi_flashinfer.json"
add table_torch 60 qwen "Qwen3 table, torch backend: kernels vs torch; graph == eager per batch" \
  "$PY benchmarks/gpu_check.py --backend torch --out $OUT/table_torch.json"
add table_flashinfer 60 qwen "Qwen3 table, flashinfer backend" \
  "FLASHINFER_DISABLE_JIT=1 $PY benchmarks/gpu_check.py --backend flashinfer --out $OUT/table_flashinfer.json"
add kimi_torch 150 kimi_torch "Kimi-K3 at TP8 widths, torch backend: as kimi_flashinfer" \
  "$PY benchmarks/kimi_gpu_check.py --backend torch --dir /tmp/kimi_pair --out $OUT/kimi_torch.json"
add kimi_schedule 200 schedule "Kimi-K3 at TP8 widths, flashinfer, graphs: a round's ms at batch 1/4/16/64 for k = 0..7 drafts verified; the k auto picks at the card's acceptance" \
  "FLASHINFER_DISABLE_JIT=1 $PY benchmarks/kimi_gpu_check.py --schedule --backend flashinfer --dir /tmp/kimi_pair --out $OUT/kimi_schedule.json"
add tp2 120 tp2 "TP2 over NCCL: the same tokens and accepted drafts as TP1, greedy and sampled, graphs on" \
  "$GPU_TEST -k tp2"

# Total wall time: foreground limits in order; a stage beside the others ends at its start + limit,
# and the first foreground stage that needs it (kimi_*) starts no earlier.
total=0; beside_end=0
echo "== plan: parts${PARTS% }, limits in seconds"
printf '%-18s %5s %6s  %s\n' stage limit by criterion
for s in "${STAGES[@]}"; do
  IFS='|' read -r name limit criterion _ <<< "$s"
  if [[ $name == '&'* ]]; then
    (( total + limit > beside_end )) && beside_end=$((total + limit))
  else
    [[ $name == kimi_* ]] && (( beside_end > total )) && total=$beside_end
    total=$((total + limit))
  fi
  printf '%-18s %5s %6s  %s\n' "$name" "$limit" "$total" "$criterion"
done
echo "== total $total s of $BUDGET"
if (( total > BUDGET )); then
  echo "refused: these parts need $total s, more than one command's $BUDGET s; split them" >&2
  exit 2
fi
(( PLAN_ONLY )) && exit 0

mkdir -p "$OUT"
export PYTHONPATH=$PWD:$SITE FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_jit
unset TRITON_INTERPRET
# flashinfer finds the toolkit through CUDA_HOME, else through `which nvcc`, which may be a wrapper
# script outside the toolkit (then it links against a directory without libcudart).
if [[ -z ${CUDA_HOME:-} ]]; then
  for d in /usr/local/cuda /usr/local/cuda-*; do [[ -x $d/bin/nvcc ]] && { export CUDA_HOME=$d; break; }; done
fi

run_stage() {  # run_stage NAME LIMIT CRITERION COMMAND
  local name=$1 limit=$2 criterion=$3 t0=$SECONDS rc
  timeout "$limit" bash -c "$4" > "$OUT/$name.log" 2>&1
  rc=$?
  $PY - "$name" "$rc" "$((SECONDS - t0))" "$criterion" "$OUT/$name.log" <<'EOF'
import json, sys
name, rc, seconds, criterion, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
last = (open(log).read().strip().splitlines() or [""])[-1]
# pytest's summary: tests that were all skipped (no CUDA, one GPU for TP2) prove nothing
skipped = "skipped" in last and "passed" not in last and "failed" not in last
verdict = "TIMEOUT" if rc == 124 else "FAIL" if rc else "SKIPPED" if skipped else "pass"
print(json.dumps(dict(stage=name, verdict=verdict, rc=rc, seconds=seconds, criterion=criterion)))
EOF
  tail -n 4 "$OUT/$name.log" | sed 's/^/    /'
}

beside=""
for s in "${STAGES[@]}"; do
  IFS='|' read -r name limit criterion cmd <<< "$s"
  [[ -n ${ONLY:-} && " $ONLY " != *" ${name#&} "* ]] && continue
  if [[ $name == '&'* ]]; then
    name=${name#&}
    (run_stage "$name" "$limit" "$criterion" "$cmd" > "$OUT/$name.json") &
    beside="$beside $name"
    continue
  fi
  if [[ $name == kimi_* && -n $beside ]]; then
    wait
    for b in $beside; do cat "$OUT/$b.json"; done
    beside=""
  fi
  run_stage "$name" "$limit" "$criterion" "$cmd"
done
wait
table() { [[ -f $OUT/$1.log ]] && { echo "== $1"; sed -n "/^| $2/,\$p" "$OUT/$1.log"; }; }
table table_torch kernel; table table_flashinfer kernel
table kimi_flashinfer batch; table kimi_torch batch
exit 0
