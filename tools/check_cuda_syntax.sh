#!/usr/bin/env bash
# Compile-only check of the CUDA build's C++ sources on a machine without a GPU or a CUDA torch
# (CI): `g++ -fsyntax-only -DFASTPIPE_WITH_CUDA=1` of csrc/cuda/*.cpp and of every other source
# with a FASTPIPE_WITH_CUDA branch, against the installed (CPU) torch's headers, which include
# c10/cuda, and the CUDA runtime's headers: a CUDA toolkit's, else the ones Triton bundles.
# csrc/cuda/*.cu files, if any, go through a toolkit's `nvcc -c -o /dev/null`. About 20-40 s on
# 2 cores.
#
# What it catches: syntax, types, overloads and template instantiation in the CUDA-only code
# against the torch version installed. What it does not: linking and loading the CUDA library
# (tools/check_cuda_build.sh does both with a CUDA torch, about 5 GB and minutes) and running it
# (benchmarks/gpu_check.sh on a GPU).
#
#   tools/check_cuda_syntax.sh [python]      (default: python3; exits 0 with SKIPPED, naming
#                                             why, when no CUDA runtime headers are found)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"

cuda_include() {
  local candidates=()
  [ -n "${CUDA_HOME:-}" ] && candidates+=("$CUDA_HOME")
  if command -v nvcc >/dev/null; then  # nvcc on PATH may be a wrapper outside the toolkit
    candidates+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
  fi
  candidates+=($(ls -d /usr/local/cuda /usr/local/cuda-* 2>/dev/null | sort -rV))
  # no toolkit: the CUDA runtime headers (crt/ included) Triton bundles for its launcher
  candidates+=($("$PY" -c "import importlib.util as u, os; s = u.find_spec('triton')
print(os.path.join(s.submodule_search_locations[0], 'backends', 'nvidia') if s else '')" 2>/dev/null))
  for root in "${candidates[@]}"; do
    if [ -f "$root/include/cuda_runtime_api.h" ]; then
      echo "$root"
      return
    fi
  done
}

CUDA_ROOT="$(cuda_include || true)"
if [ -z "$CUDA_ROOT" ]; then
  echo "check_cuda_syntax: SKIPPED: no CUDA runtime headers (cuda_runtime_api.h) found;" \
    "set CUDA_HOME to a CUDA toolkit, or install Triton, to check the CUDA sources"
  exit 0
fi

TORCH_INCLUDES=$("$PY" -c "
import sysconfig
from torch.utils.cpp_extension import include_paths
print(' '.join('-I' + p for p in include_paths() + [sysconfig.get_paths()['include']]))")
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
# A CPU torch ships c10/cuda's headers but not this generated one; a CUDA torch has it.
mkdir -p "$SHIM/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$SHIM/c10/cuda/impl/cuda_cmake_macros.h"

FLAGS=(-std=c++20 -DFASTPIPE_WITH_CUDA=1 -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C
  $TORCH_INCLUDES -idirafter "$SHIM" -I"$CUDA_ROOT/include")
mapfile -t SOURCES < <(
  { ls csrc/cuda/*.cpp 2>/dev/null; grep -l FASTPIPE_WITH_CUDA csrc/*.cpp csrc/cpu/*.cpp 2>/dev/null; } |
    sort -u)
mapfile -t CU < <(ls csrc/cuda/*.cu 2>/dev/null || true)
echo "check_cuda_syntax: ${#SOURCES[@]} C++ + ${#CU[@]} CUDA sources against CUDA headers in" \
  "$CUDA_ROOT and torch $("$PY" -c 'import torch; print(torch.__version__)')"

failed=0
printf '%s\n' "${SOURCES[@]}" |
  xargs -P "$(nproc)" -I{} sh -c 'g++ "$@" -w -fsyntax-only {} || { echo "FAILED: {}"; exit 1; }' \
    _ "${FLAGS[@]}" || failed=1
for f in "${CU[@]}"; do
  [ -n "$f" ] || continue
  "$CUDA_ROOT/bin/nvcc" "${FLAGS[@]}" -w -c "$f" -o /dev/null || { echo "FAILED: $f"; failed=1; }
done
if [ "$failed" -ne 0 ]; then
  echo "check_cuda_syntax: the CUDA build does not compile (see the errors above)"
  exit 1
fi
echo "check_cuda_syntax: OK"
