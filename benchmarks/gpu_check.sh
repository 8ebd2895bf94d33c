#!/usr/bin/env bash
# Everything that needs a GPU, in one run of at most 8 minutes: build the CUDA extension, run the
# CUDA tests, pipelines on GPUs (Pipe on cuda:0; DistributedPipe over NCCL where there are 2 or
# more GPUs, with its blocking host reads of device buffers per step: last_step.host_reads, 0 on
# the grouped transport), then the GPU benchmarks (quick forms). Each part has its own time limit and log; a
# part that fails or times out is reported and the others still run. Ends with a summary table.
#
#   benchmarks/gpu_check.sh            (logs in build/gpu_check/, or $GPU_CHECK_OUT)
#
# Needs torch with CUDA, ninja and pytest already installed (no registry access is assumed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # parts cd around
OUT="${GPU_CHECK_OUT:-build/gpu_check}"
BUDGET="${GPU_CHECK_BUDGET:-470}"  # seconds for all parts together
mkdir -p "$OUT"
START=$(date +%s)
ROWS=()

# part NAME LIMIT CMD...: runs CMD with at most LIMIT seconds (less if the budget is short).
part() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  ((left < limit)) && limit=$left
  if ((limit < 5)); then
    ROWS+=("$name|skipped (out of time)|0|")
    return
  fi
  echo "=== $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$? secs=$(($(date +%s) - t0)) status
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMEOUT after ${limit}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  tail -n 40 "$OUT/$name.log"
  local last
  last=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-70 | tr '|' '/')
  ROWS+=("$name|$status|$secs|$last")
}

if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo 9.0)
  export TORCH_CUDA_ARCH_LIST
fi
export FASTPIPE_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, from benchmarks/ too

part build 200 "$PY" setup.py build_ext --inplace
part loaded 30 "$PY" -c "
import torch, fastpipe._C as C
assert torch.cuda.is_available(), 'torch sees no GPU'
assert C.built_with_cuda, 'fastpipe._C was built without its CUDA kernels'
assert torch._C._dispatch_has_kernel_for_dispatch_key('fastpipe::transfer', 'CUDA')
print('fastpipe._C with CUDA', C.cuda_version, 'on', torch.cuda.get_device_name())"
# pytest-timeout may be missing on a GPU machine (nothing can be installed there): the part's
# own limit then bounds the tests.
TIMEOUT_ARG=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARG=(--timeout 120)
part cuda-tests 150 "$PY" -m pytest -q -p no:cacheprovider -m cuda -x "${TIMEOUT_ARG[@]}"
# Pipelines on GPUs: Pipe with cuda:0 stages in one process; DistributedPipe over NCCL with one
# GPU per rank (NCCL cannot put two ranks on one GPU, so it needs at least 2 GPUs).
part pipe-cuda 60 "$PY" benchmarks/gpu_pipeline_check.py pipe
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if ((GPUS >= 2)); then
  RANKS=$((GPUS < 4 ? GPUS : 4))
  part distributed-nccl 150 "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node="$RANKS" benchmarks/gpu_pipeline_check.py distributed
else
  ROWS+=("distributed-nccl|skipped ($GPUS GPU: NCCL needs one GPU per rank, 2 or more)|0|")
fi
cd benchmarks
part bench-transfer 45 "$PY" transfer.py --quick
part bench-offload 45 "$PY" offload.py --quick
part bench-graphs 45 "$PY" graphs.py --quick
if [ -f ops.py ]; then
  part bench-ops 45 "$PY" ops.py --gpu
else
  ROWS+=("bench-ops|skipped (benchmarks/ops.py absent)|0|")
fi
cd ..

echo
echo "| part | status | seconds | last line |"
echo "|---|---|---|---|"
failed=0
for row in "${ROWS[@]}"; do
  IFS='|' read -r name status secs last <<<"$row"
  echo "| $name | $status | $secs | $last |"
  [[ $status == ok || $status == skipped* ]] || failed=1
done
echo "total $(($(date +%s) - START))s; logs in $OUT/"
exit $failed
