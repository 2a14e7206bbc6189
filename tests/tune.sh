#!/usr/bin/env bash
# `moec tune` end to end (issue 5). On 4 ranks (profiled as 2 nodes of 2):
#   - `tune --quick -o T.cluster` finishes within 120 s (its duration is printed) and exits 0;
#   - its table has the 9 fits (gemm; alltoall, allgather, reducescatter, allreduce intra-node;
#     alltoall, allreduce inter-node; p2p intra-node and inter-node), each with alpha, beta and an
#     r^2, the elementwise,
#     attention (forward and backward), element-wise math and update (AdamW, SGD) fits and the
#     stream hand-off, and an OK footer;
#   - every collective's alpha is a measurement (its smallest size's time, above 0), none clamped;
#   - T.cluster holds the inter-node AlltoAll fit as `alltoall`, the intra-node AlltoAll and
#     AllReduce fits as `alltoall_intra` and `allreduce_intra`, the point-to-point fits as `p2p` and
#     `p2p_intra`, `memory` = this host's MemTotal / 2
#     ranks per node (with a comment saying so), says how it was measured, and no temporary file is
#     left beside it;
#   - T.cluster holds the grid of GEMM shapes (`gemm_at M K N MS`, m 4..4096, k and n 64..4096);
#     a profile tuned with --model has none (the model's own `gemm` line prices it);
#   - `moec build --cluster T.cluster tiny.moe` compiles, and `moec check` accepts a model whose
#     `cluster "...";` statement names it (the profile parses back);
#   - 2 ranks with --gpus-per-node 1 (no intra-node group) and `--model lang/models/mixtral.moe`
#     (one run): the profile has `memory` (all of MemTotal), no alltoall_intra or allreduce_intra
#     (a comment says why), and parses back; the run times that model's expert GEMMs
#     ([m,32]x[32,112] and [m,112]x[112,32]), not the default shapes;
#   - a single process (no mpirun) is refused with exit status 2, and --dtype bf16 without
#     --target cuda too; the real --target cuda program without a GPU exits 1 and says so.
# tests/tune_cuda.sh has --target cuda on the fake device (its times say nothing, so it runs beside
# other suites; this one times the machine and runs alone).
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
# tune measures this machine as its programs run on it: with the kernels OpenBLAS picks for the CPU.
# A forced slower class (OPENBLAS_CORETYPE=Prescott make test: SSE3 GEMMs, 4-5x slower) would
# measure a slower machine and miss the time bound, which is about tune, not about the kernels.
unset OPENBLAS_CORETYPE
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
allreduce intra-node
alltoall inter-node
allreduce inter-node
p2p intra-node
p2p inter-node
elementwise each-rank
attention each-rank
attention_grad each-rank
elementwise_math each-rank
update_adamw each-rank
update_sgd each-rank
handoff each-rank"
got=$(awk '{print $1, $2}' "$WORK/rows")
if [ "$got" = "$want" ]; then ok "table has the 9 fits and the kernels' (element-wise, math, attention, its backward, the updates)"
else bad "table has the 9 fits and the kernels'" "got:
$got
output:
$(cat "$WORK/out")"; fi
num='^-?[0-9]+(\.[0-9]+)?(e[-+][0-9]+)?$'
bad_rows=$(awk -v num="$num" '$1 != "handoff" && !($3 ~ num && $4 ~ num && $5 ~ num && $5 <= 1) {print}' "$WORK/rows")
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
              '^#   gemm .* r2 ' '^#   allreduce .* r2 ' 'alltoall_intra and allreduce_intra the intra-node ones\.$' '^cluster T \{' 'nodes 2;' 'gpus_per_node 2;'; do
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
  # alltoall_intra and allreduce_intra = the intra-node AlltoAll and AllReduce fits of the table.
  for f in alltoall allreduce; do
    table=$(awk -v f=$f '$1 == f && $2 == "intra-node" {a = $3 < 0 ? 0 : $3; b = $4 < 0 ? 0 : $4; print a, b}' "$WORK/rows")
    file=$(sed -n "s/^ *${f}_intra *{ *alpha \([^;]*\); *beta \([^;]*\);.*/\1 \2/p" "$T")
    if [ -n "$table" ] && [ -n "$file" ] && awk -v t="$table" -v f="$file" 'BEGIN {
         split(t, x, " "); split(f, y, " ")
         for (i = 1; i <= 2; i++) { d = x[i] - y[i]; if (d < 0) d = -d; m = x[i] < 0 ? -x[i] : x[i]
           if (d > 1e-3 * m + 1e-300) exit 1 }
         exit 0 }'; then ok "${f}_intra in the profile is the intra-node $f fit ($file)"
    else bad "${f}_intra in the profile is the intra-node $f fit" "table: $table, file: $file
