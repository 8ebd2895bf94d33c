#!/usr/bin/env bash
# Proves, on a machine without a GPU, that fastpipe._C builds its CUDA paths beside a CUDA build
# of torch with g++ alone, as on a GPU machine that has no CUDA toolkit: a venv with the torch
# wheel (and the nvidia-* packages and Triton it brings), a copy of the tree, the build with
# FASTPIPE_BUILD_CUDA=1, CUDA_HOME naming no toolkit and every nvcc off PATH; then checks that the
# library loads, reports built_with_cuda, registers the CUDA kernel of fastpipe::transfer, and
# that the CUDA runtime headers it compiled came from the venv, none from a toolkit.
#
#   tools/check_cuda_build.sh [torch-requirement] [python]   (default: torch==2.14.1 python3)
#
# The checked library is left in build/prebuilt/ with its stamp (tools/native_stamp.sh):
# benchmarks/gpu_check.sh uses it instead of building when the torch, the Python and the sources
# match. For the GPU machine (torch 2.11, CUDA 13, Python 3.12):
#   PIP_CONFIG_FILE=/dev/null TORCH_CUDA_ARCH_LIST=9.0 tools/check_cuda_build.sh torch==2.11.0 python3.12
# then carry build/prebuilt to it. PIP_CONFIG_FILE=/dev/null also reaches torch releases above
# this machine's pip cap (2.14.1), e.g. torch==2.15.0. CUDA_CHECK_PYTEST="tests/ops
# tests/test_install.py" runs those tests against the build afterwards (on the CPU).
#
# Time on 2 busy cores: installing the torch wheel 1-3 min the first time (about 5.5 GB; the venv
# is kept, build/cuda-check-<torch>-<python>), the build 20-120 s, the checks about 10 s.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_REQ="${1:-torch==2.14.1}"
PYTHON="${2:-python3}"
TAG="$(echo "$TORCH_REQ-$(basename "$PYTHON")" | tr -c 'A-Za-z0-9.\n' '-')"
VENV="$PWD/${CUDA_CHECK_VENV:-build/cuda-check-$TAG}"
WORK="$PWD/build/cuda-check-tree"
PREBUILT="$PWD/build/prebuilt"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH_REQ" setuptools wheel ninja pytest pytest-timeout numpy
rm -rf "$WORK" && mkdir -p "$WORK"
# the working tree as it is: tracked and new files, not ignored ones, not deleted ones
git ls-files -co --exclude-standard -z |
  xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' _ |
  xargs -0 cp --parents -t "$WORK"

# No toolkit: CUDA_HOME names none, and no folder of PATH holds an nvcc.
NO_NVCC_PATH="$VENV/bin"
IFS=: read -ra DIRS <<<"$PATH"
for dir in "${DIRS[@]}"; do
  [ -e "$dir/nvcc" ] || NO_NVCC_PATH="$NO_NVCC_PATH:$dir"
done
if ! (cd "$WORK" && env -u CUDA_PATH CUDA_HOME=/nonexistent-cuda-toolkit PATH="$NO_NVCC_PATH" \
  FASTPIPE_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
  MAX_JOBS="${MAX_JOBS:-2}" "$VENV/bin/python" setup.py build_ext --inplace) >"$WORK/build.log" 2>&1; then
  tail -n 30 "$WORK/build.log"
  echo "check_cuda_build: the build failed (log: $WORK/build.log)"
  exit 1
fi
grep "^fastpipe:" "$WORK/build.log"

# The runtime headers each object compiled, as ninja recorded them (crt/, found through
# -idirafter, counts as a system header and is named by the line above instead).
used=$("$VENV/bin/ninja" -C "$WORK"/build/temp* -t deps 2>/dev/null | grep 'cuda_runtime_api\.h' | sort -u)
if [ -z "$used" ] || grep -qv "^ *$VENV/" <<<"$used"; then
  echo "check_cuda_build: the CUDA runtime headers did not all come from the venv:"; echo "$used"
  exit 1
fi
(cd "$WORK" && "$VENV/bin/python" -W ignore -c "
import torch, fastpipe._C as C
assert C.built_with_cuda, 'the extension was built without its CUDA paths'
assert torch._C._dispatch_has_kernel_for_dispatch_key('fastpipe::transfer', 'CUDA'), \
    'the CUDA kernel of fastpipe::transfer is not registered'
print(f'check_cuda_build: fastpipe._C for torch {torch.__version__} built with g++ (no toolkit), '
      f'loaded: built_with_cuda, CUDA {C.cuda_version}, CUDA transfer kernel registered')")

mkdir -p "$PREBUILT"
for so in "$WORK"/fastpipe/_C*.so; do
  cp "$so" "$PREBUILT/"
  tools/native_stamp.sh "$VENV/bin/python" >"$PREBUILT/$(basename "$so").stamp"
  echo "check_cuda_build: left $PREBUILT/$(basename "$so") ($(cat "$PREBUILT/$(basename "$so").stamp"))"
done
if [ -n "${CUDA_CHECK_PYTEST:-}" ]; then
  # shellcheck disable=SC2086  # a list of test paths and options
  (cd "$WORK" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider $CUDA_CHECK_PYTEST)
fi
