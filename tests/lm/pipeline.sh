#!/usr/bin/env bash
# Pipeline stages and microbatches (lang/manual.md §6: parallel { pp P; microbatches M;
# pp_schedule gpipe | 1f1b; }). The pipeline adds nothing to the math: each claim compares a run
# with stages against pp 1 with the same microbatches, losses of 4 steps and every whole gradient of
# the step-1 --dump to 1e-5 of each tensor's largest element (tests/mpi/common.sh compare_dumps; a
# stage's messages do not change the sums, but the tied embedding's two parts are added in another
# order, and the gradient norm sums its stages' squares in another order):
#   - an MoE stack (tests/models/grad_k2.moe, 4 layers) and a language model (grad_lm_gpt.moe with
#     3 MoE blocks and its dense layer: 4 layer instances, a tied embedding the first and last
#     stage hold) on pp 2 and pp 4, with 1f1b and gpipe, 4 microbatches;
#   - combined with the other splits: pp 2 x dp 2 x ep 2 and pp 2 x mp 2 x esp 2 (4 ranks) against
#     dp 2 x ep 2 and mp 2 x esp 2; with the sharded optimizer (adamw shard true, pp 2 x dp 2) and
#     with recompute layers (pp 2);
#   - gradient accumulation without stages: the stack (no token dropped) with microbatches 4 equals
#     one batch of 4 times the samples; dp 2 x ep 2 with 2 microbatches a rank (its gradients
#     reduced once a step, in the last microbatch's backward) equals one rank with 4;
#   - a pp 2 checkpoint resumes on one rank and on pp 4 (the stages' shards in one index), with the
#     uninterrupted run's losses;
#   - a stage's rank killed mid-step ends the job, no hang (a cut link between stages: the
#     emulated cluster's fault suite, tests/cluster/faults.sh);
#   - the memory plan per stage and schedule against each stage's measured peak (1.00-1.10x), 1F1B's
#     below GPipe's at 8 microbatches;
#   - --sample and --export-hf through the stages: the same tokens and checkpoint bytes as one rank;
#   - --check-grad through the stages (the same entries and results as pp 1, a planted error in the
#     last stage fails, pp 2 x dp 2 x ep 2 passes);
#   - refusals: `aux pooled` over stages and the wrong number of ranks (the CUDA target builds
#     stages and microbatches: tests/cuda/pipeline.sh).
. "$(dirname "$0")/../lib.sh"
. "$(dirname "$0")/../mpi/common.sh"
work lm-pipeline
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
export OMP_NUM_THREADS=1

# The two models, with PARALLEL as their `parallel` block and OPT as the optimizer (default sgd).
stack() {
  sed "s/batch 2;/batch 8;/; s/^layer block x 2/parallel { $1 }\nlayer block x 4/" tests/models/grad_k2.moe
}
lm() {
  local opt=${2:-optimizer sgd { lr 0.01; \}}
  sed "s/batch 2;/batch 4;/; s/optimizer sgd { lr 0.01; }/$opt/; s/^layer block x 2/parallel { $1 }\nlayer block x 3/" \
    tests/models/grad_lm_gpt.moe
}

# run NAME RANKS: builds $WORK/NAME.moe and runs it 4 steps with --dump on RANKS ranks (NAME.out,
# NAME.dump); false with the reason printed as a FAIL.
run() {
  local d="$WORK/$1"
  mkdir -p "$d"
  "$MOEC" build "$WORK/$1.moe" -o "$d/bin" 2>"$d/err" || { bad "$1: moec build" "$(cat "$d/err")"; return 1; }
  (cd "$d" && timeout 300 $MPIRUN -np "$2" ./bin --steps 4 --dump dump >out 2>&1) ||
    { bad "$1: the run failed" "$(tail -n 8 "$d/out")"; return 1; }
}

