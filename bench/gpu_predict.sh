#!/usr/bin/env bash
# The planner's predicted step time beside the measured one, on a GPU (issue 15: "moec tune on
# the GPU writes a profile, and the predicted step time of a planned model is compared with the
# measured one").
#
#   bash bench/gpu_predict.sh --build [--quick]     (build machine) writes DIR/NAME.moe and builds
#                                                   DIR/NAME.cuda for each model below
#   bash bench/gpu_predict.sh [--quick] [--profile F.cluster] [--profile-bf16 F.cluster] [--steps N]
#                                                   (GPU machine)
#
# On the GPU: 1. `moec tune --target cuda` (one rank: the GEMMs through cuBLAS) writes
# DIR/gpu.cluster, and with --dtype bf16 DIR/gpu_bf16.cluster (unless --profile and
# --profile-bf16 give them); 2. for each model, `moec dump-ir NAME.moe --cluster P --after=gradpart` gives
# the planner's t_fwd_pred, t_bwd_pred and t_iter_pred (the model says `schedule { policy
# sequential; pipeline auto; }`: planned, r = 1, so the binary built elsewhere runs the plan the
# prediction is for), and NAME.cuda trains N steps (default 12): the measured step is the median
# of the reported step times of steps 3..N (the report's time is the GPU's: each step waits for
# its streams); 3. one row per model: predicted, the fused program's prediction (below), measured
# ms, and measured over each prediction.
#
# The models: one MoE layer (gshard top-2, capacity 1.2, tutel order, 8 experts) of Table 4
# shapes that fit one GPU, ffn gpt and mixtral, fp32, and one in bf16; --quick: two tiny shapes
# (the tests run it on the fake device, MOEC_CUDA_FAKE=1, where the times say nothing).
# DIR is PREDICT_DIR (default $BUILD/cuda/predict, carried to the GPU machine with build/cuda).
# '#' lines are metadata; the footer says OK or FAILED; exit status 1 when something failed.
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
DIR=${PREDICT_DIR:-$BUILD/cuda/predict}
case $DIR in /*) ;; *) DIR=$PWD/$DIR ;; esac
build=false quick=false profile="" profile_bf16="" steps=12
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=true ;;
    --quick) quick=true ;;
    --profile) profile=${2:?--profile needs a file}; shift ;;
    --profile-bf16) profile_bf16=${2:?--profile-bf16 needs a file}; shift ;;
    --steps) steps=${2:?--steps needs a number}; shift ;;
    *) echo "usage: bench/gpu_predict.sh [--build] [--quick] [--profile F.cluster] [--profile-bf16 F.cluster] [--steps N]" >&2; exit 2 ;;
  esac
  shift
done

# NAME:FFN:BxLxMxhscale:DTYPE
if $quick; then
  MODELS="predict_q_gpt:gpt:1x32x32x2:fp32 predict_q_bf16:gpt:1x32x32x2:bf16"
else
  MODELS="predict_gpt_2x512x1024x4:gpt:2x512x1024x4:fp32 predict_gpt_4x2048x2048x4:gpt:4x2048x2048x4:fp32
          predict_mixtral_2x1024x1024x2:mixtral:2x1024x1024x2:fp32 predict_bf16_gpt_4x2048x2048x4:gpt:4x2048x2048x4:bf16"
fi

. bench/layer_model.sh
model() {   # FFN BxLxMxhscale DTYPE
  layer_model bench/gpu_predict.sh predict "$1" "$2" "$3" "schedule { policy sequential; pipeline auto; }"
}

if $build; then
  mkdir -p "$DIR"
  for entry in $MODELS; do
    IFS=: read -r name ffn shape dtype <<<"$entry"
    model "$ffn" "$shape" "$dtype" >"$DIR/$name.moe"
    # The cluster only matters for the plan's r, which the sequential policy fixes at 1.
    "$MOEC" build "$DIR/$name.moe" --target cuda --cluster lang/clusters/testbed-a.cluster -v -o "$DIR/$name.cuda" \
      2>"$DIR/$name.build" || { cat "$DIR/$name.build"; echo "FAILED: moec build $DIR/$name.moe --target cuda"; exit 1; }
    echo "# $DIR/$name.cuda"
  done
  exit 0
fi

status=0
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-predict.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "# predicted (moec tune --target cuda, then the planner) against measured step times, $(hostname)"
profiles=""
for dtype in fp32 bf16; do
  out=$DIR/gpu.cluster; [ $dtype = bf16 ] && out=$DIR/gpu_bf16.cluster
  given=$profile; [ $dtype = bf16 ] && given=$profile_bf16
  if [ -n "$given" ]; then
    cp "$given" "$out" || status=1
    echo "# $dtype profile $given: $(grep -E '^  gemm ' "$out" | sed 's/^ *//'); $(grep -cE '^  (elementwise|elementwise_math|attention|attention_grad|update_adamw|update_sgd) ' "$out") kernel lines"
    continue
  fi
  args=(--quick); $quick || args=()
  if "$MOEC" tune --target cuda --dtype $dtype "${args[@]}" -o "$out" >"$WORK/tune.$dtype" 2>&1; then
    echo "# $dtype profile: $(grep -E '^  gemm ' "$out" | sed 's/^ *//')  ($(grep -m1 '^# gemm:' "$WORK/tune.$dtype" | cut -c9-90)...)"
  else
    echo "# moec tune --target cuda --dtype $dtype failed:"; sed 's/^/#   /' "$WORK/tune.$dtype" | tail -n 15
    status=1
  fi
