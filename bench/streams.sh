#!/usr/bin/env bash
# Step time of the stream executor (runtime/streams.c) on a 4-rank model (dp 2, mp 2, ep 2,
# esp 2): sequential (r = 1, straight-line code) against fsmoe with r = 2 and 4, each fsmoe
# run both threaded (the default) and with MOERT_STREAMS=0 (same chunked task tables, run in
# program order on one thread), so the threading overhead and any overlap show separately.
# The planned builds (`pipeline auto; grad_partition auto;` with the profile measured on this
# machine, lang/clusters/cpu-2core.cluster) show the degrees the planner chose and the step time
# it predicted beside the measured one. Median step time of steps 3..N on rank 0. Reports only:
# on a machine with fewer cores than ranks x streams the threads are oversubscribed and
# overlap need not pay off.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${STEPS:-30}
P=4
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-streams.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN="mpirun --oversubscribe --allow-run-as-root --mca btl self,vader --bind-to none"

model() {  # schedule-line
  cat <<EOF
model streams { batch 8; seqlen 64; embed 128; seed 9; optimizer adamw { lr 0.001; } }
parallel { dp 2; mp 2; ep 2; esp 2; }
layer blk x 2 {
  moe {
    experts 4 { ffn gpt { hidden 512; act gelu; bias true; } }
    gate gshard { k 2; capacity 1.0; }
    order tutel;
  }
}
$1
EOF
}

echo "# stream executor, CPU backend, $(nproc) cores, $P ranks, $STEPS steps each (median of steps 3..N)"
CLUSTER=lang/clusters/cpu-2core.cluster
printf '%-34s %12s %14s  %s\n' case "step ms" "predicted ms" "degrees (planned builds)"
status=0
for c in sequential:1:1 fsmoe:2:2:threads fsmoe:2:2:0 fsmoe:4:4:threads fsmoe:4:4:0 sequential:auto:auto fsmoe:auto:auto tutel:auto:auto; do
  IFS=: read -r policy rf rb mode <<<"$c"
  sched=""; [ "$policy" != sequential ] && sched="schedule { policy $policy; pipeline { forward $rf; backward $rb; } }"
  label="$policy r=$rf/$rb"; [ -n "${mode:-}" ] && label="$label ${mode/#0/MOERT_STREAMS=0}"
  planned=""; predicted="-"; degrees=""
  if [ "$rf" = auto ]; then
    sched="schedule { policy $policy; pipeline auto; grad_partition auto; }"
    label="$policy planned"; planned="--cluster $CLUSTER"
  fi
  model "$sched" >"$WORK/m.moe"
  if [ -n "$planned" ]; then
    # shellcheck disable=SC2086
    "$BUILD/moec" dump-ir "$WORK/m.moe" $planned --after=gradpart >"$WORK/m.ir" 2>/dev/null
    predicted=$(head -n 1 "$WORK/m.ir" | grep -o 't_iter_pred=[0-9.e+-]*' | cut -d= -f2 | awk '{printf "%.3f", $1}')
    degrees=$(grep -o '^func @[^(]*(.* attributes {.*r=[0-9]*' "$WORK/m.ir" | sed 's/^func @\([^(]*\)(.*[{ ,]r=\([0-9]*\)$/\1:\2/' | tr '\n' ' ')
  fi
  # shellcheck disable=SC2086
  if ! "$BUILD/moec" build "$WORK/m.moe" $planned -o "$WORK/m" 2>"$WORK/err"; then
    echo "# $label: build failed: $(head -n 3 "$WORK/err")"; status=1; continue
  fi
  streams=1; [ "${mode:-}" = 0 ] && streams=0
  if ! (cd "$WORK" && MOERT_STREAMS=$streams timeout 300 $MPIRUN -x MOERT_STREAMS -np $P ./m --steps "$STEPS" >m.out 2>&1 </dev/null); then
    echo "# $label: run failed: $(tail -n 3 "$WORK/m.out")"; status=1; continue
  fi
  ms=$(grep '^step' "$WORK/m.out" | awk 'NR > 2 {print $(NF-1)}' | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
  printf '%-34s %12.3f %14s  %s\n' "$label" "$ms" "$predicted" "$degrees"
done
[ $status -eq 0 ] && echo OK || echo FAILED
exit $status