# equal LABEL REF REF_RANKS NAME RANKS: run both, then the losses and the step-1 dump compared.
equal() {
  local label=$1 ref=$2 nref=$3 name=$4 n=$5 cmp
  [ -f "$WORK/$ref/out" ] || run "$ref" "$nref" || return
  run "$name" "$n" || return
  if [ "$(losses "$WORK/$name/out" | wc -l)" -eq 4 ] && same_losses "$WORK/$ref/out" "$WORK/$name/out" &&
     cmp=$(compare_dumps "$WORK/$ref/dump" "$WORK/$name/dump"); then
    ok "$label: 4 losses and the step-1 gradients equal ($cmp)"
  else
    bad "$label: differs" "$(paste <(losses "$WORK/$ref/out") <(losses "$WORK/$name/out")); $(compare_dumps "$WORK/$ref/dump" "$WORK/$name/dump")"
  fi
}

# ---- every stage count and schedule against pp 1 ----
stack "microbatches 4;" >"$WORK/stack_m4.moe"
stack "pp 2; microbatches 4;" >"$WORK/stack_pp2.moe"
stack "pp 4; microbatches 4; pp_schedule gpipe;" >"$WORK/stack_pp4g.moe"
lm "microbatches 4;" >"$WORK/lm_m4.moe"
lm "pp 2; microbatches 4;" >"$WORK/lm_pp2.moe"
lm "pp 2; microbatches 4; pp_schedule gpipe;" >"$WORK/lm_pp2g.moe"
lm "pp 4; microbatches 4;" >"$WORK/lm_pp4.moe"
lm "pp 3; microbatches 4; pp_layers 2 1 1;" >"$WORK/lm_pp3.moe"
run stack_m4 1
run lm_m4 1
spawn stack2 equal "stack pp 2, 1f1b" stack_m4 1 stack_pp2 2
spawn stack4 equal "stack pp 4, gpipe" stack_m4 1 stack_pp4g 4
spawn lm2 equal "language model pp 2, 1f1b" lm_m4 1 lm_pp2 2
spawn lm2g equal "language model pp 2, gpipe" lm_m4 1 lm_pp2g 2
collect stack2 stack4 lm2 lm2g
spawn lm4 equal "language model pp 4, 1f1b" lm_m4 1 lm_pp4 4
spawn lm3 equal "language model pp 3, pp_layers 2 1 1" lm_m4 1 lm_pp3 3
collect lm4 lm3

# ---- with the other splits, the sharded optimizer and recomputation ----
ADAMW="optimizer adamw { lr 0.01; warmup 2; decay_steps 8; min_lr 0.001; clip 0.5; shard true; }"
lm "dp 2; ep 2; microbatches 2;" >"$WORK/dpep.moe"
lm "pp 2; dp 2; ep 2; microbatches 2;" >"$WORK/pp_dpep.moe"
lm "mp 2; esp 2; microbatches 2;" >"$WORK/mpesp.moe"
lm "pp 2; mp 2; esp 2; microbatches 2; pp_schedule gpipe;" >"$WORK/pp_mpesp.moe"
lm "dp 2; ep 2; microbatches 2;" "$ADAMW" >"$WORK/shard.moe"
lm "pp 2; dp 2; ep 2; microbatches 2;" "$ADAMW" >"$WORK/pp_shard.moe"
lm "microbatches 2;" | sed 's/seed 5;/seed 5; recompute layers;/' >"$WORK/rc.moe"
lm "pp 2; microbatches 2;" | sed 's/seed 5;/seed 5; recompute layers;/' >"$WORK/pp_rc.moe"
# The gradients reduced once a step (the last microbatch's reductions add the earlier ones' sums):
# dp 2 x ep 2 with 2 microbatches of 2 samples per rank holds the same microbatches, routed
# alike, as one rank with 4 microbatches of a batch of 8.
lm "microbatches 4;" | sed 's/batch 4;/batch 8;/' >"$WORK/one_m4.moe"
equal "dp 2 x ep 2, 2 microbatches a rank (reduced once a step)" one_m4 1 dpep 2
equal "pp 2 x dp 2 x ep 2 (4 ranks)" dpep 2 pp_dpep 4
equal "pp 2 x mp 2 x esp 2 (4 ranks), gpipe" mpesp 2 pp_mpesp 4
lm "microbatches 4;" "${ADAMW/ shard true;/}" | sed 's/batch 4;/batch 8;/' >"$WORK/one_m4_adamw.moe"
equal "dp 2 x ep 2, adamw shard true and clip, 2 microbatches a rank (its ReduceScatter once a step)" one_m4_adamw 1 shard 2
equal "pp 2 x dp 2 x ep 2, adamw shard true and clip" shard 2 pp_shard 4
spawn rc equal "pp 2, recompute layers" rc 1 pp_rc 2

