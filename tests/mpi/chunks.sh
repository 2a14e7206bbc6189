#!/usr/bin/env bash
# Chunked execution must not change the math (passes/schedule.c): on 4 ranks (dp 2, mp 2,
# ep 2, esp 2), for every schedule policy and pipeline degree r in {1, 2, 3, 4} (forward and
# backward; plus mixed degrees), the run's losses for 3 steps and its --dump at step 1 (loss,
# output, whole gradients) equal the unchunked sequential run's to 1e-5 relative. The capacity
# is 12 slots per expert, divisible by 2, 3 and 4; r = 5 and 7 split it unevenly (chunks of 2 or
# 3 slots, of 1 or 2), and r = 13, 16 are above it (cut to 12 chunks of one slot, said with -v).
# Prints `ok    ...` / `FAIL  ...` lines; exits 1 on any failure.
# Policies other than sequential put collectives on the intra/inter streams: their functions are
# emitted as task tables and run by the threaded stream executor (runtime/streams.c), checked
# in the generated C; CHUNKS_REPEAT=N runs every chunked case N times (races), each mpirun under
# a CHUNKS_TIMEOUT (120 s) limit, so a hang fails. Last, five streamed cases run threaded twice
# and in program order (MOERT_STREAMS=0): bit for bit the same, or a buffer was reused too early.
set -u
cd "$(dirname "$0")/../.."
. tests/mpi/common.sh
work chunks
TIMEOUT=${CHUNKS_TIMEOUT:-120}
REPEAT=${CHUNKS_REPEAT:-1}
P=4

# The capacity is 12 slots per expert (blocks_4ranks).
model() {  # schedule-line
  blocks_4ranks chunks
  echo "$1"
}


model "" >"$WORK/ref.moe"
if ! msg=$(run_model ref); then bad "reference (sequential, r = 1)" "$msg"; exit 1; fi

# Every schedule line must have chunked what it asked for (the pass says so with -v). Each case's
# program is built once, with -v (WORK/c_POLICY_RF_RB, its lines in .v), and run REPEAT times; the
# streams' check below runs four of them again.
cases=""
for policy in sequential fsmoe fsmoe-no-iio tutel tutel-improved pipemoe-lina; do
  for r in 1 2 3 4; do cases="$cases $policy:$r:$r"; done
done
cases="$cases fsmoe:2:4 fsmoe:4:3 tutel:3:2 fsmoe:5:7 tutel-improved:7:5 pipemoe-lina:13:16"
# build_case POLICY RF RB: WORK/c_POLICY_RF_RB.moe and its program (name in $name); false when
# moec build fails (its stderr in WORK/$name.v).
build_case() {
  name=c_$1_$2_$3
  model "schedule { policy $1; pipeline { forward $2; backward $3; } }" >"$WORK/$name.moe"
  "$MOEC" build "$WORK/$name.moe" -v -o "$WORK/$name" 2>"$WORK/$name.v"
}
for c in $cases; do
  IFS=: read -r policy rf rb <<<"$c"
  label="$policy forward $rf backward $rb"
  if ! build_case "$policy" "$rf" "$rb"; then bad "$label: moec build" "$(cat "$WORK/$name.v")"; continue; fi
  if [ "$policy" != sequential ]; then
    want=0; [ "$rf" -gt 1 ] && want=$((want + 2)); [ "$rb" -gt 1 ] && want=$((want + 2))
    ef=$((rf < 12 ? rf : 12)) eb=$((rb < 12 ? rb : 12))  # r above the capacity is cut to it
    got=$(($(grep -c "^# schedule: @[^ ]*\.fwd: .* in $ef chunks" "$WORK/$name.v") + $(grep -c "^# schedule: @[^ ]*\.bwd: .* in $eb chunks" "$WORK/$name.v")))
    if [ "$got" != "$want" ]; then
      bad "$label: expected $want chunked regions ($ef forward, $eb backward chunks), got $got" "$(grep '^# schedule' "$WORK/$name.v")"; continue
    fi
    if ! "$MOEC" build "$WORK/$name.moe" --emit c -o "$WORK/chunk.c" 2>/dev/null || ! grep -q rt_run_streams "$WORK/chunk.c"; then
      bad "$label: the generated program does not run the stream executor"; continue
    fi
  fi
  for rep in $(seq "$REPEAT"); do
    tag=$label; [ "$REPEAT" -gt 1 ] && tag="$label (run $rep)"
    if ! msg=$(run_built "$name"); then bad "$tag" "$msg"; continue; fi
    if ! same_losses "$WORK/ref.out" "$WORK/$name.out"; then
      bad "$tag: losses differ from the unchunked run" "$(paste <(losses "$WORK/ref.out") <(losses "$WORK/$name.out"))"; continue
    fi
    if result=$(compare_dumps "$WORK/ref.dump" "$WORK/$name.dump"); then
      ok "$tag: losses and dump equal the unchunked run: $result"
    else
      bad "$tag: dump differs from the unchunked run" "$result"
    fi
  done
