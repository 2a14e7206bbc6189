#!/usr/bin/env bash
# `moec tune --target cuda` on the fake device (build/cuda/moec-tune-fake; the real program,
# build/cuda/moec-tune-cuda, runs on a GPU: make test-gpu's session). Its times say nothing, so
# this suite runs beside others (tests/tune.sh, which times this machine, runs alone):
#   - one rank times the GEMMs and the programs' kernels (NVRTC's build of the library:
#     element-wise, attention, update), the grid of GEMM shapes and the expert GEMMs over their
#     filled rows (expert_gemm_scale, which the planner prices by), and writes a 1 x 1 profile
#     (collectives 0, saying why; `memory` the device's; no intra-node fits) that plans tiny.moe
#     and refuses a 4-rank layout;
#   - 2 ranks with --dtype bf16 fit the GEMMs, the 6 collectives (alltoall_intra, allreduce_intra
#     in the profile) and the kernels (the bf16 updates; attention on tensor cores, heads of 16);
#   - bench/gpu_predict.sh --quick (tune, plan, run: predicted, the fused program's prediction and
#     measured) runs on the fake device.
# Prints `ok    ...` / `FAIL  ...` lines; exits 1 on any failure.
. "$(dirname "$0")/lib.sh"
work tune-cuda
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
# A bound on each run (it ends a hang; the fake device's runs take a few seconds to a minute).
TIMEOUT=${TUNE_TIMEOUT:-300}

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
exit $failed