# ---- gradient accumulation: microbatches 4 equals one batch of 4 times the samples ----
accumulate() {
  sed "s/batch 2;/batch 8;/; s/^layer block x 2/layer block x 4/" tests/models/grad_k2.moe >"$WORK/stack_b8.moe"
  run stack_b8 1 || return
  local cmp
  if same_losses "$WORK/stack_b8/out" "$WORK/stack_m4/out" &&
     cmp=$(compare_dumps "$WORK/stack_m4/dump" "$WORK/stack_b8/dump"); then   # (the loss and gradients M 4 writes)
    ok "microbatches 4 of 2 samples equal one batch of 8 (no token dropped): 4 losses, the gradients ($cmp)"
  else
    bad "microbatches 4 differ from a batch of 8" "$(paste <(losses "$WORK/stack_b8/out") <(losses "$WORK/stack_m4/out")); $(compare_dumps "$WORK/stack_m4/dump" "$WORK/stack_b8/dump")"
  fi
}
spawn acc accumulate
collect rc acc

# ---- checkpoints: pp 2 saved, resumed on one rank and on pp 4 ----
resume() {
  local d="$WORK/lm_pp2" ok1
  (cd "$d" && rm -rf ck && mkdir ck && $MPIRUN -np 2 ./bin --steps 2 --save ck/a >s.out 2>&1 &&
     "$WORK/lm_m4/bin" --resume ck/a --steps 4 >r1.out 2>&1 &&
     $MPIRUN -np 4 "$WORK/lm_pp4/bin" --resume ck/a --steps 4 >r4.out 2>&1) ||
    { bad "pp 2 checkpoint: a run failed" "$(tail -n 5 "$d"/s.out "$d"/r1.out "$d"/r4.out 2>/dev/null)"; return; }
  local want got1 got4
  want=$(losses "$WORK/lm_m4/out" | tail -n 2 | tr '\n' ' ')
  got1=$(losses "$d/r1.out" | tr '\n' ' ')
  got4=$(losses "$d/r4.out" | tr '\n' ' ')
  if [ "$(ls "$d"/ck/a.rank*-of-2.safetensors | wc -l)" -eq 2 ] && grep -q '"pp": 2' "$d/ck/a" &&
     [ "$got1" = "$want" ] && [ "$got4" = "$want" ]; then
    ok "a pp 2 checkpoint (2 shards, one index) resumed on 1 rank and on pp 4: steps 3-4 $want as uninterrupted"
  else
    bad "pp 2 checkpoint resumed" "uninterrupted: $want; one rank: $got1; pp 4: $got4"
  fi
}
resume

# ---- --sample and --export-hf through the stages ----
# grad_lm_glm.moe (a family --export-hf writes: GLM-4.5's parts) trained 2 steps on one rank
# (microbatches 2), then resumed on pp 2: the same sample and the same checkpoint bytes.
hf_sample() {
  local d="$WORK/glm"
  mkdir -p "$d"
  sed "s/^layer dense {/parallel { microbatches 2; }\nlayer dense {/" tests/models/grad_lm_glm.moe >"$d/one.moe"
  sed "s/^layer dense {/parallel { pp 2; microbatches 2; }\nlayer dense {/" tests/models/grad_lm_glm.moe >"$d/two.moe"
  "$MOEC" build "$d/one.moe" -o "$d/one" 2>"$d/err" && "$MOEC" build "$d/two.moe" -o "$d/two" 2>>"$d/err" ||
    { bad "glm: moec build" "$(cat "$d/err")"; return; }
  local prompt=$'\x01\x02\x03'
  if ! (cd "$d" && ./one --steps 2 --save ck --export-hf h1 --sample 12 --prompt "$prompt" >one.out 2>&1 &&
        $MPIRUN -np 2 ./two --steps 0 --resume ck --export-hf h2 --sample 12 --prompt "$prompt" >two.out 2>&1); then
    bad "glm on pp 2: a run failed" "$(tail -n 5 "$d/one.out" "$d/two.out")"; return
  fi
  if cmp -s "$d/h1/model.safetensors" "$d/h2/model.safetensors" && cmp -s "$d/h1/config.json" "$d/h2/config.json" &&
     [ -n "$(tail -n 1 "$d/one.out")" ] && [ "$(tail -n 1 "$d/one.out")" = "$(tail -n 1 "$d/two.out")" ]; then
    ok "pp 2 from a one-rank checkpoint: --export-hf the same bytes, --sample the same 12 tokens ($(tail -n 1 "$d/two.out"))"
  else
    bad "pp 2: --export-hf or --sample differ" "$(tail -n 2 "$d/one.out" "$d/two.out")"
  fi
}
hf_sample