done

# Streams against program order, bit for bit: the threaded run and the same program with
# MOERT_STREAMS=0 (one thread, table order) compute the same ops on the same bytes, so a
# difference is a race: a buffer whose bytes the memory plan gave another value before every
# user of it had finished (passes/memplan.c reuses buffers inside streamed functions only after
# what happens before them), or an op that ran before its maker. Two threaded runs per case, of
# the program built above (fsmoe-no-iio 5:7 is built here).
for c in fsmoe:3:3 fsmoe:2:4 tutel:4:4 fsmoe-no-iio:5:7 pipemoe-lina:13:16; do
  IFS=: read -r policy rf rb <<<"$c"
  label="$policy forward $rf backward $rb"
  name=c_${policy}_${rf}_${rb}
  if [ ! -x "$WORK/$name" ] && ! build_case "$policy" "$rf" "$rb"; then bad "$label, program order: moec build" "$(cat "$WORK/$name.v")"; continue; fi
  if ! msg=$(MOERT_STREAMS=0 run_built "$name"); then bad "$label, program order" "$msg"; continue; fi
  mv "$WORK/$name.out" "$WORK/order.out"; rm -rf "$WORK/order.dump"; mv "$WORK/$name.dump" "$WORK/order.dump"
  for rep in 1 2; do
    if ! msg=$(run_built "$name"); then bad "$label, streams (run $rep)" "$msg"; continue; fi
    if diff <(grep '^step' "$WORK/order.out" | awk '{print $1, $2, $3, $4}') \
            <(grep '^step' "$WORK/$name.out" | awk '{print $1, $2, $3, $4}') >/dev/null &&
       diff -r "$WORK/order.dump" "$WORK/$name.dump" >/dev/null; then
      ok "$label: streams = program order, bit for bit (losses and dump, run $rep)"
    else
      bad "$label: streams differ from program order (run $rep): a race" \
          "$(diff <(grep '^step' "$WORK/order.out") <(grep '^step' "$WORK/$name.out") | head -n 6; diff -rq "$WORK/order.dump" "$WORK/$name.dump" | head -n 6)"
    fi
  done
done

# --profile's step per class on the reference's 4 ranks (dp 2, mp 2, ep 2, esp 2): the GEMMs and the
# update timed, and each kind of collective its layout runs (the EP AlltoAll, the ESP AllGather and
# ReduceScatter, the AllReduces) summed over its calls.
if (cd "$WORK" && timeout "$TIMEOUT" $MPIRUN -np "$P" ./ref --steps 4 --profile --quiet >prof.out 2>&1 </dev/null) &&
   line=$(grep '^# profile: per class, ms a step: ' "$WORK/prof.out") &&
   echo "$line" | awk '{ for (i = 1; i < NF && $i !~ /^\(/; i++) if ($i == "GEMM" || $i == "update" || $i == "AlltoAll" || $i == "AllGather" ||
                                                           $i == "ReduceScatter" || $i == "AllReduce") { v = $(i + 1); sub(/,/, "", v); n++; if (v + 0 <= 0) bad = 1 } }
                      END { exit bad || n != 6 }'; then
  ok "reference on 4 ranks: --profile times each class ($(echo "$line" | sed 's/^# profile: per class, ms a step: //; s/ (element-wise.*//'))"
else
  bad "reference on 4 ranks: --profile per class" "$(tail -n 5 "$WORK/prof.out")"
fi
exit $failed
