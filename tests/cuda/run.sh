#!/usr/bin/env bash
# The CUDA compile-only suite (no GPU needed): every model of lang/models, tests/golden and
# tests/models goes through `moec build --emit cuda`, and build/cuda/nvrtc_check compiles the
# unit with NVRTC for sm_90 (CUBIN and PTX); the whole kernel library, which every unit's kernels
# come from, for sm_80 and sm_90, and the kernels run on the CPU under emulation against libmoert (tests/cuda/emu_check.cpp).
# Last, build/cuda/gpu_check must start: it says "skip  gpu: no GPU (...)" without a GPU.
# One line per check, "ok    ..." or "FAIL  ..." (tests/run.sh counts them).
# Without the CUDA toolkit: one "skip  cuda: no CUDA toolkit" line and exit status 0.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
# OpenBLAS's link flags as make configured them (its OpenMP build, -fopenmp), as libmoert needs.
BLAS_LIBS=$(sed -n 's/^BLAS_LIBS := //p' "$BUILD/config.mk" 2>/dev/null)
BLAS_LIBS=${BLAS_LIBS:--lopenblas}
MOEC=${MOEC:-$BUILD/moec}
CUDA=${CUDA:-/usr/local/cuda}
CHECK=$BUILD/cuda/nvrtc_check
if [ ! -f "$CUDA/include/nvrtc.h" ]; then
  echo "skip  cuda: no CUDA toolkit (skipped: nothing at $CUDA/include/nvrtc.h)"
  exit 0
fi
if [ ! -x "$CHECK" ]; then
  echo "FAIL  cuda: $CHECK is missing (make builds it where the CUDA toolkit is)"
  exit 1
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-cuda.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
status=0

# check LABEL SOURCE-ARG EXPECTED-KERNELS ARCH...: nvrtc_check for each architecture, one line each.
check() {
  local label=$1 src=$2 want=$3 line arch n
  shift 3
  if ! "$CHECK" "$src" "$@" >"$WORK/out" 2>"$WORK/err"; then
    echo "FAIL  cuda kernels $label: NVRTC"
    sed 's/^/      /' "$WORK/err" | head -n 30
    status=1
    return
  fi
  while read -r line; do
    arch=${line%%:*}
    n=$(echo "$line" | awk '{print $2}')
    if [ -n "$want" ] && [ "$n" != "$want" ]; then
      echo "FAIL  cuda kernels $label $arch: $n kernels compiled, the unit says $want"
      status=1
    else
      echo "ok    cuda kernels $label $arch ($n kernels, $(echo "$line" | awk '{print $5}') bytes CUBIN, $(echo "$line" | awk '{print $8}') bytes PTX)"
    fi
  done <"$WORK/out"
}

# The kernel table (runtime/kernels.def) against the sources (codegen/cuda/*.cu).
if "$CHECK" --check-signatures >"$WORK/out" 2>"$WORK/err"; then
  echo "ok    cuda kernel signatures: $(cat "$WORK/out") (kernels.def = codegen/cuda/*.cu)"
else
  echo "FAIL  cuda kernel signatures: $(cat "$WORK/out")"; sed 's/^/      /' "$WORK/err" | head -n 20; status=1
fi

# one_model MODEL: its lines on stdout, its status as the exit status (run in a subshell with a
# WORK of its own, so that the models go through NVRTC side by side, one per core).
one_model() {
  local model=$1 name=${1%.moe} want
  status=0
  if ! "$MOEC" build "$model" --emit cuda -o "$WORK/k.cu" 2>"$WORK/err"; then
    echo "FAIL  cuda kernels $name: moec build --emit cuda"
    sed 's/^/      /' "$WORK/err" | head -n 20
    return 1
  fi
  # The unit must stand alone: no #include, no host code (no main, no cuda* API calls).
  if grep -vE '^[[:space:]]*//' "$WORK/k.cu" | grep -qE '#[[:space:]]*include|\<main[[:space:]]*\(|\<cuda[A-Z][A-Za-z]*[[:space:]]*\('; then
    echo "FAIL  cuda kernels $name: the unit has an #include or host code"
    return 1
  fi
  want=$(sed -n "1s/.*(\([0-9]*\) kernels).*/\1/p" "$WORK/k.cu")
  check "$name" "$WORK/k.cu" "$want" sm_90   # (the whole library below goes through sm_80 as well)
  return $status
}

