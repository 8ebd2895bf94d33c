#!/usr/bin/env bash
# Puts fastpipe._C in place (fastpipe/_C*.so) for the given Python: the prebuilt library in
# build/prebuilt/ (or $FASTPIPE_PREBUILT) when its stamp (tools/native_stamp.sh: the torch
# version and the native sources' hash) matches this torch and tree, else an in-place build
# (setup.py: the CUDA paths with g++ against the CUDA runtime the torch wheel brings, or the
# CPU-only library with one line saying why). Prints one line saying which it did.
#
#   tools/build_native.sh [python]      (default: python3)
#
# A prebuilt library comes from tools/check_cuda_build.sh, run on a machine with the same torch
# and Python (no GPU or CUDA toolkit needed there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
PREBUILT="${FASTPIPE_PREBUILT:-build/prebuilt}"
suffix=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
library="$PREBUILT/_C$suffix"
stamp=$(tools/native_stamp.sh "$PY")
if [ -f "$library" ] && [ "$(cat "$library.stamp" 2>/dev/null)" = "$stamp" ]; then
  cp "$library" "fastpipe/_C$suffix"
  echo "build_native: using the prebuilt $library ($stamp)"
  exit 0
fi
[ -f "$library" ] && echo "build_native: $library is stale ($(cat "$library.stamp" 2>/dev/null ||
  echo no stamp); here $stamp): building"
"$PY" setup.py build_ext --inplace
