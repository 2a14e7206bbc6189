#!/usr/bin/env bash
# `moec tune` end to end (issue 5). On 4 ranks (profiled as 2 nodes of 2):
#   - `tune --quick -o T.cluster` finishes within 120 s (its duration is printed) and exits 0;
#   - its table has the 6 fits (gemm, alltoall, allgather, reducescatter intra-node; alltoall,
#     allreduce inter-node), each with alpha, beta and an r^2, and an OK footer;
#   - T.cluster holds the inter-node AlltoAll fit as `alltoall`, says how it was measured, and no
#     temporary file is left beside it;
#   - `moec build --cluster T.cluster tiny.moe` compiles, and `moec check` accepts a model whose
#     `cluster "...";` statement names it;
#   - `--model lang/models/mixtral.moe` times that model's expert GEMMs ([m,32]x[32,112] and
#     [m,112]x[112,32]), not the default shapes;
#   - a single process (no mpirun) is refused with exit status 2.
# Prints `ok    ...` / `FAIL  ...` lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-tune.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
TIMEOUT=${TUNE_TIMEOUT:-120}
failed=0

ok() { printf 'ok    %s\n' "$1"; }
bad() { failed=1; printf 'FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -n 40 | sed 's/^/      /'; }

# ---- tune --quick on 4 ranks ----
start=$(date +%s.%N)
timeout "$TIMEOUT" $MPIRUN -np 4 "$MOEC" tune --quick -o "$WORK/T.cluster" >"$WORK/out" 2>"$WORK/err" </dev/null
status=$?
seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
printf '# mpirun -np 4 moec tune --quick: %s s (limit %d s)\n' "$seconds" "$TIMEOUT"
if [ $status -eq 124 ]; then bad "tune --quick finishes within ${TIMEOUT} s" "$(tail -n 20 "$WORK/out")"
elif [ $status -ne 0 ]; then bad "tune --quick exits 0 (got $status)" "$(cat "$WORK/out" "$WORK/err" | tail -n 30)"
else ok "tune --quick on 4 ranks in $seconds s, exit 0"; fi

# The table: rows "  MODEL GROUP RANKS POINTS ALPHA BETA R2 IN-THE-PROFILE"; GROUP is
# each-rank, intra-node or inter-node here. Keep "model group alpha beta r2" per row.
awk '/^# model +group/ {t = 1; next} t && /^  [a-z]/ {print $1, $2, $5, $6, $7}' "$WORK/out" >"$WORK/rows"
want="gemm each-rank
alltoall intra-node
allgather intra-node
reducescatter intra-node
alltoall inter-node
allreduce inter-node"
got=$(awk '{print $1, $2}' "$WORK/rows")
if [ "$got" = "$want" ]; then ok "table has the 6 fits"
else bad "table has the 6 fits" "got:
$got
output:
$(cat "$WORK/out")"; fi
num='^-?[0-9]+(\.[0-9]+)?(e[-+][0-9]+)?$'
bad_rows=$(awk -v num="$num" '!($3 ~ num && $4 ~ num && $5 ~ num && $5 <= 1) {print}' "$WORK/rows")
if [ -s "$WORK/rows" ] && [ -z "$bad_rows" ]; then
  ok "every fit prints alpha, beta and r2 <= 1: $(awk '{printf "%s%s/%s r2 %s", (NR > 1 ? ", " : ""), $1, $2, $5}' "$WORK/rows")"
else bad "every fit prints alpha, beta and r2" "$bad_rows"; fi
if [ "$(tail -n 1 "$WORK/out")" = OK ]; then ok "OK footer"; else bad "OK footer" "$(tail -n 3 "$WORK/out")"; fi
if grep -q 'nodes assumed: 2 x 2 ranks' "$WORK/out"; then ok "4 ranks are profiled as 2 nodes of 2, and it says so"
else bad "4 ranks are profiled as 2 nodes of 2, and it says so" "$(grep '^# nodes' "$WORK/out")"; fi

# ---- the profile ----
T=$WORK/T.cluster
if [ -f "$T" ]; then
  ok "wrote T.cluster"
  if ls "$WORK"/T.cluster.tmp-* >/dev/null 2>&1; then bad "no temporary file left" "$(ls "$WORK")"; else ok "no temporary file left"; fi
  missing=""
  for line in '^# Measured by `moec tune`' '^#   mpirun -np 4 .*tune --quick -o' '^# 4 ranks; nodes assumed' \
              '^#   gemm .* r2 ' '^#   allreduce .* r2 ' 'intra-node$' '^cluster T \{' 'nodes 2;' 'gpus_per_node 2;'; do
    grep -Eq "$line" "$T" || missing="$missing
  $line"
  done
  if [ -z "$missing" ]; then ok "T.cluster says how it was measured (command, ranks, nodes, r2 of each fit)"
  else bad "T.cluster says how it was measured" "missing:$missing
$(cat "$T")"; fi
  # alltoall in the file = the inter-node fit of the table (clamped at 0), not the intra-node one.
  inter=$(awk '$1 == "alltoall" && $2 == "inter-node" {a = $3 < 0 ? 0 : $3; b = $4 < 0 ? 0 : $4; print a, b}' "$WORK/rows")
  file=$(sed -n 's/^ *alltoall *{ *alpha \([^;]*\); *beta \([^;]*\);.*/\1 \2/p' "$T")
  if [ -n "$inter" ] && [ -n "$file" ] && awk -v t="$inter" -v f="$file" 'BEGIN {
       split(t, x, " "); split(f, y, " ")
       for (i = 1; i <= 2; i++) { d = x[i] - y[i]; if (d < 0) d = -d; m = x[i] < 0 ? -x[i] : x[i]
         if (d > 1e-3 * m + 1e-300) exit 1 }
       exit 0 }'; then ok "alltoall in the profile is the inter-node fit ($file)"
  else bad "alltoall in the profile is the inter-node fit" "table: $inter, file: $file"; fi

  if "$MOEC" build --cluster "$T" lang/models/tiny.moe -o "$WORK/tiny" >"$WORK/b.out" 2>&1 && [ -x "$WORK/tiny" ]; then
    ok "moec build --cluster T.cluster tiny.moe"
  else bad "moec build --cluster T.cluster tiny.moe" "$(cat "$WORK/b.out")"; fi
  awk -v c="$T" '/^layer/ && !done {printf "cluster \"%s\";\n\n", c; done = 1} {print}' lang/models/tiny.moe >"$WORK/named.moe"
  if "$MOEC" check "$WORK/named.moe" >"$WORK/c.out" 2>&1; then ok "moec check on a model whose cluster statement names T.cluster"
  else bad "moec check on a model whose cluster statement names T.cluster" "$(cat "$WORK/c.out")"; fi
