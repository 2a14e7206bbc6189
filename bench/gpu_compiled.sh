#!/usr/bin/env bash
# make bench-gpu's compiled layer: the MoE layer bench/gpu_layer replicates op by op, as `moec
# build --target cuda` compiles it (the fuse pass's kernels, bf16 storage with dtype bf16, the
# update in one launch, each step function a CUDA graph), trained on the GPU.
#
#   bash bench/gpu_compiled.sh --build [--quick]       (build machine) writes DIR/NAME.moe and
#                                                      builds DIR/NAME.cuda for each shape, fp32 and bf16
#   bash bench/gpu_compiled.sh [--quick] [--dtype fp32|bf16] [--steps N] [--shapes SPEC]
#                                                      (GPU machine) runs them
#
# The layer is gpu_layer's: 8 experts (ffn gpt with bias and GELU, or mixtral's SwiGLU), gate
# gshard top-2 with capacity 1.2 and aux loss 0.01, order tutel, on B x L tokens of width M
# (SPEC: FFN:BxLxMxHSCALE, comma-separated, H = HSCALE*M), with an MSE loss on synthetic data and
# AdamW. Each binary trains N steps (default 12) with --profile; its "forward and backward" is the
# median over steps 2..N of the forward and backward step functions, each ending when the GPU is
# done (the data's upload and the update are not in it; PyTorch's side, bench/torch_ref.py, times
# the layer's forward and backward the same way); the update and the whole step are printed too.
# Shapes built: gpt and mixtral at 4x2048x4096x4 (Table 4's largest) and 2x2048x2048x4, and the
# largest dropless (FFN_dropless: capacity *, its buffers every token for every expert, its expert
# GEMMs over the routed rows: a line after the table gives its time over the capacity layer's, which
# routes the same tokens); --quick: gpt and gpt_dropless 1x32x32x2 (the tests run them on the fake
# device, where the times say nothing);
# --shapes: those (a shape asked for that was not built is said and skipped). With --dtype bf16 a
# line after the table gives each capacity layer's time with its expert GEMMs padded
# (MOERT_CUDA_GROUPED=0) over its time over the filled rows (the GEMM its device line names), and
# each dropless layer's time with its kernels over every slot (a twin built with
# MOEC_EXPERT_ROWS=gemm: its expert GEMMs over the filled rows, its other kernels as before the
# kernels over the slots read the counts) over its own.
# DIR is COMPILED_DIR (default $BUILD/cuda/layers, carried to the GPU machine by make gpu-pack).
#
# Rows: ffn shape dtype, forward and backward ms, update ms, whole step ms, and the program's
# kernels, GEMMs and kernel traffic a step (moec build -v). '#' lines are metadata; the footer
# says OK or FAILED; exit status 1 when something failed.
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
DIR=${COMPILED_DIR:-$BUILD/cuda/layers}
case $DIR in /*) ;; *) DIR=$PWD/$DIR ;; esac
build=false quick=false dtype=fp32 steps=12 spec=""
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=true ;;
    --quick) quick=true ;;
    --dtype) dtype=${2:?--dtype needs fp32 or bf16}; shift ;;
    --steps) steps=${2:?--steps needs a number}; shift ;;
    --shapes) spec=${2:?--shapes needs FFN:BxLxMxHSCALE,...}; shift ;;
    *) echo "usage: bench/gpu_compiled.sh [--build] [--quick] [--dtype fp32|bf16] [--steps N] [--shapes SPEC]" >&2; exit 2 ;;
  esac
  shift
done
case $dtype in fp32 | bf16) ;; *) echo "bench/gpu_compiled.sh: --dtype fp32 or bf16, not '$dtype'" >&2; exit 2 ;; esac

SHAPES="gpt:4x2048x4096x4 mixtral:4x2048x4096x4 gpt_dropless:4x2048x4096x4 mixtral_dropless:4x2048x4096x4
        gpt:2x2048x2048x4 mixtral:2x2048x2048x4"
$quick && SHAPES="gpt:1x32x32x2 gpt_dropless:1x32x32x2"
[ -n "$spec" ] && SHAPES=$(echo "$spec" | tr ',' ' ')

name_of() { echo "layer_$1_$2_$3"; }   # FFN SHAPE DTYPE

. bench/layer_model.sh
model() { layer_model bench/gpu_compiled.sh layer "$1" "$2" "$3"; }   # FFN BxLxMxHSCALE DTYPE

if $build; then
  mkdir -p "$DIR"
  for entry in $SHAPES; do
    IFS=: read -r ffn shape <<<"$entry"
    for dt in fp32 bf16; do
      name=$(name_of "$ffn" "$shape" "$dt")
      model "$ffn" "$shape" "$dt" >"$DIR/$name.moe" || exit 1
      "$MOEC" build "$DIR/$name.moe" --target cuda -v -o "$DIR/$name.cuda" 2>"$DIR/$name.build" ||
        { cat "$DIR/$name.build"; echo "FAILED: moec build $DIR/$name.moe --target cuda"; exit 1; }
      echo "# $DIR/$name.cuda"
      if [ "$dt" = bf16 ] && [ "$ffn" != "${ffn%_dropless}" ]; then   # the twin with its kernels over every slot
        MOEC_EXPERT_ROWS=gemm "$MOEC" build "$DIR/$name.moe" --target cuda -v -o "$DIR/${name}_gemm.cuda" 2>"$DIR/${name}_gemm.build" ||
          { cat "$DIR/${name}_gemm.build"; echo "FAILED: MOEC_EXPERT_ROWS=gemm moec build $DIR/$name.moe --target cuda"; exit 1; }
        echo "# $DIR/${name}_gemm.cuda"
      fi
    done
  done
  exit 0
fi

status=0
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-compiled.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "# the compiled layer (moec build --target cuda, $dtype): forward and backward, update and whole step, medians of steps 2..$steps"
printf '%-16s %-15s %6s %11s %10s %9s %8s %6s %10s\n' ffn shape dtype "fwdbwd ms" "update ms" "step ms" kernels gemms "traffic MB"
declare -A fwdbwd gemm
for entry in $SHAPES; do
  IFS=: read -r ffn shape <<<"$entry"
  name=$(name_of "$ffn" "$shape" "$dtype")
  if [ ! -x "$DIR/$name.cuda" ] && [ -n "$spec" ]; then   # a shape asked for that make gpu-pack did not build
    echo "# $ffn $shape: not built ($DIR/$name.cuda: bash bench/gpu_compiled.sh --build --shapes SPEC builds it)"; continue
  elif [ ! -x "$DIR/$name.cuda" ]; then
    echo "# $ffn $shape: $DIR/$name.cuda is missing (bash bench/gpu_compiled.sh --build on the build machine)"; status=1; continue
  fi
  if ! (cd "$WORK" && timeout 300 "$DIR/$name.cuda" --steps "$steps" --profile >"$WORK/run" 2>&1 </dev/null); then
    echo "# $ffn $shape: the binary failed: $(tail -n 5 "$WORK/run")"; status=1; continue
  fi
  read -r fb up < <(awk '/^# profile: median forward and backward/ {print $7, $11}' "$WORK/run")
  whole=$(awk '/^# profile: steps/ {print $8}' "$WORK/run")
  # The compiler's counts: "# launches: a step  K kernels,  G GEMMs, ..." and "kernel traffic: X MB".
  read -r kernels gemms < <(awk '/^# launches: a step/ {print $5, $7}' "$DIR/$name.build" 2>/dev/null)
  traffic=$(awk '/^# kernel traffic:/ {print $4}' "$DIR/$name.build" 2>/dev/null)
  if [ -z "${fb:-}" ] || [ -z "${up:-}" ] || [ -z "$whole" ]; then
    echo "# $ffn $shape: no --profile lines: $(tail -n 3 "$WORK/run")"; status=1; continue
  fi
  printf '%-16s %-15s %6s %11.3f %10.3f %9.3f %8s %6s %10s\n' "$ffn" "$shape" "$dtype" "$fb" "$up" "$whole" \
    "${kernels:--}" "${gemms:--}" "${traffic:--}"
  fwdbwd[$ffn:$shape]=$fb
  gemm[$ffn:$shape]=$(sed -n 's/.*expert GEMMs a step over their filled rows (\([^;)]*\).*/\1/p' "$WORK/run" | head -n 1)
