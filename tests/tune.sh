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
#     --target cuda too;
#   - --target cuda (build/cuda/moec-tune-cuda, on the fake device moec-tune-fake): one rank times
#     the GEMMs and the programs' kernels (NVRTC's build of the library: element-wise, attention,
#     update) and writes a 1 x 1 profile (collectives 0, saying why; `memory` the device's; no
#     intra-node fits) that plans tiny.moe and refuses a 4-rank layout; 2 ranks with --dtype bf16
#     fit the GEMMs, the 6 collectives (alltoall_intra, allreduce_intra in the profile) and the
#     kernels (the bf16 updates; attention on tensor cores, heads of 16);
#     the real program without a GPU exits 1 and says so; bench/gpu_predict.sh --quick (tune,
#     plan, run: predicted, the fused program's prediction and measured) runs on the fake device.
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

# ---- --target cuda (build/cuda/moec-tune-cuda; on the fake device moec-tune-fake) ----
FAKE=$BUILD/cuda/moec-tune-fake
if [ ! -x "$FAKE" ]; then
  printf 'skip  tune --target cuda: no %s (make builds it where the CUDA toolkit is)\n' "$FAKE"
else
  # One rank, one GPU: the GEMMs through rt_cuda_gemm, no collectives, a 1 x 1 profile.
  MOEC_CUDA_FAKE=1 timeout "$TIMEOUT" "$MOEC" tune --target cuda --quick -o "$WORK/G1.cluster" >"$WORK/g1.out" 2>&1 </dev/null
  status=$?
  if [ $status -eq 0 ] && [ "$(tail -n 1 "$WORK/g1.out")" = OK ] && grep -q '^# gemm: cuBLAS (rt_cuda_gemm: fp32 inputs' "$WORK/g1.out" &&
     grep -q '^  gemm  *each-rank  *1  *8 ' "$WORK/g1.out" && grep -q '^  nodes 1;' "$WORK/G1.cluster" &&
     grep -q '^  gpus_per_node 1;' "$WORK/G1.cluster" &&
     [ "$(grep -c '{ alpha 0; beta 0; }  # not measured: one GPU runs no collectives' "$WORK/G1.cluster")" -eq 4 ] &&
     grep -Eq '^  memory [0-9]+;  # the GPU.s total memory \(cuDeviceTotalMem\)' "$WORK/G1.cluster" &&
     ! grep -Eq '^ *(alltoall_intra|allreduce_intra) *\{' "$WORK/G1.cluster"; then
    ok "tune --target cuda on one rank (fake device): the GEMMs' fit ($(awk '/^  gemm / {print "alpha", $5, "beta", $6}' "$WORK/g1.out")), a 1 x 1 profile whose collectives are 0 and say why, with the device's memory"
  else bad "tune --target cuda on one rank (fake device), exit $status" "$(cat "$WORK/g1.out" "$WORK/G1.cluster" 2>/dev/null | tail -n 30)"; fi
  # The CUDA programs' own kernels, through NVRTC: the element-wise, attention and update fits a
  # GPU profile prices those ops with (the fake device emulates them at small sizes).
  kfits=$(grep -cE '^  (elementwise|attention|attention_grad|elementwise_math|update_adamw|update_sgd) +\{ alpha [0-9.e+-]+; beta [0-9.e+-]+; \}$' "$WORK/G1.cluster" 2>/dev/null)
  if [ "${kfits:-0}" -eq 6 ] && grep -q '^# kernels: the CUDA programs. library, NVRTC for sm_[0-9]*.*update_adamw mk_adamw, ' "$WORK/g1.out" &&
     awk '$1 ~ /^(elementwise|attention|update_)/ && $2 == "{" {sub(";", "", $6); if (!($6 > 0)) bad = 1} END {exit bad}' "$WORK/G1.cluster"; then
    ok "tune --target cuda times the programs' kernels (fake device): elementwise, elementwise_math, attention, attention_grad, update_adamw and update_sgd lines, each beta > 0"
  else bad "tune --target cuda times the programs' kernels: 6 kernel fits (got ${kfits:-0})" "$(grep -E '^# kernels|^  (elementwise|attention|update)' "$WORK/g1.out" "$WORK/G1.cluster" 2>/dev/null)"; fi
  # The grid of GEMM shapes on the GPU engine (on the fake device its shapes up to 2^20
  # multiply-accumulates, its GEMMs being the CPU's).
  ggrid=$(grep -c '^ *gemm_at [0-9]* [0-9]* [0-9]* [0-9.e+-]*;' "$WORK/G1.cluster" 2>/dev/null)
  if [ "${ggrid:-0}" -ge 20 ] && grep -q '^# gemm grid: [0-9]* shapes' "$WORK/g1.out" &&
     awk '$1 == "gemm_at" {sub(";", "", $5); if ($2 * $3 * $4 > 1048576 || !($5 > 0)) exit 1}' "$WORK/G1.cluster"; then
    ok "tune --target cuda times the grid of GEMM shapes ($ggrid gemm_at lines on the fake device, each at most 2^20 multiply-accumulates)"
  else bad "tune --target cuda times the grid of GEMM shapes" "$(grep 'gemm grid' "$WORK/g1.out"; grep -c gemm_at "$WORK/G1.cluster" 2>/dev/null) lines"; fi
  # The expert GEMMs over their filled rows as the programs run them (rt_cuda_expert_gemm_rows; here
  # the fake device's GEMM) against the GEMM fits: the profile's expert_gemm_scale, which the planner
  # multiplies the expert GEMMs by (tiny's layer planned with the line at 3 and without it).
  scale=$(awk '$1 == "expert_gemm_scale" {sub(";", "", $2); print $2}' "$WORK/G1.cluster" 2>/dev/null)
  t_model() { "$MOEC" build lang/models/tiny.moe --cluster "$1" -v -o "$WORK/tiny_s" 2>&1 | awk '$2 == "pipeline-plan" && $5 == "block0" && $9 == "t_model" {print $10 + $11; exit}'; }
  sed 's/^  expert_gemm_scale .*/  expert_gemm_scale 3;/' "$WORK/G1.cluster" >"$WORK/G1s3.cluster" 2>/dev/null
  grep -v '^  expert_gemm_scale' "$WORK/G1.cluster" >"$WORK/G1s1.cluster" 2>/dev/null
  t3=$(t_model "$WORK/G1s3.cluster") t1=$(t_model "$WORK/G1s1.cluster")
  if [ -n "$scale" ] && awk -v s="$scale" 'BEGIN { exit !(s > 0) }' &&
     grep -q "^  expert_gemm_scale $scale;  # the fake device's GEMM over the counted rows: [0-9.]* ms for 8 experts x 2 shapes" "$WORK/G1.cluster" &&
     grep -q "^# expert GEMMs over their filled rows (.*): expert_gemm_scale $scale (in the profile)" "$WORK/g1.out" &&
     [ -n "$t3" ] && [ -n "$t1" ] && awk -v a="$t3" -v b="$t1" 'BEGIN { exit !(a > b) }'; then
    ok "tune --target cuda times the expert GEMMs over their filled rows against the GEMM fits: expert_gemm_scale $scale (fake device); the planner prices by it (tiny's layer at 3: $t3 ms, without: $t1 ms)"
  else bad "tune --target cuda: expert_gemm_scale in the profile and in the plan" "$(grep -h expert_gemm "$WORK/g1.out" "$WORK/G1.cluster" 2>/dev/null; echo "t3 '$t3' t1 '$t1'")"; fi
  if [ -f "$WORK/G1.cluster" ] && "$MOEC" build lang/models/tiny.moe --cluster "$WORK/G1.cluster" -o "$WORK/tiny1" >"$WORK/b1.out" 2>&1 &&
     ! "$MOEC" build tests/golden/parallel.moe --cluster "$WORK/G1.cluster" -o "$WORK/par1" >"$WORK/b4.out" 2>&1 &&
     grep -q 'the layout needs 4 ranks but the cluster has 1' "$WORK/b4.out"; then
    ok "the one-GPU profile plans a one-rank model and refuses a layout of 4 ranks"
  else bad "the one-GPU profile: tiny.moe builds, parallel.moe (4 ranks) is refused" "$(cat "$WORK/b1.out" "$WORK/b4.out" 2>/dev/null)"; fi
  # Two ranks: NCCL's collectives (on the fake device, MPI's) and bf16 GEMM inputs.
  OMP_NUM_THREADS=1 MOEC_CUDA_FAKE=1 timeout "$TIMEOUT" $MPIRUN -x OMP_NUM_THREADS -x MOEC_CUDA_FAKE -np 2 "$MOEC" tune --target cuda \
    --quick --dtype bf16 -o "$WORK/G2.cluster" >"$WORK/g2.out" 2>&1 </dev/null
  status=$?
  if [ $status -eq 0 ] && [ "$(tail -n 1 "$WORK/g2.out")" = OK ] && grep -q '^# gemm: cuBLAS (rt_cuda_gemm: bf16 inputs' "$WORK/g2.out" &&
     [ "$(awk '/^# model +group/ {t = 1; next} t && /^  [a-z]/ && $4 == 7' "$WORK/g2.out" | wc -l)" -eq 6 ] &&
     ! grep -q 'not measured' "$WORK/G2.cluster" && grep -Eq '^  memory [0-9]+;  # the GPU.s total memory' "$WORK/G2.cluster" &&
     grep -q '^# kernels: .*update_adamw mk_adamw_bf16, update_sgd mk_sgd_bf16, attention mk_attn_tc_fwd, attention_grad mk_attn_tc_stats' "$WORK/g2.out" &&
     [ "$(grep -cE '^  (elementwise|attention|attention_grad|elementwise_math|update_adamw|update_sgd) +\{' "$WORK/G2.cluster")" -eq 6 ] &&
     grep -Eq '^  alltoall_intra +\{ alpha [0-9.e+-]+; beta [0-9.e+-]+; \}' "$WORK/G2.cluster" &&
     grep -Eq '^  allreduce_intra +\{ alpha [0-9.e+-]+; beta [0-9.e+-]+; \}' "$WORK/G2.cluster"; then
    ok "tune --target cuda --dtype bf16 on 2 ranks (fake device): bf16 GEMMs, the 6 collective fits over NCCL's calls, alltoall_intra, allreduce_intra, memory and the kernel fits (the bf16 updates, attention on tensor cores) in the profile"
  else bad "tune --target cuda --dtype bf16 on 2 ranks (fake device), exit $status" "$(tail -n 30 "$WORK/g2.out")"; fi
  # bench/gpu_predict.sh, which a GPU session runs: its --quick models on the fake device, predicted
  # and measured side by side (the fake device's times say nothing; the script's path is checked).
  if MOEC_CUDA_FAKE=1 PREDICT_DIR=$WORK/predict bash bench/gpu_predict.sh --build --quick >"$WORK/pb.out" 2>&1 &&
     MOEC_CUDA_FAKE=1 PREDICT_DIR=$WORK/predict bash bench/gpu_predict.sh --quick >"$WORK/pr.out" 2>&1 &&
     [ "$(grep -cE '^predict_q_(gpt|bf16) +(fp32|bf16)( +[0-9.]+){7}$' "$WORK/pr.out")" -eq 2 ] && [ "$(tail -n 1 "$WORK/pr.out")" = OK ]; then
    ok "bench/gpu_predict.sh --quick on the fake device: a profile per dtype (with kernel lines), the planner's and the fused program's predicted step and the measured one of each model"
  else bad "bench/gpu_predict.sh --quick on the fake device" "$(cat "$WORK/pb.out" "$WORK/pr.out" 2>/dev/null | tail -n 20)"; fi
fi
# The real program without a GPU says so (on a GPU machine it profiles: make test-gpu's session runs it).
if [ -x "$BUILD/cuda/moec-tune-cuda" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  "$MOEC" tune --target cuda --quick >"$WORK/nogpu.out" 2>&1 </dev/null
  status=$?
  if [ $status -eq 1 ] && grep -q 'has no GPU' "$WORK/nogpu.out"; then ok "tune --target cuda without a GPU says so (exit 1): $(head -n 1 "$WORK/nogpu.out" | cut -c1-110)"
  else bad "tune --target cuda without a GPU: exit 1 and why (got $status)" "$(cat "$WORK/nogpu.out")"; fi
fi

exit $failed
