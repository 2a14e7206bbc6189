#!/usr/bin/env bash
# Predicting models from one profile of the cluster (issue 42): one `moec tune --quick` without
# --model, then four models of other shapes (the MoE stack and the GPT-MoE language model of
# make cluster-bench, a Mixtral-style language model with dropless routing, make bench's mid-size
# language model), each with every rank in dp and ep and the sequential schedule: the step
# `moec plan` predicts (policy sequential's iter_ms) from the profile as tuned (its GEMMs by shape,
# the gemm_at grid) beside the same profile without the grid (every GEMM on the one gemm line, as
# profiles were before), and the median measured step (steps 3..8 of rank 0). Then, per model,
# the step per class of work, predicted (`moec plan -v`) beside measured (the binary's --profile),
# so that a miss can be located.
#
#   bash bench/predict.sh                       (make bench) this host, 2 ranks
#   bash bench/predict.sh --cluster 2x1 [--rate 600mbit] [--out DIR]
#   bash bench/predict.sh --cluster 2x2 [--rate 300mbit] [--out DIR]
#                                               (make cluster-bench) the emulated cluster of
#                                               tests/cluster/cluster.sh: 2 nodes x 1 or 2 ranks,
#                                               one thread a rank, the link at RATE
#
# The target (issue 42): every prediction within 15 % on one host and on 2 x 1, within 25 % on
# 2 x 2. The last line says whether it holds; exit status 1 only when something could not run.
# With --out the table is also appended to DIR/predict.md.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=$PWD/$BUILD/moec
CLUSTER_SH=$PWD/tests/cluster/cluster.sh
cluster="" rate="" out="" ROUNDS=${PREDICT_ROUNDS:-3}
while [ $# -gt 0 ]; do
  case $1 in
    --cluster) cluster=$2; shift ;;
    --rate) rate=$2; shift ;;
    --out) out=$2; shift ;;
    *) echo "usage: bench/predict.sh [--cluster 2x1|2x2] [--rate R] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-predict.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
case $cluster in
  "") ranks=2 target=15 where="this host (2 ranks, $(nproc) cores)" ;;
  2x1) ranks=2 rpn=1 target=15 rate=${rate:-600mbit} ;;
  2x2) ranks=4 rpn=2 target=25 rate=${rate:-300mbit} ;;
  *) echo "bench/predict.sh: --cluster 2x1 or 2x2, not '$cluster'" >&2; exit 2 ;;
esac
if [ -n "$cluster" ]; then
  if ! why=$("$CLUSTER_SH" check); then echo "# predict $cluster: skipped: no network namespaces here: $why"; exit 0; fi
  export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  where="the emulated cluster $cluster (2 nodes x $rpn ranks, one thread a rank, links at $rate)"
  launch() { "$CLUSTER_SH" run 2 "$rpn" "$rate" -- "$@"; }
  tune_args=(--gpus-per-node "$rpn")
else
  MPIRUN="mpirun --allow-run-as-root --oversubscribe"
  launch() { $MPIRUN -np "$ranks" "$@"; }
  tune_args=()
