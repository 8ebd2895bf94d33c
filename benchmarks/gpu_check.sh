#!/usr/bin/env bash
# Everything that needs a GPU, in one run of at most 8 minutes (the parts' limits add up to
# 460 s, the build included): fastpipe._C with its CUDA paths, the CUDA tests (one run per test
# file, so one failure stops nothing else), pipelines on GPUs (Pipe on cuda:0; DistributedPipe over
# NCCL where there are 2 or more GPUs, with its blocking host reads of device buffers per step:
# last_step.host_reads, 1 on the grouped transport: the close's non-finite check), then the GPU
# benchmarks in their --quick forms. Each part has its own time limit and log; a part that fails
# or times out is reported and the others still run. Ends with a table: each part's status,
# time, and whether it ran fastpipe's native path (CUDA paths of fastpipe._C; Triton kernels for
# the fused ops) or the fallback.
#
#   benchmarks/gpu_check.sh            (logs in build/gpu_check/, or $GPU_CHECK_OUT)
#
# Needs a CUDA build of torch, python3 ($PYTHON to choose another), g++, ninja and pytest; no CUDA
# toolkit and no network: the CUDA paths build with g++ against the CUDA runtime the torch wheel
# brings (setup.py), or come prebuilt from build/prebuilt/ when its stamp matches this torch,
# Python and tree (tools/build_native.sh; make one without a GPU with tools/check_cuda_build.sh
# and carry build/prebuilt along). Without a GPU it still builds and imports the CPU extension
# and reports every GPU part as skipped.
# Exit status: 0 every part passed, 1 a part failed or timed out, 2 no GPU (nothing checked on one).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # parts cd around
OUT="${GPU_CHECK_OUT:-build/gpu_check}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # the benchmark parts run in benchmarks/
BUDGET="${GPU_CHECK_BUDGET:-470}"  # seconds for all parts together (their limits: 460)
BUILD_LIMIT="${GPU_CHECK_BUILD_LIMIT:-75}"  # more only where a slow machine needs it (dry runs)
CUDA_TESTS_LIMIT=150  # all CUDA test files together; one file at most 60 s
START=$(date +%s)
ROWS=()

# part NAME LIMIT PATH CMD...: runs CMD with at most LIMIT seconds (less if the budget is short);
# PATH says which path the part exercises (native or fallback), for the table.
part() {
  local name=$1 limit=$2 path=$3
  shift 3
  local left=$((BUDGET - ($(date +%s) - START)))
  ((left < limit)) && limit=$left
  if ((limit < 5)); then
    ROWS+=("$name|skipped (out of time)|0|$path|")
    return
  fi
  echo "=== $name (limit ${limit}s): $(tr '\n' ' ' <<<"$*" | cut -c1-150)"
  local log="$OUT/${name//[:\/]/_}.log" t0 rc secs status last
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
  rc=$? secs=$(($(date +%s) - t0))
  case $rc in
    0) status=ok ;;
    5) [[ $name == cuda-tests* ]] && status="ok (no CUDA test selected)" || status="FAILED (exit 5)" ;;
    124 | 137) status="TIMEOUT after ${limit}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  tail -n 40 "$log"
  last=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-70 | tr '|' '/')
  ROWS+=("$name|$status|$secs|$path|$last")
}

skip() {  # skip NAME WHY
  ROWS+=("$1|skipped ($2)|0|-|")
}

if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then  # only .cu sources would need it; none today
  TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo 9.0)
  export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, from benchmarks/ too

part build "$BUILD_LIMIT" "?" tools/build_native.sh "$PY"
# What the native library gives: "native ..." or "fallback (why)"; the loaded part fails when a
# GPU is present and the CUDA paths are missing.
NATIVE_STATUS='
import torch
from fastpipe import _native
gpu = torch.cuda.is_available()
if not _native.load():
    print("fallback (fastpipe._C not loaded: %s)" % _native.load_error()); raise SystemExit(1)
