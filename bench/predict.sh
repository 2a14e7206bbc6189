#!/usr/bin/env bash
# make bench, prediction (issue 42): one `moec tune --quick` without --model on this host
# (2 ranks), then four models of other shapes (the MoE stack and the GPT-MoE language model of
# make cluster-bench, a Mixtral-style language model with dropless routing, make bench's mid-size
# language model), each on dp2·ep2 with the sequential schedule: the step `moec plan` predicts
# (policy sequential's iter_ms) from the profile as tuned (its GEMMs by shape, the gemm_at grid)
# beside the same profile without the grid (every GEMM on the one gemm line, as profiles were
# before), and the median measured step (steps 3..8 of rank 0).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=$PWD/$BUILD/moec
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-predict.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
echo "# prediction: one moec tune --quick without --model (2 ranks, $(nproc) cores), four models on dp2·ep2, sequential"
$MPIRUN -np 2 "$MOEC" tune --quick -o "$WORK/host.cluster" >"$WORK/tune.out" 2>&1 ||
  { echo "FAIL  predict: moec tune"; tail -n 5 "$WORK/tune.out"; exit 1; }
grep -v '^ *gemm_at ' "$WORK/host.cluster" >"$WORK/line.cluster"
grep '^# gemm grid' "$WORK/tune.out"
printf "%-12s %12s %22s %22s\n" model "measured ms" "predicted (by shape)" "predicted (one line)"
worst=0
for m in bench/cluster/stack.moe bench/cluster/gpt_moe.moe bench/cluster/mixtral_lm.moe bench/models/lm_mid.moe; do
  n=$(basename "$m" .moe)
  if grep -q '^parallel' "$m"; then
    sed 's/^parallel.*/parallel { dp 2; mp 1; ep 2; esp 1; }/; s/^schedule.*/schedule { policy sequential; }/' "$m" >"$WORK/$n.moe"
  else
    sed 's/^layer block/parallel { dp 2; mp 1; ep 2; esp 1; }\nlayer block/' "$m" >"$WORK/$n.moe"
  fi
  "$MOEC" build "$WORK/$n.moe" -o "$WORK/$n" >/dev/null 2>"$WORK/$n.err" || { echo "FAIL  predict: build $n"; cat "$WORK/$n.err"; exit 1; }
  (cd "$WORK" && $MPIRUN -np 2 ./"$n" --steps 8 >"$n.out" 2>&1) || { echo "FAIL  predict: run $n"; tail -n 3 "$WORK/$n.out"; exit 1; }
  meas=$(grep '^step' "$WORK/$n.out" | grep -o 'time [0-9.]*' | awk 'NR > 2 {print $2}' | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
  pred() { "$MOEC" plan "$WORK/$n.moe" --cluster "$1" 2>/dev/null | awk '$1 == "sequential" {print $4}'; }
  ps=$(pred "$WORK/host.cluster") pl=$(pred "$WORK/line.cluster")
  printf "%-12s %12.1f %22s %22s\n" "$n" "$meas" "$(awk -v p="$ps" -v m="$meas" 'BEGIN {printf "%.1f (%.2fx)", p, p / m}')" \
    "$(awk -v p="$pl" -v m="$meas" 'BEGIN {printf "%.1f (%.2fx)", p, p / m}')"
  worst=$(awk -v w="$worst" -v p="$ps" -v m="$meas" 'BEGIN {e = p / m - 1; if (e < 0) e = -e; print (e > w ? e : w)}')
done
echo "# target (issue 42, one host): every prediction within 15 %: the largest miss $(awk -v w="$worst" 'BEGIN {printf "%.1f %% (%s)", 100 * w, w <= 0.15 ? "met" : "MISSED"}')"