jobs_max=$(nproc 2>/dev/null || echo 1)
models=()
for model in lang/models/*.moe tests/golden/*.moe tests/models/*.moe; do
  [ -f "$model" ] && models+=("$model")
done
for i in "${!models[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  mkdir -p "$WORK/m$i"
  (WORK=$WORK/m$i; one_model "${models[$i]}" >"$WORK/lines" 2>&1; echo $? >"$WORK/rc") &
done
wait
for i in "${!models[@]}"; do   # the lines in the models' order
  cat "$WORK/m$i/lines"
  [ "$(cat "$WORK/m$i/rc" 2>/dev/null)" = 0 ] || status=1
done
check "library (every kernel)" --library "" sm_80 sm_90
# moec's grouped GEMM on wgmma, the unit of its own a program for sm_90 embeds, for sm_90a; and
# ptxas's report of it (nvcc, where the toolkit has it): no spills, no MMA the compiler had to
# serialise (a "wgmma serialization" remark: its accumulators touched between the MMAs in flight).
check "mk_expert_gemm_wg, _wg256 (wgmma)" --wg 2 sm_90a
if [ -x "$CUDA/bin/nvcc" ]; then
  "$CHECK" --print-wg >"$WORK/wg.cu"
  if "$CUDA/bin/nvcc" -arch=sm_90a -cubin -std=c++17 --fmad=false -Xptxas -v -w -o "$WORK/wg.cubin" "$WORK/wg.cu" \
       >"$WORK/ptxas" 2>&1; then
    regs=$(sed -n 's/.*Used \([0-9]*\) registers.*/\1/p' "$WORK/ptxas" | paste -sd/)
    kernels=$(grep -c 'spill stores' "$WORK/ptxas")
    if [ "$kernels" = 2 ] && [ "$(grep -c ' 0 bytes spill stores, 0 bytes spill loads' "$WORK/ptxas")" = 2 ] &&
       ! grep -qi 'serializ\|C75[0-9][0-9]' "$WORK/ptxas"; then
      echo "ok    cuda kernels mk_expert_gemm_wg, _wg256 sm_90a: ptxas $regs registers, no spills, no serialised MMA"
    else
      echo "FAIL  cuda kernels mk_expert_gemm_wg, _wg256 sm_90a: ptxas reports spills or serialised MMAs ($kernels kernels)"
      grep -i 'spill\|serializ\|C75\|registers' "$WORK/ptxas" | sed 's/^/      /' | head -n 12
      status=1
    fi
  else
    echo "FAIL  cuda kernels mk_expert_gemm_wg sm_90a: nvcc"; sed 's/^/      /' "$WORK/ptxas" | head -n 20; status=1
  fi
else
  echo "skip  cuda kernels mk_expert_gemm_wg sm_90a: ptxas's report (no $CUDA/bin/nvcc)"
fi

# The kernels' semantics without a GPU: tests/cuda/emu_check.cpp runs the whole library as host
# C++ under a small emulation of CUDA threads and blocks against libmoert's CPU kernels.
CXX=${CXX:-g++}
"$CHECK" --print-library >"$WORK/lib.cu"
# MK_ATTN_D=32: the attention kernels hold 32 output columns a pass (the default is 128), so the
# cases' heads of 70 go through three passes (the last one partial).
if ! "$CXX" -std=c++20 -O1 -w -Iruntime -DMK_ATTN_D=32 -DMK_LIBRARY="\"$WORK/lib.cu\"" -o "$WORK/emu" tests/cuda/emu_check.cpp \
     "$BUILD/libmoert.a" $BLAS_LIBS -lcjson $(mpicc --showme:link 2>/dev/null || echo -lmpi) -lm -pthread 2>"$WORK/err"; then
  echo "FAIL  cuda emu: building tests/cuda/emu_check.cpp with $CXX"
  sed 's/^/      /' "$WORK/err" | head -n 30
  exit 1
fi
"$WORK/emu" || status=1

# The GPU runtime (runtime/cuda) and its checks (tests/cuda/gpu_check.cpp): make builds gpu_check
# where cuBLAS and NCCL are. It must link and start here; without a GPU it prints its one
# "skip  gpu: no GPU (...)" line, with a GPU it runs every check (make test-gpu runs it alone).
GPU_CHECK=$BUILD/cuda/gpu_check
if [ ! -x "$GPU_CHECK" ]; then
  echo "FAIL  cuda gpu_check: $GPU_CHECK is missing (make builds it where cuBLAS and NCCL are; see its '#' lines)"
  exit 1
fi
"$GPU_CHECK" 2>"$WORK/err"
gpu_status=$?
if [ $gpu_status -eq 0 ]; then
  echo "ok    cuda gpu_check links and starts"
else
  echo "FAIL  cuda gpu_check: exit status $gpu_status"
  sed 's/^/      /' "$WORK/err" | head -n 30
  status=1
fi
exit $status