fi
{
echo "# prediction on $where: one moec tune --quick without --model, four models on dp$ranks·ep$ranks, sequential; measured: the median step of $ROUNDS rounds"
(cd "$WORK" && launch "$MOEC" tune --quick "${tune_args[@]}" -o "$WORK/host.cluster" >"$WORK/tune.out" 2>&1) ||
  { echo "FAIL  predict: moec tune"; tail -n 5 "$WORK/tune.out"; exit 1; }
grep -v '^ *gemm_at ' "$WORK/host.cluster" >"$WORK/line.cluster"
grep '^# gemm grid' "$WORK/tune.out"
worst=0 rows=() classes=()
models="bench/cluster/stack.moe bench/cluster/gpt_moe.moe bench/cluster/mixtral_lm.moe bench/models/lm_mid.moe"
for m in $models; do
  n=$(basename "$m" .moe)
  layout="parallel { dp $ranks; mp 1; ep $ranks; esp 1; }"
  if grep -q '^parallel' "$m"; then
    sed "s/^parallel.*/$layout/; s/^schedule.*/schedule { policy sequential; }/" "$m" >"$WORK/$n.moe"
  else
    sed "s/^layer block/$layout\nlayer block/" "$m" >"$WORK/$n.moe"
  fi
  "$MOEC" build "$WORK/$n.moe" -o "$WORK/$n" >/dev/null 2>"$WORK/$n.err" || { echo "FAIL  predict: build $n"; cat "$WORK/$n.err"; exit 1; }
done
# ROUNDS rounds, each running the four models in turn (this machine's speed drifts by 10 % over
# minutes: one run of each measured one spell); a model's step is the median of steps 3..8 of all
# its runs, its classes its last run's.
for round in $(seq "$ROUNDS"); do
  for m in $models; do
    n=$(basename "$m" .moe)
    (cd "$WORK" && launch "$WORK/$n" --steps 8 --profile >"$n.out" 2>&1) || { echo "FAIL  predict: run $n"; tail -n 3 "$WORK/$n.out"; exit 1; }
    grep '^step' "$WORK/$n.out" | grep -o 'time [0-9.]*' | awk 'NR > 2 {print $2}' >>"$WORK/$n.steps"
  done
done
for m in $models; do
  n=$(basename "$m" .moe)
  meas=$(sort -g "$WORK/$n.steps" | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
  pred() { "$MOEC" plan "$WORK/$n.moe" --cluster "$1" -v 2>/dev/null >"$WORK/$n.plan"; awk '$1 == "sequential" {print $4}' "$WORK/$n.plan"; }
  pl=$(pred "$WORK/line.cluster") ps=$(pred "$WORK/host.cluster")
  rows+=("$(printf "%-12s %12.1f %22s %22s" "$n" "$meas" "$(awk -v p="$ps" -v m="$meas" 'BEGIN {printf "%.1f (%.2fx)", p, p / m}')" \
    "$(awk -v p="$pl" -v m="$meas" 'BEGIN {printf "%.1f (%.2fx)", p, p / m}')")")
  worst=$(awk -v w="$worst" -v p="$ps" -v m="$meas" 'BEGIN {e = p / m - 1; if (e < 0) e = -e; print (e > w ? e : w)}')
  # per class: "NAME VALUE" pairs of the plan's line (by shape) and of the run's --profile line
  pc=$(sed -n 's/^# per class ([^:]*: //p' "$WORK/$n.plan" | sed 's/; sum.*//')
  mc=$(sed -n 's/^# profile: per class, ms a step: //p' "$WORK/$n.out" | sed 's/ (element-wise.*//')
  classes+=("$(awk -v model="$n" -v p="$pc" -v m="$mc" 'BEGIN {
      np = split(p, P, ", "); nm = split(m, M, ", ")
      for (i = 1; i <= nm; i++) { v = M[i]; sub(/.* /, "", v); k = M[i]; sub(/ [^ ]*$/, "", k); meas[k] = v }
      line = sprintf("%-12s", model)
      for (i = 1; i <= np; i++) { v = P[i]; sub(/.* /, "", v); k = P[i]; sub(/ [^ ]*$/, "", k)
        if (k == "AlltoAll" || k == "AllGather" || k == "ReduceScatter" || k == "AllReduce" || v + 0 > 0 || meas[k] + 0 > 0)
          line = line sprintf(" | %s %.0f/%.0f", k, v, meas[k]) }
      print line }')")
done
printf "%-12s %12s %22s %22s\n" model "measured ms" "predicted (by shape)" "predicted (one line)"
for r in "${rows[@]}"; do echo "$r"; done
echo "# per class, ms a step, predicted/measured (moec plan -v beside the binary's --profile; collectives summed"
echo "# over their calls, 'the rest' measured as the step less the GEMMs, attention, update and unhidden communication):"
for c in "${classes[@]}"; do echo "$c"; done
echo "# target (issue 42, ${cluster:-one host}): every prediction within $target %: the largest miss $(awk -v w="$worst" -v t="$target" 'BEGIN {printf "%.1f %% (%s)", 100 * w, w <= t / 100 ? "met" : "MISSED"}')"
} | if [ -n "$out" ]; then mkdir -p "$out" && tee -a "$out/predict.md"; else cat; fi
exit "${PIPESTATUS[0]}"