$(grep -v '^#' "$T")"; fi
  done
  # p2p and p2p_intra = the inter-node and intra-node point-to-point fits of the table.
  for g in inter:p2p intra:p2p_intra; do
    table=$(awk -v g="${g%%:*}-node" '$1 == "p2p" && $2 == g {a = $3 < 0 ? 0 : $3; b = $4 < 0 ? 0 : $4; print a, b}' "$WORK/rows")
    file=$(sed -n "s/^ *${g#*:} *{ *alpha \([^;]*\); *beta \([^;]*\);.*/\1 \2/p" "$T")
    if [ -n "$table" ] && [ -n "$file" ] && awk -v t="$table" -v f="$file" 'BEGIN {
         split(t, x, " "); split(f, y, " ")
         for (i = 1; i <= 2; i++) { d = x[i] - y[i]; if (d < 0) d = -d; m = x[i] < 0 ? -x[i] : x[i]
           if (d > 1e-3 * m + 1e-300) exit 1 }
         exit 0 }'; then ok "${g#*:} in the profile is the ${g%%:*}-node point-to-point fit ($file)"
    else bad "${g#*:} in the profile is the ${g%%:*}-node point-to-point fit" "table: $table, file: $file"; fi
  done
  # memory = MemTotal of this host (every rank runs here) / 2 ranks per node, in bytes.
  memtotal=$(awk '$1 == "MemTotal:" {printf "%.0f", $2 * 1024}' /proc/meminfo)
  want_mem=$(awk -v m="$memtotal" 'BEGIN {printf "%.0f", int(m / 2)}')
  mem_line=$(grep -E '^ *memory [0-9]+;' "$T")
  if [ -n "$memtotal" ] && [ "$(echo "$mem_line" | sed -n 's/^ *memory \([0-9]*\);.*/\1/p')" = "$want_mem" ] &&
     echo "$mem_line" | grep -q '# MemTotal .* / 2 ranks on the node'; then
    ok "memory in the profile is MemTotal / 2 ranks per node: $(echo "$mem_line" | sed 's/^ *//')"
  else bad "memory in the profile is MemTotal / 2 ranks per node ($want_mem)" "$(grep -v '^#' "$T")"; fi
  # Every collective's alpha is its smallest size's time (a measurement, above 0), never a
  # negative intercept clamped to 0; the profile prices element-wise ops and stream hand-offs.
  alphas=$(sed -n 's/^ *\(alltoall\|allgather\|reducescatter\|allreduce\|alltoall_intra\|allreduce_intra\) *{ *alpha \([^;]*\);.*/\2/p' "$T" | tr '\n' ' ')
  if [ "$(echo $alphas | wc -w)" = 6 ] && awk -v a="$alphas" 'BEGIN { n = split(a, x, " "); for (i = 1; i <= n; i++) if (!(x[i] > 0)) exit 1 }' &&
     ! grep -q 'clamped' "$T" && grep -q '^ *elementwise *{ *alpha [0-9.e+-]*; *beta [0-9.e+-]*; }' "$T" &&
     grep -q '^ *handoff [0-9.e+-]*;' "$T" && grep -q '^ *attention *{ *alpha [0-9.e+-]*; *beta [0-9.e+-]*; }' "$T" &&
     [ "$(grep -cE '^ *(attention_grad|elementwise_math|update_adamw|update_sgd) +\{ *alpha [0-9.e+-]*; *beta [0-9.e+-]*; \}' "$T")" -eq 4 ]; then
    ok "every collective's alpha is measured above 0 ($alphas), none clamped; elementwise, attention (and its backward), element-wise math, the updates and handoff are in the profile"
  else bad "collective alphas measured, elementwise and handoff in the profile" "$(grep -v '^#' "$T")"; fi

  # The grid of GEMM shapes: m from 4 to 4096 rows, k and n from 64 to 4096, every time above 0,
  # and the table's line about it; the planner prices a model's GEMMs from them.
  grid=$(grep -c '^ *gemm_at [0-9]* [0-9]* [0-9]* [0-9.e+-]*;' "$T")
  if [ "$grid" -ge 60 ] && grep -q '^ *gemm_at 4 64 64 ' "$T" && grep -q '^ *gemm_at 4096 64 64 ' "$T" &&
     awk '$1 == "gemm_at" {sub(";", "", $5); if (!($5 > 0)) exit 1}' "$T" && grep -q '^# gemm grid: [0-9]* shapes' "$WORK/out"; then
    ok "the profile holds the grid of GEMM shapes ($grid gemm_at lines, m 4..4096, k and n 64..4096)"
  else bad "the profile holds the grid of GEMM shapes" "$(grep -c gemm_at "$T") lines; $(grep 'gemm grid' "$WORK/out")"; fi

  if "$MOEC" build --cluster "$T" lang/models/tiny.moe -o "$WORK/tiny" >"$WORK/b.out" 2>&1 && [ -x "$WORK/tiny" ]; then
    ok "moec build --cluster T.cluster tiny.moe"
  else bad "moec build --cluster T.cluster tiny.moe" "$(cat "$WORK/b.out")"; fi
  awk -v c="$T" '/^layer/ && !done {printf "cluster \"%s\";\n\n", c; done = 1} {print}' lang/models/tiny.moe >"$WORK/named.moe"
  if "$MOEC" check "$WORK/named.moe" >"$WORK/c.out" 2>&1; then ok "moec check on a model whose cluster statement names T.cluster"
  else bad "moec check on a model whose cluster statement names T.cluster" "$(cat "$WORK/c.out")"; fi