else
  bad "wrote T.cluster" "$(ls -la "$WORK")"
fi

# ---- --model: the model's own GEMM shapes ----
timeout "$TIMEOUT" $MPIRUN -np 4 "$MOEC" tune --quick --model lang/models/mixtral.moe >"$WORK/m.out" 2>"$WORK/m.err" </dev/null
status=$?
shapes=$(grep '^#   gemm shape' "$WORK/m.out")
if [ $status -eq 0 ] && echo "$shapes" | grep -q '\[m, 32\] x \[32, 112\]' && echo "$shapes" | grep -q '\[m, 112\] x \[112, 32\]' &&
   [ "$(echo "$shapes" | wc -l)" -eq 2 ] && grep -q '^  gemm .* 8 ' "$WORK/m.out"; then
  ok "tune --model mixtral.moe times its expert GEMMs: $(echo "$shapes" | sed 's/^#   gemm shape *//' | tr -s ' ' | paste -sd';')"
else bad "tune --model mixtral.moe times its expert GEMMs (exit $status)" "$(cat "$WORK/m.out" "$WORK/m.err" | head -n 30)"; fi
if grep -q 'M = embed 32' "$WORK/m.out" && grep -q 'ffn mixtral, H = hidden 112 / esp = 112' "$WORK/m.out"; then
  ok "tune --model explains the shapes (M = embed, H = hidden / esp)"
else bad "tune --model explains the shapes" "$(grep '^# gemm' "$WORK/m.out")"; fi

# ---- refusals ----
"$MOEC" tune --quick >"$WORK/one.out" 2>&1 </dev/null
status=$?
if [ $status -eq 2 ] && grep -q 'at least 2 ranks' "$WORK/one.out"; then ok "a single process is refused (exit 2)"
else bad "a single process is refused (exit 2, got $status)" "$(cat "$WORK/one.out")"; fi

exit $failed