# ---- the memory plan per stage and schedule against the measured peaks ----
# bench/models/lm_mid.moe (6 blocks, 125 MiB of parameters; 8 windows of 128 tokens) on pp 2 with 8
# microbatches, one step:
# each stage's rank 0's peak resident memory within 1.00-1.10x its plan (parameters, gradients,
# moments, the second gradient buffer, an arena per microbatch in flight: the process adds its
# libraries and MPI's buffers), the plan as `moec build -v` prints it; 1F1B's plan below GPipe's
# (2 and 1 microbatches in flight against 8).
mem_stages() {   # SCHEDULE -> "plan0 plan1 measured0 measured1" in MiB
  local d="$WORK/mid_$1"
  mkdir -p "$d"
  sed "s/batch 4; seqlen 256;/batch 8; seqlen 128;/; s/^layer block x 6/parallel { pp 2; microbatches 8; pp_schedule $1; }\nlayer block x 6/" \
    bench/models/lm_mid.moe >"$d/m.moe"
  "$MOEC" build "$d/m.moe" -v -o "$d/bin" 2>"$d/build.err" || return 1
  (cd "$d" && $MPIRUN -np 2 ./bin --steps 1 >run.out 2>&1) || return 1
  local plan meas
  plan=$(sed -n 's/^# stage \([01]\): .*peak \([0-9.]*\) \([KMG]iB\) per rank.*/\2 \3/p' "$d/build.err" | awk '{print ($2 == "GiB" ? $1 * 1024 : $1)}' | paste -sd' ')
  meas=$(sed -n 's/^# stage [01]: peak memory \([0-9.]*\) \([KMG]iB\) .*/\1 \2/p' "$d/run.out" | awk '{print ($2 == "GiB" ? $1 * 1024 : $1)}' | paste -sd' ')
  echo "$plan $meas"
}
memory() {
  local one gp
  read -r -a one <<<"$(mem_stages 1f1b)"
  read -r -a gp <<<"$(mem_stages gpipe)"
  if [ "${#one[@]}" -eq 4 ] && [ "${#gp[@]}" -eq 4 ] &&
     awk -v a="${one[*]}" -v b="${gp[*]}" 'BEGIN { split(a, x, " "); split(b, y, " ")
       for (i = 1; i <= 2; i++) { if (x[i+2] < x[i] || x[i+2] > 1.10 * x[i] || y[i+2] < y[i] || y[i+2] > 1.10 * y[i]) exit 1 }
       exit !(x[1] < y[1] && x[2] < y[2]) }'; then
    ok "memory per stage, pp 2 x 8 microbatches: 1f1b planned ${one[0]} / ${one[1]} MiB, measured ${one[2]} / ${one[3]}; gpipe planned ${gp[0]} / ${gp[1]}, measured ${gp[2]} / ${gp[3]}"
  else
    bad "memory per stage against the plan" "1f1b: ${one[*]:-?}; gpipe: ${gp[*]:-?} (plan0 plan1 measured0 measured1, MiB)"
  fi
}
memory

