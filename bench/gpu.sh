#!/usr/bin/env bash
# make bench-gpu: one MoE layer on the GPU, moec beside PyTorch (docs/gpu.md, "make bench-gpu").
#   1. build/bench/gpu_layer (bench/gpu_layer.cpp): the layer from moec's CUDA kernels and
#      cuBLAS, and its expert GEMMs alone (the roofline);
#   2. bench/torch_ref.py: the same layer in PyTorch, on the shapes gpu_layer ran;
#   3. the two side by side: PyTorch time / moec time for the layer, the gate and the routing;
#   4. the layer as moec compiles it (bench/gpu_compiled.sh: `moec build --target cuda`'s program,
#      fused, bf16 storage with --dtype bf16, CUDA graphs; built by make gpu-pack for Table 4's
#      largest shape and 2x2048x2048x4, both ffns) and its forward + backward beside PyTorch's,
#      eager and torch.compile, on the shapes both ran.
# Arguments go to both programs: --quick, --all, --shapes SPEC, --runs N, --warmup N (and --dtype,
# --quick, --shapes to bench/gpu_compiled.sh, which skips a shape it has no binary for).
#
# Without a GPU each program prints one skip line and the status is 0. On a GPU machine without
# the build machine's Debian packages (docs/gpu.md): libraries gpu_layer cannot find through its
# rpath are looked for in $BUILD/lib, as tests/cuda/gpu.sh does. PyTorch runs under the first of
# $TORCH_PYTHON, python3, /usr/bin/python3 that imports torch (else python3, which says so).
# Exit status 1 when a program failed.
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
CUDA=${CUDA:-/usr/local/cuda}
BIN=$BUILD/bench/gpu_layer
MOEC_OUT=$(mktemp "${TMPDIR:-/tmp}/moec-bench.XXXXXX")
TORCH_OUT=$(mktemp "${TMPDIR:-/tmp}/torch-bench.XXXXXX")
COMPILED_OUT=$(mktemp "${TMPDIR:-/tmp}/compiled-bench.XXXXXX")
trap 'rm -f "$MOEC_OUT" "$TORCH_OUT" "$COMPILED_OUT"' EXIT
status=0

# The peak the routed column divides by: the H100/H200 SXM's dense bf16 or fp32 (non-tensor) figure.
case " $* " in
  *" --dtype bf16 "*) PEAK=${PEAK:-989}; peak_of="dense bf16, H100/H200 SXM" ;;
  *) PEAK=${PEAK:-67}; peak_of="fp32, H100/H200 SXM" ;;
esac
echo "# make bench-gpu on $(hostname): moec ($BIN), then PyTorch (bench/torch_ref.py) on the same shapes"
shapes=""
if [ ! -x "$BIN" ]; then
  if nvidia-smi -L >/dev/null 2>&1; then
    echo "FAIL  bench-gpu: $BIN is missing (make builds it where the CUDA toolkit, cuBLAS and NCCL are; see docs/gpu.md)"
    status=1
  elif [ ! -f "$CUDA/include/nvrtc.h" ]; then
    echo "skip  bench-gpu: no GPU and no CUDA toolkit (nothing at $CUDA/include/nvrtc.h)"
  else
    echo "skip  bench-gpu: no GPU, and $BIN is not built (no cuBLAS or NCCL: see make's '#' lines)"
  fi
else
  if ldd "$BIN" 2>/dev/null | grep -q 'not found'; then
    extra=$(cd "$BUILD" && pwd)/lib
    nccl=$(python3 -c 'import nvidia.nccl; print(nvidia.nccl.__path__[0])' 2>/dev/null) && extra=$extra:$nccl/lib
    export LD_LIBRARY_PATH=$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "# libraries not found by the rpath; LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldd "$BIN" | grep 'not found' | sed 's/^[[:space:]]*/# still missing: /'
  fi
  shapes=$("$BIN" --list-shapes "$@") || { echo "FAIL  bench-gpu: $BIN --list-shapes $*"; exit 1; }
  "$BIN" "$@" 2>&1 | tee "$MOEC_OUT"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

. bench/torch_python.sh
python=$(torch_python)
echo
echo "# PyTorch side: ${python:-python3 (no python here imports torch)}"
"${python:-python3}" bench/torch_ref.py "$@" ${shapes:+--shapes "$shapes"} 2>&1 | tee "$TORCH_OUT"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# Rows of both tables start with the ffn; columns: ffn shape S T layer_ms gemm_ms gemm/layer
# gate_us route_us layer_TF/s gemm_TF/s drop%. The comparisons' awk functions: a ratio, and the
# TFLOP the experts compute on the routed tokens (k choices less the dropped) of a gpu_layer row.
AWK_LIB='function ratio(a, b) { return b > 0 && a == a ? a / b : 0 }
         function routed_tflop(   d, n) { split($2, d, "x"); n = ($1 == "gpt" ? 2 : 3)   # expert GEMMs per expert
                                           return 3 * n * 2 * $3 * 2 * (1 - $12 / 100) * d[3] * d[3] * d[4] / 1e12 }'
