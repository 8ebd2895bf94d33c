#!/usr/bin/env bash
# Prints what a built fastpipe._C must match to be reused: the torch it was built against and a
# hash of the native sources (csrc/, setup.py). tools/check_cuda_build.sh writes it beside the
# library it leaves in build/prebuilt/; benchmarks/gpu_check.sh compares it before using one.
#
#   tools/native_stamp.sh [python]      (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
sources=$(find csrc setup.py -type f | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)
torch=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null)
echo "torch=$torch sources=$sources"
