#!/usr/bin/env bash
# make cluster-bench, pipeline stages (issue 62): a language model on the emulated 2 x 1 cluster
# (tests/cluster/cluster.sh: two network namespaces, one rank each, the link shaped to RATE) at
# pp 2 with 4 and 8 microbatches, and the same global batch on dp 2 (ep 2) over the same link.
#
#   1. `moec tune --quick --gpus-per-node 1` on the cluster writes its profile (GEMMs, collectives
#      and the point-to-point messages between stages);
#   2. each configuration is built with that profile: `moec build -v` prints its planned step
#      (pp: "# pipeline: planned step", the stages' schedule simulated, and the bubble, the
#      stages' simulated mean wait; dp: the sequential policy's "# pipeline-plan sequential step");
#   3. all of them run in turn, ROUNDS rounds of `--steps STEPS --profile`: a configuration's
#      measured step is the median of its rounds' median steps; with stages, the measured bubble
#      is the mean over the stages of the share of the step each waited for the others (the
#      fill and drain, and the messages not hidden).
# Prints a table (predicted, measured, error, bubble predicted beside measured) and a sentence on
# pp 2 against dp 2; with --out DIR also writes DIR/pipeline.md. The target: each prediction
# within 15 %.
#
# Options: --rate R (default 600mbit, the cluster bench's communication-heavy link), --rounds N
# (3), --steps N (6), --out DIR. Needs root and network namespaces; skips with a line otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=$PWD/$BUILD/moec
CLUSTER=$PWD/tests/cluster/cluster.sh
RATE=600mbit ROUNDS=3 STEPS=6 OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE=$2; shift ;;
    --rounds) ROUNDS=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --out) OUT=$2; shift ;;
    *) echo "bench/cluster/pipeline.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
  shift
done
if ! why=$("$CLUSTER" check); then
  echo "# pipeline bench: skipped: network namespaces cannot be made here: $why"
  exit 0
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-pipeline-bench.XXXXXX")
trap '"$CLUSTER" down >/dev/null 2>&1; rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

# The cluster bench's language model (bench/cluster/gpt_moe.moe) with 4 blocks, a global batch of
# 8 windows: dp 2 holds 4 a rank, pp 2 all 8 on each stage in M microbatches.
model() {   # NAME BATCH PARALLEL
  sed "s/batch 4;/batch $2;/; s/^parallel .*/$3/; s/^layer block x 2/layer block x 4/; s/groups 2;/groups 1;/" \
    bench/cluster/gpt_moe.moe >"$WORK/$1.moe"
}
model dp2 4 "parallel { dp 2; mp 1; ep 2; esp 1; }"
model pp2m4 8 "parallel { pp 2; microbatches 4; }"
model pp2m8 8 "parallel { pp 2; microbatches 8; }"
CONFIGS="dp2 pp2m4 pp2m8"

(cd "$WORK" && "$CLUSTER" run 2 1 "$RATE" -- "$MOEC" tune --quick --gpus-per-node 1 -o "$WORK/c.cluster" >tune.out 2>&1) ||
  { echo "FAIL  pipeline bench: moec tune"; tail -n 5 "$WORK/tune.out"; exit 1; }
for c in $CONFIGS; do
  "$MOEC" build "$WORK/$c.moe" --cluster "$WORK/c.cluster" -v -o "$WORK/$c" >/dev/null 2>"$WORK/$c.build" ||
    { echo "FAIL  pipeline bench: build $c"; tail -n 5 "$WORK/$c.build"; exit 1; }
done
for r in $(seq "$ROUNDS"); do
  for c in $CONFIGS; do
    (cd "$WORK" && "$CLUSTER" run 2 1 "$RATE" -- "./$c" --steps "$STEPS" --profile >"$c.run$r" 2>&1) ||
      { echo "FAIL  pipeline bench: run $c"; tail -n 5 "$WORK/$c.run$r"; exit 1; }
  done
done

median() { sort -g | awk '{a[n++] = $1} END {print n ? a[int((n - 1) / 2)] : ""}'; }
{
  echo "# pipeline stages on the emulated 2 x 1 cluster, links at $RATE: gpt_moe (4 blocks, vocab 2048, L 512, M 384) at a global batch of 8; $ROUNDS rounds of $STEPS steps, the median step"
  echo
  echo "| configuration | predicted step (ms) | measured step (ms) | error | bubble predicted | bubble measured | waits per stage, % |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: | --- |"
  worst=0
  for c in $CONFIGS; do
    if [ "$c" = dp2 ]; then
      pred=$(awk '$2 == "pipeline-plan" && $3 == "sequential" && $4 == "step" {print $5 + $6}' "$WORK/$c.build" | tail -n 1)
      bub_p="-"
    else
      pred=$(sed -n 's/^# pipeline: planned step \([0-9.]*\) ms.*/\1/p' "$WORK/$c.build" | tail -n 1)
      bub_p=$(sed -n 's/^# pipeline: .* bubble \([0-9.]*\) %.*/\1 %/p' "$WORK/$c.build" | head -n 1)
    fi
    meas=$(for r in $(seq "$ROUNDS"); do sed -n 's/.*median whole step \([0-9.]*\) ms.*/\1/p' "$WORK/$c.run$r"; done | median)
    waits=$(sed -n 's/^# profile: stage \([0-9]\): .* (\([0-9.]*\) %) waiting.*/\1:\2/p' "$WORK/$c.run$ROUNDS" | paste -sd' ')
    planned=$(sed -n 's/^# pipeline: .* simulated: stage \([^;]*\);.*/\1/p' "$WORK/$c.build" | head -n 1 |
              awk '{for (i = 1; i < NF; i += 3) printf "%s%s:%s", (i > 1 ? " " : ""), $i, $(i + 1)}')
    [ -n "$waits" ] && waits="$waits (planned ${planned:-?})"
    bub_m=$(sed -n 's/^# profile: stage [0-9]: .* (\([0-9.]*\) %) waiting.*/\1/p' "$WORK/$c.run$ROUNDS" |
            awk '{s += $1; n++} END {if (n) printf "%.1f %%", s / n; else print "-"}')
    err=$(awk -v p="$pred" -v m="$meas" 'BEGIN { if (p > 0 && m > 0) printf "%+.1f %%", 100 * (p - m) / m; else print "-" }')
    worst=$(awk -v p="$pred" -v m="$meas" -v w="$worst" 'BEGIN { e = (p > 0 && m > 0) ? (p - m) / m : 1; if (e < 0) e = -e; print (100 * e > w ? 100 * e : w) }')
    echo "| $c | ${pred:--} | ${meas:--} | $err | $bub_p | $bub_m | ${waits:--} |"
    eval "meas_$c=\${meas:-0}"
  done
  echo
  faster=$(awk -v d="$meas_dp2" -v p="$meas_pp2m8" 'BEGIN { if (d <= 0 || p <= 0) print "unknown"; else if (p < d) printf "pp 2 (8 microbatches) is %.2fx faster than dp 2", d / p; else printf "dp 2 is %.2fx faster than pp 2 (8 microbatches)", p / d }')
  echo "pp 2 against dp 2 on the same two nodes at $RATE: $faster."
  echo "worst prediction error $(printf '%.1f' "$worst") % (target: within 15 %): $(awk -v w="$worst" 'BEGIN { print (w <= 15 ? "holds" : "misses") }')"
} | tee "$WORK/pipeline.md"
[ -n "$OUT" ] && mkdir -p "$OUT" && cp "$WORK/pipeline.md" "$OUT/pipeline.md"
exit 0