done
# bf16, a capacity layer: the same binary with its expert GEMMs padded (MOERT_CUDA_GROUPED=0, every
# slot, as before issue 65) against the GEMM over the filled rows its device line names.
for key in "${!fwdbwd[@]}"; do
  ffn=${key%%:*} shape=${key#*:}
  [ "$dtype" = bf16 ] && [ "$ffn" = "${ffn%_dropless}" ] && [ -n "${gemm[$key]:-}" ] || continue
  name=$(name_of "$ffn" "$shape" "$dtype")
  if (cd "$WORK" && MOERT_CUDA_GROUPED=0 timeout 300 "$DIR/$name.cuda" --steps "$steps" --profile >"$WORK/run0" 2>&1 </dev/null) &&
     fb0=$(awk '/^# profile: median forward and backward/ {print $7}' "$WORK/run0") && [ -n "$fb0" ]; then
    awk -v p="$fb0" -v r="${fwdbwd[$key]}" -v f="$ffn" -v s="$shape" -v g="${gemm[$key]}" \
      'BEGIN { if (r > 0) printf "# %s %s bf16: forward and backward %.3f ms with the expert GEMMs padded (MOERT_CUDA_GROUPED=0), %.3f over the filled rows (%s): %.2fx\n", f, s, p, r, g, p / r }'
  else
    echo "# $ffn $shape: the binary failed with MOERT_CUDA_GROUPED=0: $(tail -n 3 "$WORK/run0")"; status=1
  fi
done
for key in "${!fwdbwd[@]}"; do   # bf16, a dropless layer: its twin with the kernels over every slot
  ffn=${key%%:*} shape=${key#*:}
  name=$(name_of "$ffn" "$shape" "$dtype")
  [ "$dtype" = bf16 ] && [ "$ffn" != "${ffn%_dropless}" ] && [ -x "$DIR/${name}_gemm.cuda" ] || continue
  if (cd "$WORK" && timeout 300 "$DIR/${name}_gemm.cuda" --steps "$steps" --profile >"$WORK/run0" 2>&1 </dev/null) &&
     fb0=$(awk '/^# profile: median forward and backward/ {print $7}' "$WORK/run0") && [ -n "$fb0" ]; then
    awk -v p="$fb0" -v r="${fwdbwd[$key]}" -v f="$ffn" -v s="$shape" \
      'BEGIN { if (r > 0) printf "# %s %s bf16: forward and backward %.3f ms with the kernels over every slot (MOEC_EXPERT_ROWS=gemm), %.3f over the filled rows: %.2fx\n", f, s, p, r, p / r }'
  else
    echo "# $ffn $shape: the twin with its kernels over every slot failed: $(tail -n 3 "$WORK/run0")"; status=1
  fi
done
for key in "${!fwdbwd[@]}"; do   # a dropless layer against the capacity layer of the same shape
  ffn=${key%%:*} shape=${key#*:}
  [ "$ffn" != "${ffn%_dropless}" ] && [ -n "${fwdbwd[${ffn%_dropless}:$shape]:-}" ] || continue
  awk -v d="${fwdbwd[$key]}" -v c="${fwdbwd[${ffn%_dropless}:$shape]}" -v f="$ffn" -v s="$shape" -v t="$dtype" \
    'BEGIN { if (c > 0) printf "# %s %s %s: forward and backward %.3f ms, %.2fx the capacity layer'"'"'s %.3f (the same routed tokens)\n", f, s, t, d, d / c, c }'
done
[ $status -eq 0 ] && echo OK || echo FAILED
exit $status
