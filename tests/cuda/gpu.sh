#!/usr/bin/env bash
# make test-gpu: runs build/cuda/gpu_check (tests/cuda/gpu_check.cpp) and prints its lines and
# the totals "N passed, N failed, N skipped". Without a GPU gpu_check prints one skip line, so
# this reports 0 passed, 0 failed, 1 skipped and exits 0; without the CUDA toolkit likewise.
# Exit status 1 when a check failed or gpu_check did not finish.
#
# On a GPU machine without the build machine's Debian packages (docs/gpu.md): libraries that
# gpu_check cannot find through its rpath are looked for in $BUILD/lib (carried) and in the
# Python venv's nvidia/nccl package; Open MPI's components carried in $BUILD/ompi are used
# through OPAL_PREFIX, with a singleton MPI_Init that starts no orted.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
CUDA=${CUDA:-/usr/local/cuda}
CHECK=$BUILD/cuda/gpu_check
OUT=$(mktemp "${TMPDIR:-/tmp}/moec-gpu.XXXXXX")
trap 'rm -f "$OUT"' EXIT

if [ ! -f "$CUDA/include/nvrtc.h" ]; then
  echo "skip  gpu: no CUDA toolkit (nothing at $CUDA/include/nvrtc.h)" | tee "$OUT"
  status=0
elif [ ! -x "$CHECK" ]; then
  echo "FAIL  gpu: $CHECK is missing (make builds it where the CUDA toolkit, cuBLAS and NCCL are; see its '#' lines)" | tee "$OUT"
  status=1
else
  if ldd "$CHECK" 2>/dev/null | grep -q 'not found'; then
    extra=$(cd "$BUILD" && pwd)/lib
    nccl=$(python3 -c 'import nvidia.nccl; print(nvidia.nccl.__path__[0])' 2>/dev/null) && extra=$extra:$nccl/lib
    export LD_LIBRARY_PATH=$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "# libraries not found by the rpath; LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldd "$CHECK" | grep 'not found' | sed 's/^[[:space:]]*/# still missing: /'
  fi
  if [ -d "$BUILD/ompi" ]; then
    export OPAL_PREFIX=$(cd "$BUILD/ompi" && pwd) OMPI_MCA_ess_singleton_isolated=1
    echo "# Open MPI components from OPAL_PREFIX=$OPAL_PREFIX"
  fi
  "$CHECK" 2>&1 | tee "$OUT"
  status=${PIPESTATUS[0]}
fi
passed=$(grep -c '^ok    ' "$OUT")
failed=$(grep -c '^FAIL  ' "$OUT")
skipped=$(grep -c '^skip  ' "$OUT")
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  echo "FAIL  gpu: $CHECK exited with status $status without reporting a failure"
  failed=1
fi
echo
echo "$passed passed, $failed failed, $skipped skipped"
[ "$status" -eq 0 ] && [ "$failed" -eq 0 ]