done
pred() { head -n 1 "$WORK/ir" | grep -o "$1=[0-9.e+-]*" | cut -d= -f2; }   # a planner attribute of the module
# The fused program's prediction: the planner prices each element-wise op alone (before the fuse
# pass) and each parameter tensor's update as a launch of its own. The CUDA program runs the
# compiler's kernels (moec build -v: K kernels in the forward and backward moving B bytes) and one
# update launch; so beside the planner's step, step - the rest - update (moec plan -v's classes) +
# K * elementwise.alpha + elementwise.beta * B / 4 + update.alpha + update.beta * parameters, with
# the profile's lines ("-" when the profile has no kernel lines). Attention's kernels, which the
# predict models do not have, would be counted twice.
coef() { awk -v f="$2" '$1 == f && $2 == "{" { gsub(";", ""); print $4, $6; exit }' "$1"; }   # PROFILE FIELD: alpha beta
fused_pred() {   # PROFILE PLAN_OUT BUILD_OUT RUN_OUT STEP_PRED: the fused program's predicted step, or -
  local ea eb ua ub
  read -r ea eb < <(coef "$1" elementwise)
  read -r ua ub < <(coef "$1" update_adamw)
  [ -n "${ea:-}" ] && [ -n "${ua:-}" ] || { echo -; return; }
  awk -v ea="$ea" -v eb="$eb" -v ua="$ua" -v ub="$ub" -v step="$5" '
    FNR == 1 { file++ }
    file == 1 && /^# per class/ { for (i = 1; i < NF; i++) { if ($i == "update") upd = $(i + 1) + 0; if ($i == "rest") rest = $(i + 1) + 0 } }
    file == 2 && /^# launches: (forward|backward) / { k += $4; for (i = 1; i < NF; i++) if ($i == "move") mb += $(i + 1) }
    file == 3 && /^# [A-Za-z_0-9]+: [0-9]+ parameter tensors, [0-9]+ floats/ { p = $6 }
    END { if (!k || !p) { print "-"; exit } printf "%.3f\n", step - rest - upd + k * ea + eb * mb * 1e6 / 4 + ua + ub * p }' "$2" "$3" "$4"
}
printf '%-34s %6s %12s %12s %12s %12s %12s %9s %10s\n' model dtype "fwd pred" "bwd pred" "step pred" "fused pred" "step meas" \
  "meas/pred" "meas/fused"
for entry in $MODELS; do
  IFS=: read -r name ffn shape dtype <<<"$entry"
  prof=$DIR/gpu.cluster; [ "$dtype" = bf16 ] && prof=$DIR/gpu_bf16.cluster
  if [ ! -x "$DIR/$name.cuda" ] || [ ! -f "$DIR/$name.moe" ]; then
    echo "# $name: $DIR/$name.cuda or .moe is missing (bash bench/gpu_predict.sh --build on the build machine)"; status=1; continue
  fi
  [ -f "$prof" ] || { echo "# $name: no profile $prof"; status=1; continue; }
  if ! "$MOEC" dump-ir "$DIR/$name.moe" --cluster "$prof" --after=gradpart >"$WORK/ir" 2>"$WORK/err"; then
    echo "# $name: moec dump-ir failed: $(head -n 3 "$WORK/err")"; status=1; continue
  fi
  fwd=$(pred t_fwd_pred) bwd=$(pred t_bwd_pred) iter=$(pred t_iter_pred)
  if ! (cd "$WORK" && timeout 300 "$DIR/$name.cuda" --steps "$steps" >"$WORK/run" 2>&1 </dev/null); then
    echo "# $name: the binary failed: $(tail -n 5 "$WORK/run")"; status=1; continue
  fi
  meas=$(awk '$1 == "step" && $2 >= 3 { for (i = 1; i < NF; i++) if ($i == "time") print $(i + 1) }' "$WORK/run" |
         sort -g | awk '{a[NR] = $1} END { if (NR) print a[int((NR + 1) / 2)] }')
  if [ -z "$iter" ] || [ -z "$meas" ]; then
    echo "# $name: no prediction ('$iter') or no step times ('$meas')"; status=1; continue
  fi
  "$MOEC" plan -v "$DIR/$name.moe" --cluster "$prof" >"$WORK/plan" 2>&1 || true
  fused=$(fused_pred "$prof" "$WORK/plan" "$DIR/$name.build" "$WORK/run" "$iter")
  printf '%-34s %6s %12.3f %12.3f %12.3f %12s %12.3f %9.2f %10s\n' "$name" "$dtype" "$fwd" "$bwd" "$iter" "$fused" "$meas" \
    "$(awk -v a="$meas" -v b="$iter" 'BEGIN { print (b > 0 ? a / b : 0) }')" \
    "$(awk -v a="$meas" -v b="$fused" 'BEGIN { if (b + 0 > 0) printf "%.2f", a / b; else print "-" }')"
done
echo "# the prediction models the expert GEMMs (the profile's gemm fit or gemm_at grid), the collectives, and"
echo "# with the profile's kernel lines (moec tune --target cuda times them since round 6) the element-wise"
echo "# kernels, attention and the update, each op priced alone (before the fuse pass); meas/pred > 1 is what"
echo "# it leaves out (launch gaps, the data's upload; without kernel lines the gate, order, element-wise kernels"
echo "# and the optimizer too)"
[ $status -eq 0 ] && echo OK || echo FAILED
exit $status
