#!/usr/bin/env bash
# The planner inside `moec build` (passes/cost.c, degrees.c, gradpart.c) must not change the math:
# on 4 ranks (dp 2, mp 2, ep 2, esp 2), a 3-layer model whose layers differ (two of hidden 32,
# top-2; one of hidden 256, top-1) built with `pipeline auto; grad_partition auto;` on a
# cluster profile that makes overlap pay (tests/models/overlap.cluster) gives, for every policy,
# the losses of 3 steps and the --dump of step 1 (loss, output, whole gradients) of the plain
# sequential build to 1e-5 relative. Each case also checks what the passes decided: the
# degrees written on the functions (fsmoe: not the same for every layer and phase), the
# gradient AllReduces moved into the slots (count, slots, elements adding up to the whole
# dense gradient). `grad_partition chunk 40B` (pieces of 10 elements, offsets inside the
# gate's gradient) with explicit degrees is checked the same way.
# Prints `ok    ...` / `FAIL  ...` lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
. tests/mpi/common.sh
work gradpart
TIMEOUT=${GRADPART_TIMEOUT:-120}
CLUSTER=tests/models/overlap.cluster
P=4

model() {  # schedule-line
  blocks_4ranks gp
  cat <<EOF2
layer wide {
  moe {
    experts 4 { ffn gpt { hidden 256; act gelu; bias true; } }
    gate gshard { k 1; capacity 2.0; }
    order tutel;
  }
}
$1
EOF2
}
# Dense (world-replicated) gradient of the model: three gates of 16 x 4.
TOTAL=192


model "" >"$WORK/ref.moe"
if ! msg=$(run_model ref --cluster "$CLUSTER"); then bad "reference (sequential, r = 1, no partition)" "$msg"; exit 1; fi

# check_ir NAME POLICY MODE: the scheduled IR's degrees and gradient AllReduces.
check_ir() {
  local ir=$WORK/$1.ir
  "$MOEC" dump-ir "$WORK/$1.moe" --cluster "$CLUSTER" --after=schedule >"$ir" 2>"$WORK/err" || { cat "$WORK/err"; return 1; }
  local left placed slots degrees
  left=$(grep -c '= comm.allreduce %d[a-z0-9]* {.*group="world"' "$ir")
  placed=$(grep 'comm.allreduce_grad @' "$ir" | grep -o '[{ ]count=[0-9]*' | awk -F'count=' '{s += $2} END {print s + 0}')
  slots=$(grep -o 'slot="[a-z]*"' "$ir" | sort -u | tr -d '\n')
  degrees=$(grep -o '^func @[^(]*(.* attributes {.*r=[0-9]*' "$ir" | sed 's/^func @\([^(]*\)(.*[{ ,]r=\([0-9]*\)$/\1:\2/' | tr '\n' ' ')
  if [ "$left" != 0 ]; then echo "$left world AllReduces left where autodiff put them"; return 1; fi
  if [ "$placed" != "$TOTAL" ]; then echo "the placed AllReduces sum $placed elements, not $TOTAL"; return 1; fi
  case $2:$3 in
  fsmoe:auto)
    [ "$(tr ' ' '\n' <<<"$degrees" | grep -c .)" = 6 ] || { echo "degrees on $(tr ' ' '\n' <<<"$degrees" | grep -c .) functions, not 6: $degrees"; return 1; }
    [ "$(tr ' ' '\n' <<<"$degrees" | cut -d: -f2 | grep . | sort -u | wc -l)" -ge 3 ] || { echo "fsmoe chose fewer than 3 distinct degrees: $degrees"; return 1; }
    grep -q 'slot="moe"' "$ir" || { echo "no gradient in a MoE slot"; return 1; }
    # The MoE slot rides behind the first AlltoAll of the last chunk, on the inter stream.
    awk '/^func/ {a2a = ""} /comm.alltoall/ {a2a = $0} /slot="moe"/ { if (a2a == "" || $0 !~ /stream=inter/) bad = 1 } END {exit bad}' "$ir" ||
      { echo "a MoE-slot AllReduce is not after an AlltoAll on the inter stream"; return 1; } ;;
  fsmoe:chunk) [ "$(grep -c 'slot="moe"' "$ir")" -ge 12 ] || { echo "fewer than 12 pieces of 10 elements in MoE slots"; return 1; } ;;
  tutel-improved:auto) grep -q 'slot="dense"' "$ir" || { echo "no gradient in a dense slot"; return 1; } ;;
  esac
  echo "degrees $degrees; slots $slots; $placed elements placed"
}

for c in fsmoe:auto fsmoe-no-iio:auto tutel:auto tutel-improved:auto pipemoe-lina:auto sequential:auto fsmoe:chunk; do
  IFS=: read -r policy mode <<<"$c"
  if [ "$mode" = auto ]; then
    line="schedule { policy $policy; pipeline auto; grad_partition auto; }"
  else
    line="schedule { policy $policy; pipeline { forward 3; backward 5; } grad_partition chunk 40B; }"
  fi
  label="$policy, grad_partition $mode"
  model "$line" >"$WORK/case.moe"
  if ! what=$(check_ir case "$policy" "$mode"); then bad "$label: the scheduled IR" "$what"; continue; fi
  if ! msg=$(run_model case --cluster "$CLUSTER"); then bad "$label" "$msg"; continue; fi
  if ! same_losses "$WORK/ref.out" "$WORK/case.out"; then
    bad "$label: losses differ from the sequential build" "$(paste <(losses "$WORK/ref.out") <(losses "$WORK/case.out"))"; continue
  fi
  if result=$(compare_dumps "$WORK/ref.dump" "$WORK/case.dump"); then
    ok "$label: $what; losses and dump equal the sequential build: $result"
  else
    bad "$label: dump differs from the sequential build" "$result"
  fi
done
exit $failed
