#!/usr/bin/env bash
# A language model's whole training step on one GPU, moec beside PyTorch (issue 43: "a language
# model's step (the GPT-MoE LM at a width that fills the GPU) beside PyTorch's").
#
#   bash bench/gpu_lm.sh --build [--quick]     (build machine) writes DIR/lm_gpu.moe and its bf16
#                                              twin and builds DIR/NAME.cuda for each
#   bash bench/gpu_lm.sh [--quick] [--steps N] (GPU machine)
#
# The model (--size gpu of bench/torch_lm.py, which is the same model in PyTorch): vocab 32000,
# batch 16, seqlen 256 (4096 tokens a step), embed 2048, 2 pre-norm blocks of attention (16
# heads) and an MoE of 8 GPT experts (hidden 8192, biases, tanh GELU), gshard top-2 at capacity
# 1.25 with aux loss 0.01, learned positions, tied embeddings, AdamW with clipping at 1.0: 636 M
# parameters. --quick: a tiny model of the same form (the tests' smoke run on the fake device).
# On the GPU: each moec binary trains N steps (default 8), the step is the median of the reported
# step times of steps 3..N (forward, backward and update; the report's time is the GPU's), with
# the compiler's launch counts of the program (moec build -v); bench/torch_lm.py times
# the same model (fp32 with TF32 off, and bf16 under autocast with fp32 parameters, as moec's
# dtype bf16), median of N steps after 2 warm-up steps. One row per dtype: moec ms, PyTorch ms,
# PyTorch / moec (> 1: moec is faster); a third, bf16_cc, is the bf16 program with its attention on
# the CUDA cores (MOEC_ATTN_TC=0) against PyTorch's bf16 step. DIR is LM_DIR (default $BUILD/cuda/lm, packed by make
# gpu-pack). Exit status 1 when something failed; the footer says OK or FAILED.
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
DIR=${LM_DIR:-$BUILD/cuda/lm}
case $DIR in /*) ;; *) DIR=$PWD/$DIR ;; esac
build=false quick=false steps=8
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=true ;;
    --quick) quick=true ;;
    --steps) steps=${2:?--steps needs a number}; shift ;;
    *) echo "usage: bench/gpu_lm.sh [--build] [--quick] [--steps N]" >&2; exit 2 ;;
  esac
  shift
done
# vocab batch seqlen embed layers heads hidden (torch_lm.py's --size gpu and gpu-quick)
if $quick; then size=gpu-quick; set -- 512 2 32 64 2 4 256; else size=gpu; set -- 32000 16 256 2048 2 16 8192; fi
vocab=$1 batch=$2 seqlen=$3 embed=$4 layers=$5 heads=$6 hidden=$7
name=lm_$(echo "$size" | tr - _)

model() {   # DTYPE
  cat <<EOF
# bench/gpu_lm.sh: the GPT-MoE language model of bench/torch_lm.py --size $size ($1)
model $name {
  dtype $1; batch $batch; seqlen $seqlen; embed $embed; seed 1;
  vocab $vocab;
  position learned;
  norm layernorm;
  tie_embeddings true;
  optimizer adamw { lr 0.0003; beta1 0.9; beta2 0.95; weight_decay 0.1; clip 1.0; }
}
layer block x $layers {
  attention { heads $heads; }
  moe {
    experts 8 { ffn gpt { hidden $hidden; act gelu; } }
    gate gshard { k 2; capacity 1.25; aux_loss 0.01; }
  }
}
EOF
}

# The programs: fp32, bf16 (its attention on tensor cores where the heads allow: lang/manual.md
# §14.1), and bf16_cc, the bf16 program with its attention on the CUDA cores (MOEC_ATTN_TC=0), so
# that one run measures what the tensor cores give.
VARIANTS="fp32 bf16 bf16_cc"
if $build; then
  mkdir -p "$DIR"
  for v in $VARIANTS; do
    model "${v%_cc}" >"$DIR/${name}_$v.moe"
    tc=1; [ "$v" != "${v%_cc}" ] && tc=0
    MOEC_ATTN_TC=$tc "$MOEC" build "$DIR/${name}_$v.moe" --target cuda -v -o "$DIR/${name}_$v.cuda" >"$DIR/${name}_$v.build" 2>&1 ||
      { echo "FAILED: moec build $DIR/${name}_$v.moe --target cuda: $(tail -n 3 "$DIR/${name}_$v.build")"; exit 1; }
    echo "# $DIR/${name}_$v.cuda"
  done
  exit 0
fi

status=0
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-gpulm.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
. bench/torch_python.sh
python=$(torch_python)
echo "# a language model's training step on $(hostname): moec ($DIR) beside bench/torch_lm.py --size $size" \
     "(vocab $vocab, B $batch, L $seqlen, M $embed, $layers blocks, 8 experts of hidden $hidden, top-2)"
median() { sort -g | awk '{a[NR] = $1} END { if (NR) print a[int((NR + 1) / 2)] }'; }
rows=()
declare -A torch_ms
for v in $VARIANTS; do
  dtype=$v
  bin=$DIR/${name}_$dtype.cuda
  if [ ! -x "$bin" ]; then
    echo "# $dtype: $bin is missing (bash bench/gpu_lm.sh --build on the build machine)"; status=1; continue
  fi
  grep -h '^# launches\|^# attention' "$DIR/${name}_$dtype.build" 2>/dev/null | sed "s/^# /# moec $dtype /"
  if ! (cd "$WORK" && timeout 300 "$bin" --steps "$steps" >"$WORK/run.$dtype" 2>&1 </dev/null); then
    echo "# moec $dtype: the binary failed: $(tail -n 5 "$WORK/run.$dtype")"; status=1; continue
  fi
  ms=$(awk '$1 == "step" && $2 >= 3 { for (i = 1; i < NF; i++) if ($i == "time") print $(i + 1) }' "$WORK/run.$dtype" | median)
  # the same binary op by op (its step functions not captured into CUDA graphs)
  if (cd "$WORK" && MOERT_CUDA_GRAPH=0 timeout 300 "$bin" --steps "$steps" >"$WORK/eager.$dtype" 2>&1 </dev/null); then
    ems=$(awk '$1 == "step" && $2 >= 3 { for (i = 1; i < NF; i++) if ($i == "time") print $(i + 1) }' "$WORK/eager.$dtype" | median)
  else
    echo "# moec $dtype op by op: the binary failed: $(tail -n 5 "$WORK/eager.$dtype")"; status=1; ems=-
  fi
  loss=$(awk '$1 == "step" { for (i = 1; i < NF; i++) if ($i == "loss") l = $(i + 1) } END { print l }' "$WORK/run.$dtype")
  echo "# moec $dtype: steps 1..$steps, loss $(awk '$1 == "step" && $2 == 1 { for (i = 1; i < NF; i++) if ($i == "loss") print $(i + 1) }' "$WORK/run.$dtype") -> $loss"
  tms="-"
  if [ "$v" != "${v%_cc}" ]; then   # the same model as bf16: PyTorch's bf16 time
    tms=${torch_ms[${v%_cc}]:--}
  elif [ -n "$python" ]; then
    if "$python" bench/torch_lm.py --device cuda --dtype "$dtype" --size "$size" --steps "$steps" --warmup 2 >"$WORK/torch.$dtype" 2>&1; then
      tms=$(awk '$1 == "lm" { print $3 }' "$WORK/torch.$dtype")
      grep -q '^skip' "$WORK/torch.$dtype" && { tms="-"; sed 's/^/# /' "$WORK/torch.$dtype"; }
    else
      echo "# torch_lm $dtype failed: $(tail -n 3 "$WORK/torch.$dtype")"; status=1
    fi
  else
    echo "# no python here imports torch: PyTorch's side is not run"
  fi
  torch_ms[$v]=$tms
  rows+=("$(printf '%-7s %12.2f %14s %12s %10s' "$dtype" "$ms" "$ems" "$tms" \
           "$(awk -v a="$ms" -v b="$tms" 'BEGIN { if (b + 0 > 0 && a > 0) printf "%.2fx", b / a; else print "-" }')")")
done
printf '%-7s %12s %14s %12s %10s\n' dtype "moec ms" "op by op ms" "PyTorch ms" "speedup"
for r in "${rows[@]}"; do echo "$r"; done
echo "# ms: one whole training step (forward, backward, clip, AdamW), median; moec's step functions replayed as CUDA"
echo "# graphs, and op by op (MOERT_CUDA_GRAPH=0) beside; speedup = PyTorch / moec (graphs); bf16_cc: the bf16"
echo "# program with its attention on the CUDA cores (MOEC_ATTN_TC=0), against PyTorch's bf16 step"
[ $status -eq 0 ] && echo OK || echo FAILED
exit $status
