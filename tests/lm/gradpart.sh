#!/usr/bin/env bash
# The planner with a language model (passes/cost.c, degrees.c, gradpart.c): tests/models/
# grad_lm_gpt.moe on dp2·mp2·ep2·esp2 (4 ranks) built with `policy fsmoe; pipeline auto;
# grad_partition auto;` (and with `grad_partition chunk 40B`) on tests/models/overlap.cluster
# gives the sequential build's losses of 3 steps and --dump of step 1 (logits, loss, every whole
# gradient) to 1e-5. The scheduled IR must show the dense gradients (attention, norms, mlp, head:
# AllReduces over DP) moved into the MoE layers' overlap slots: no DP or world AllReduce left,
# the placed pieces adding up to the dense gradient but the tied embedding's, which autodiff sums
# once, in place, after its second contribution (the head's, then the embedding's), and every
# in-place gradient AllReduce must wait for the param.grad ops that fill its buffer (a missing
# wait made the chunk build race with the tied embedding's accumulation: CI saw it).
# Prints ok/FAIL lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
case "$MOEC" in /*) ;; *) MOEC=$(pwd)/$MOEC ;; esac
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-lm-gradpart.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
. tests/mpi/common.sh
CLUSTER=$(pwd)/tests/models/overlap.cluster

model() {  # schedule-line
  sed "s/^layer block x 2/parallel { dp 2; mp 2; ep 2; esp 2; }\nlayer block x 2/" tests/models/grad_lm_gpt.moe
  echo "$1"
}
model "" >"$WORK/ref.moe"
model "schedule { policy fsmoe; pipeline auto; grad_partition auto; }" >"$WORK/auto.moe"
model "schedule { policy fsmoe; pipeline { forward 2; backward 2; } grad_partition chunk 40B; }" >"$WORK/chunk.moe"

# The elements of the dense gradients autodiff reduces over DP or the world (wte's is not among
# them: it is summed once, in place, by a comm.allreduce_grad of 32 x 16 elements).
"$MOEC" dump-ir "$WORK/ref.moe" --after=autodiff >"$WORK/ref.ir" 2>"$WORK/err" || { bad "lm gradpart: dump-ir" "$(cat "$WORK/err")"; exit 1; }
TOTAL=$(grep -E '= comm.allreduce .*group="(dp|world)"' "$WORK/ref.ir" | grep -v '^ *%dwte\.' |
        sed 's/^[^:]*: f32\[\([0-9, ]*\)\].*/\1/' | awk -F', ' '{n = 1; for (i = 1; i <= NF; i++) n *= $i; s += n} END {print s + 0}')

for v in ref auto chunk; do
  if ! "$MOEC" build "$WORK/$v.moe" --cluster "$CLUSTER" -o "$WORK/$v" 2>"$WORK/err"; then bad "lm gradpart: build $v" "$(cat "$WORK/err")"; exit 1; fi
  if ! (cd "$WORK" && timeout 120 $MPIRUN -np 4 "./$v" --steps 3 --dump "$v.dump" >"$v.out" 2>&1 </dev/null); then
    bad "lm gradpart: the $v program failed" "$(tail -n 10 "$WORK/$v.out")"; exit 1
  fi
done

for v in auto chunk; do
  ir=$WORK/$v.ir
  "$MOEC" dump-ir "$WORK/$v.moe" --cluster "$CLUSTER" --after=schedule >"$ir" 2>"$WORK/err"
  left=$(grep -Ec '= comm.allreduce .*group="(dp|world)"' "$ir")
  wte=$(grep -c 'comm.allreduce_grad @embed.wte {.*count=512,.*group="dp"' "$ir")
  placed=$(grep 'comm.allreduce_grad @.*slot=' "$ir" | grep -o '[{ ]count=[0-9]*' | awk -F'count=' '{s += $2} END {print s + 0}')
  moe_slots=$(grep -c 'comm.allreduce_grad @.*slot="moe"' "$ir")
  if [ "$left" = 0 ] && [ "$placed" = "$TOTAL" ] && [ "$moe_slots" -gt 0 ] && [ "$TOTAL" -gt 0 ] && [ "$wte" = 1 ]; then
    ok "lm gradpart $v: $placed of $TOTAL dense gradient elements placed ($moe_slots pieces in MoE slots), wte's summed once in place"
  else
    bad "lm gradpart $v: $left DP AllReduces left, $placed of $TOTAL elements placed, $moe_slots pieces in MoE slots, $wte in-place sums of wte"
  fi
  # The streams: an in-place AllReduce of a gradient waits for its param.grad ops (the copy or
  # the accumulation into the buffer it reduces), not only for the values they store.
  early=$(awk -f tests/lm/grad_waits.awk "$ir")
  if [ -z "$early" ]; then
    ok "lm gradpart $v: every gradient AllReduce waits for the param.grad ops of its parameter"
  else
    bad "lm gradpart $v: gradient AllReduces that do not wait for their param.grad" "$(echo "$early" | head -n 3)"
  fi
  if same_losses "$WORK/ref.out" "$WORK/$v.out" 1e-5 && why=$(compare_dumps "$WORK/ref.dump" "$WORK/$v.dump" 1e-5); then
    ok "lm gradpart $v: losses of 3 steps and the step-1 dump equal the sequential build's ($why)"
  else
    bad "lm gradpart $v: differs from the sequential build" "$(grep -h '^step' "$WORK/ref.out" "$WORK/$v.out"; compare_dumps "$WORK/ref.dump" "$WORK/$v.dump" 1e-5)"
  fi
done
exit $failed
