#!/usr/bin/env bash
# Compile (not run) the CUDA build of fastpipe._C on a machine without a GPU, then run the test
# suite against that build on the CPU. Needs the CUDA toolkit (CUDA_HOME or nvcc on PATH) and
# downloads a CUDA build of torch (several GB) into its own virtualenv.
#
#   tools/check_cuda_build.sh [torch-requirement]      (default: torch==2.14.1)
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_REQ="${1:-torch==2.14.1}"
VENV="${CUDA_CHECK_VENV:-build/cuda-check-venv}"
WORK="build/cuda-check-tree"
if [ -z "${CUDA_HOME:-}" ]; then
  # nvcc on PATH may be a wrapper outside the toolkit: ask it where the toolkit is
  CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
  [ -f "$CUDA_HOME/include/cuda_runtime.h" ] ||
    CUDA_HOME="$(ls -d /usr/local/cuda-* /usr/local/cuda 2>/dev/null | sort -V | tail -1)"
fi
export CUDA_HOME TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" FASTPIPE_BUILD_CUDA=1
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH_REQ" setuptools wheel ninja numpy pytest pytest-timeout
rm -rf "$WORK" && mkdir -p "$WORK" && git ls-files -z | xargs -0 cp --parents -t "$WORK"
(cd "$WORK" && MAX_JOBS=2 "../../$VENV/bin/python" setup.py build_ext --inplace)
(cd "$WORK" && "../../$VENV/bin/python" -c "
import torch, fastpipe._C as C
assert C.built_with_cuda, 'the extension was built without its CUDA kernel'
assert torch._C._dispatch_has_kernel_for_dispatch_key('fastpipe::transfer', 'CUDA')
print('CUDA build of fastpipe._C: compiled and loaded, CUDA', C.cuda_version)")
(cd "$WORK" && "../../$VENV/bin/python" -m pytest -q -p no:cacheprovider)