# ---- a stage's rank killed mid-step ----
killed() {
  local d="$WORK/lm_pp2" t0 t1 status
  t0=$(date +%s)
  (cd "$d" && MOERT_TEST_KILL=1:2 timeout 120 $MPIRUN -x MOERT_TEST_KILL -np 2 ./bin --steps 4 --comm-timeout 10 >kill.out 2>&1)
  status=$?
  t1=$(date +%s)
  if [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && [ $((t1 - t0)) -lt 100 ] &&
     grep -q 'exited on signal 9\|has not completed after' "$d/kill.out"; then
    ok "the last stage's rank killed at step 2: the job ends (status $status) in $((t1 - t0)) s, no hang: $(grep -m1 'exited on signal 9\|has not completed after' "$d/kill.out" | cut -c1-120)"
  else
    bad "a killed stage" "status $status after $((t1 - t0)) s: $(tail -n 5 "$d/kill.out")"
  fi
}
killed

# ---- refusals ----
refuse() {   # refuse LABEL PATTERN CMD...: CMD fails and says PATTERN
  local label=$1 pattern=$2
  shift 2
  if "$@" >"$WORK/r.out" 2>&1; then bad "$label: accepted"; return; fi
  if grep -q -- "$pattern" "$WORK/r.out"; then ok "$label: refused ($(grep -m1 -- "$pattern" "$WORK/r.out" | cut -c1-150))"
  else bad "$label: the message" "$(cat "$WORK/r.out")"; fi
}
# ---- --check-grad through the stages ----
# pp 2 checks the same entries with the same results as pp 1 (the differences are of the whole
# pipeline's loss; the tied table perturbed on both stages that hold it); a 10 % error planted in a
# parameter of the last stage fails it; pp 2 x dp 2 x ep 2 passes.
check_grad() {
  local d="$WORK/cg"
  mkdir -p "$d"
  (cd "$d" && "$WORK/lm_m4/bin" --check-grad >one.out 2>&1; $MPIRUN -np 2 "$WORK/lm_pp2/bin" --check-grad >two.out 2>&1
   MOERT_CHECK_GRAD_PLANT=dense0.mlp.w2 $MPIRUN -x MOERT_CHECK_GRAD_PLANT -np 2 "$WORK/lm_pp2/bin" --check-grad >plant.out 2>&1
   $MPIRUN -np 4 "$WORK/pp_dpep/bin" --check-grad >four.out 2>&1)
  local one two
  one=$(grep '^# [0-9]* entries checked\|^# [0-9]* parameters:' "$d/one.out")
  two=$(grep '^# [0-9]* entries checked\|^# [0-9]* parameters:' "$d/two.out")
  if [ "$(tail -n 1 "$d/two.out")" = OK ] && [ -n "$one" ] && [ "$one" = "$two" ] && grep -q 'embed.wte .* OK$' "$d/two.out"; then
    ok "--check-grad on pp 2: OK, the entries and results of pp 1 ($(echo "$two" | tail -n 1 | cut -c3-80))"
  else
    bad "--check-grad on pp 2" "$(tail -n 3 "$d/one.out" "$d/two.out")"
  fi
  if grep -q '^FAILED$' "$d/plant.out" && grep -q '^dense0.mlp.w2 .*FAILED$' "$d/plant.out" &&
     [ "$(grep -c ' FAILED$' "$d/plant.out")" -eq 1 ]; then
    ok "--check-grad on pp 2: a 10 % error planted in the last stage's dense0.mlp.w2 fails it"
  else
    bad "--check-grad on pp 2 with a planted error" "$(tail -n 3 "$d/plant.out")"
  fi
  if [ "$(tail -n 1 "$d/four.out")" = OK ]; then
    ok "--check-grad on pp 2 x dp 2 x ep 2: OK ($(grep '^# [0-9]* parameters:' "$d/four.out" | cut -c3-80))"
  else
    bad "--check-grad on pp 2 x dp 2 x ep 2" "$(tail -n 5 "$d/four.out")"
  fi
}
check_grad

refuse "pp 2 on 1 rank" "needs pp 2 x dp 1 x mp 1 = 2 ranks but 1 is running" "$WORK/lm_pp2/bin" --steps 1
sed 's/gate gshard { k 2;/gate gshard { aux pooled; k 2;/' "$WORK/lm_pp2.moe" >"$WORK/pooled.moe"
refuse "aux pooled over stages" "'aux pooled' with pp 2" "$MOEC" check "$WORK/pooled.moe"
exit $failed