if grep -qE '^(gpt|mixtral) ' "$MOEC_OUT" && grep -qE '^(gpt|mixtral) ' "$TORCH_OUT"; then
  echo
  echo "# moec vs PyTorch: speedup = PyTorch time / moec time (> 1: moec is faster); eager and torch.compile"
  awk "$AWK_LIB"'
       FNR == 1 { file++ }
       $1 !~ /^(gpt|mixtral)$/ { next }
       file == 1 { layer[$1 " " $2] = $5; gemm[$1 " " $2] = $6; gate[$1 " " $2] = $8; route[$1 " " $2] = $9;
                   routed[$1 " " $2] = 100 * routed_tflop() / ($5 * 1e-3) / peak   # % of the peak
                   tf[$1 " " $2] = $10; next }
       file == 2 && ($1 " " $2) in layer {
         if (!header++)
           printf "%-8s %-15s %9s %9s %8s %10s %8s %9s %8s %10s %10s %10s %10s %8s %10s %10s %8s\n", "ffn", "shape", "moec ms",
                  "eager ms", "speedup", "compile ms", "speedup", "moec TF/s", "routed %", "moec gemm", "torch gemm", "moec gate",
                  "torch gate", "speedup", "moec rt", "torch rt", "speedup"
         k = $1 " " $2
         c = (NF >= 13 && $13 != "nan") ? $13 : -1
         printf "%-8s %-15s %9.3f %9.3f %7.2fx %10.3f %7.2fx %9.1f %7.1f%% %10.3f %10.3f %10.1f %10.1f %7.2fx %10.1f %10.1f %7.2fx\n", $1, $2,
                layer[k], $5, ratio($5, layer[k]), c, ratio(c, layer[k]), tf[k], routed[k], gemm[k], $6, gate[k], $8, ratio($8, gate[k]),
                route[k], $9, ratio($9, route[k])
       }' peak="$PEAK" "$MOEC_OUT" "$TORCH_OUT"
  echo "# routed %: the expert GEMMs' FLOPs on the routed tokens (k choices less the dropped ones) per second, over"
  echo "# the GPU's peak of $PEAK TFLOP/s ($peak_of; PEAK=N sets another)"
  echo "# ms: forward + backward of the layer (eager: PyTorch as written; compile: torch.compile of it, -1: not run),"
  echo "# and its expert GEMMs alone; moec TF/s: the layer's GEMM FLOPs over the capacity slots per second;"
  echo "# gate: us of softmax -> top-k -> gather; rt (route): us of gate matmul + gate + capacity locations"
fi

# 4. The compiled layer (its shapes PyTorch ran too get a row below).
cargs=() next=""
for a in "$@"; do
  [ -n "$next" ] && { cargs+=("$next" "$a"); next=""; continue; }
  case $a in --quick) cargs+=("$a") ;; --dtype | --shapes) next=$a ;; esac
done
echo
if nvidia-smi -L >/dev/null 2>&1; then
  bash bench/gpu_compiled.sh "${cargs[@]}" 2>&1 | tee "$COMPILED_OUT"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "skip  the compiled layer (bench/gpu_compiled.sh): no GPU"
fi
if grep -qE '^(gpt|mixtral) ' "$COMPILED_OUT" && grep -qE '^(gpt|mixtral) ' "$TORCH_OUT"; then
  echo
  echo "# the compiled layer vs PyTorch: speedup = PyTorch time / compiled time (> 1: moec is faster)"
  awk "$AWK_LIB"'
       FNR == 1 { file++ }
       $1 !~ /^(gpt|mixtral)$/ { next }
       file == 1 { layer[$1 " " $2] = $5; routed[$1 " " $2] = routed_tflop(); next }
       file == 2 { comp[$1 " " $2] = $4; kern[$1 " " $2] = $7; next }
       file == 3 && ($1 " " $2) in comp {
         k = $1 " " $2
         if (!header++)
           printf "%-8s %-15s %11s %11s %9s %9s %10s %9s %9s %8s\n", "ffn", "shape", "compiled ms", "replica ms",
                  "eager ms", "speedup", "compile ms", "speedup", "routed %", "kernels"
         c = (NF >= 13 && $13 != "nan") ? $13 : -1
         printf "%-8s %-15s %11.3f %11.3f %9.3f %8.2fx %10.3f %8.2fx %8.1f%% %8s\n", $1, $2, comp[k],
                (k in layer) ? layer[k] : -1, $5, ratio($5, comp[k]), c, ratio(c, comp[k]),
                (k in routed) ? 100 * routed[k] / (comp[k] * 1e-3) / peak : -1, kern[k]
       }' peak="$PEAK" "$MOEC_OUT" "$COMPILED_OUT" "$TORCH_OUT"
  echo "# compiled ms: forward + backward of the program moec build --target cuda makes of the layer (its MSE loss"
  echo "# included); replica ms: gpu_layer's op-by-op replica of round 4's program; routed %: the routed tokens'"
  echo "# expert FLOPs per second of the compiled layer over the peak of $PEAK TFLOP/s; kernels: its launches a step"
fi
exit $status