C = _native.module()
kernel = torch._C._dispatch_has_kernel_for_dispatch_key("fastpipe::transfer", "CUDA")
if C.built_with_cuda and kernel:
    where = torch.cuda.get_device_name() if gpu else "no GPU"
    print("native (fastpipe._C, CUDA %d.%d, %s)" % (C.cuda_version // 1000, C.cuda_version % 1000 // 10, where))
else:
    print("fallback (fastpipe._C without its CUDA paths)"); raise SystemExit(1 if gpu else 0)
'
part loaded 25 "?" "$PY" -W ignore -c "$NATIVE_STATUS"
NATIVE=$(grep -E '^(native|fallback) ' "$OUT/loaded.log" | tail -n 1 | cut -c1-60 | tr '|' '/')
NATIVE="${NATIVE:-unknown (see loaded.log)}"
BUILT=$(grep -E "^(fastpipe|build_native):" "$OUT/build.log" | tail -n 1 | cut -c1-120 | tr '|' '/')
ROWS[0]="$(cut -d'|' -f1-3 <<<"${ROWS[0]}")|$NATIVE|${BUILT:-see the log}"
ROWS[1]="${ROWS[1]/|\?|/|$NATIVE|}"
TRITON=$("$PY" -c "
import torch
from fastpipe.ops import backend
print('native (Triton)' if torch.cuda.is_available() and backend.triton_available()
      else 'fallback (PyTorch reference)')" 2>/dev/null | tail -n 1)

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>&1 | tail -n 1)
NO_GPU="no GPU: torch.cuda.is_available() is False"
[[ $GPUS =~ ^[0-9]+$ ]] || { NO_GPU="torch does not import: $(cut -c1-60 <<<"$GPUS" | tr '|' '/')"; GPUS=0; }
GPU_PARTS=(cuda-tests pipe-cuda distributed-nccl bench-transfer bench-offload bench-graphs bench-ops)
if ((GPUS == 0)); then
  for name in "${GPU_PARTS[@]}"; do
    skip "$name" "$NO_GPU"
  done
else
  # pytest-timeout may be missing on a GPU machine (nothing can be installed there): the part's
  # own limit then bounds the tests.
  TIMEOUT_ARG=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARG=(--timeout 60)
  tests_end=$(($(date +%s) + CUDA_TESTS_LIMIT))
  for file in $(grep -rl --include='test_*.py' 'mark\.cuda' tests | sort); do
    left=$((tests_end - $(date +%s)))
    ((left < 60)) || left=60
    part "cuda-tests:${file#tests/}" "$left" "$NATIVE" \
      "$PY" -m pytest -q -p no:cacheprovider -m cuda "${TIMEOUT_ARG[@]}" "$file"
  done
  # Pipelines on GPUs: Pipe with cuda:0 stages in one process; DistributedPipe over NCCL with one
  # GPU per rank (NCCL cannot put two ranks on one GPU, so it needs at least 2 GPUs).
  part pipe-cuda 45 "$NATIVE" "$PY" benchmarks/gpu_pipeline_check.py pipe
  if ((GPUS >= 2)); then
    RANKS=$((GPUS < 4 ? GPUS : 4))
    part distributed-nccl 45 "$NATIVE" "$PY" -m torch.distributed.run --standalone \
      --nproc_per_node="$RANKS" benchmarks/gpu_pipeline_check.py distributed
  else
    skip distributed-nccl "$GPUS GPU: NCCL needs one GPU per rank, 2 or more"
  fi
  cd benchmarks
  part bench-transfer 30 "$NATIVE" "$PY" transfer.py --quick
  part bench-offload 30 "$NATIVE" "$PY" offload.py --quick
  part bench-graphs 30 "$NATIVE" "$PY" graphs.py --quick
  part bench-ops 30 "$TRITON" "$PY" ops.py --gpu --quick
  cd ..
fi

echo
echo "| part | status | seconds | path | last line |"
echo "|---|---|---|---|---|"
failed=0
for row in "${ROWS[@]}"; do
  IFS='|' read -r name status secs path last <<<"$row"
  echo "| $name | $status | $secs | $path | $last |"
  [[ $status == ok* || $status == skipped* ]] || failed=1
done
echo "total $(($(date +%s) - START))s; logs in $OUT/"
((failed)) && exit 1
((GPUS == 0)) && { echo "$NO_GPU: the GPU parts were skipped (exit 2)"; exit 2; }
exit 0