else
  bad "wrote T.cluster" "$(ls -la "$WORK")"
fi

# ---- --model, on one rank per node: the model's own GEMM shapes; no intra-node group, no
# alltoall_intra / allreduce_intra (one run of both: --model leaves the grid out, the run's longest part) ----
timeout "$TIMEOUT" $MPIRUN -np 2 "$MOEC" tune --quick --gpus-per-node 1 --model lang/models/mixtral.moe -o "$WORK/P1.cluster" \
  >"$WORK/m.out" 2>"$WORK/m.err" </dev/null
status=$?
P1=$WORK/P1.cluster
awk -v c="$P1" '/^layer/ && !done {printf "cluster \"%s\";\n\n", c; done = 1} {print}' lang/models/tiny.moe >"$WORK/named1.moe"
memtotal=$(awk '$1 == "MemTotal:" {printf "%.0f", $2 * 1024}' /proc/meminfo)
if [ $status -eq 0 ] && [ -f "$P1" ] && grep -q '^  gpus_per_node 1;' "$P1" && grep -Eq "^  memory $memtotal;  # MemTotal .* / 1 rank on the node" "$P1" &&
   ! grep -Eq '^ *(alltoall_intra|allreduce_intra) *\{' "$P1" &&
   grep -q '^  # no alltoall_intra, allreduce_intra: one rank per node' "$P1" &&
   grep -Eq '^  (alltoall|allreduce) +all-ranks .* no \(one rank per node\)$' "$WORK/m.out" &&
   "$MOEC" check "$WORK/named1.moe" >"$WORK/c1.out" 2>&1; then
  ok "one rank per node (--gpus-per-node 1): memory is all of MemTotal, no alltoall_intra/allreduce_intra (a comment says why), the profile parses back"
else bad "one rank per node (--gpus-per-node 1), exit $status" "$(cat "$WORK/m.err" "$WORK/c1.out" 2>/dev/null; grep -v '^#  ' "$P1" 2>/dev/null | tail -n 25)"; fi

shapes=$(grep '^#   gemm shape' "$WORK/m.out")
if [ $status -eq 0 ] && echo "$shapes" | grep -q '\[m, 32\] x \[32, 112\]' && echo "$shapes" | grep -q '\[m, 112\] x \[112, 32\]' &&
   [ "$(echo "$shapes" | wc -l)" -eq 2 ] && grep -q '^  gemm .* 12 ' "$WORK/m.out"; then
  ok "tune --model mixtral.moe times its expert GEMMs: $(echo "$shapes" | sed 's/^#   gemm shape *//' | tr -s ' ' | paste -sd';')"
else bad "tune --model mixtral.moe times its expert GEMMs (exit $status)" "$(cat "$WORK/m.out" "$WORK/m.err" | head -n 30)"; fi
if grep -q 'M = embed 32' "$WORK/m.out" && grep -q 'ffn mixtral, H = hidden 112 / esp = 112' "$WORK/m.out"; then
  ok "tune --model explains the shapes (M = embed, H = hidden / esp)"
else bad "tune --model explains the shapes" "$(grep '^# gemm' "$WORK/m.out")"; fi
if [ -f "$P1" ] && grep -q '^  gemm  *{ alpha ' "$P1" && ! grep -q 'gemm_at' "$P1" && ! grep -q 'gemm grid' "$WORK/m.out"; then
  ok "tune --model writes no grid of GEMM shapes: the model's own line prices it"
else bad "tune --model writes no grid of GEMM shapes" "$(grep -c 'gemm_at' "$P1") gemm_at lines; $(grep '^  gemm ' "$P1")"; fi

# ---- refusals ----
"$MOEC" tune --quick >"$WORK/one.out" 2>&1 </dev/null
status=$?
if [ $status -eq 2 ] && grep -q 'at least 2 ranks' "$WORK/one.out"; then ok "a single process is refused (exit 2)"
else bad "a single process is refused (exit 2, got $status)" "$(cat "$WORK/one.out")"; fi
"$MOEC" tune --quick --dtype bf16 >"$WORK/bf.out" 2>&1 </dev/null
status=$?
if [ $status -eq 2 ] && grep -q 'needs --target cuda' "$WORK/bf.out"; then ok "--dtype bf16 without --target cuda is refused (exit 2)"
else bad "--dtype bf16 without --target cuda is refused (exit 2, got $status)" "$(cat "$WORK/bf.out")"; fi

# The real program without a GPU says so (on a GPU machine it profiles: make test-gpu's session runs it).
if [ -x "$BUILD/cuda/moec-tune-cuda" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  "$MOEC" tune --target cuda --quick >"$WORK/nogpu.out" 2>&1 </dev/null
  status=$?
  if [ $status -eq 1 ] && grep -q 'has no GPU' "$WORK/nogpu.out"; then ok "tune --target cuda without a GPU says so (exit 1): $(head -n 1 "$WORK/nogpu.out" | cut -c1-110)"
  else bad "tune --target cuda without a GPU: exit 1 and why (got $status)" "$(cat "$WORK/nogpu.out")"; fi
fi

exit $failed
