#!/usr/bin/env bash
# Faults on the emulated cluster (docs/cluster.md), a small MoE model expert parallel over 2 nodes:
#   - a node's link cut during training (`cluster.sh cut 1`): the job exits non-zero within 30 s
#     of the cut (the collectives' deadline, 20 s by default) with a sentence naming the
#     collective that did not complete, and no rank process is left (a rank that MPI_Abort
#     stops before its own deadline passes prints nothing of its own); the checkpoint written before
#     is intact (same bytes) and resumes on another layout (the single-rank build of the model):
#     its steps equal those of an uninterrupted 2-node run;
#   - the same with pipeline stages (pp 2, a stage on each node): the stages' point-to-point
#     messages have the collectives' deadline;
#   - a link slowed mid-run (`cluster.sh rate 20mbit` while training at 1 Gbit/s): the run
#     completes, its steps after the change are slower, and it loses nothing: every loss equals
#     the unslowed run's, bit for bit.
# Skips with one line where namespaces cannot be made. Prints `ok    ...` / `FAIL  ...` / `skip
# ...` lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-faults.XXXXXX")
CLUSTER=$ROOT/tests/cluster/cluster.sh
bg_pid=""
cleanup() {
  [ -n "$bg_pid" ] && kill -TERM "$bg_pid" 2>/dev/null && wait "$bg_pid" 2>/dev/null
  "$CLUSTER" down
  rm -rf "$WORK"
}
trap cleanup EXIT
. tests/mpi/common.sh
export OMP_NUM_THREADS=1

if ! why=$("$CLUSTER" check); then
  skip "cluster faults" "network namespaces cannot be made here ($why)"
  exit 0
fi

model() {  # name batch groups parallel-line (one model name: checkpoints move between the builds)
  cat <<EOF
model faults { batch $2; seqlen 32; embed 64; seed 6; optimizer adamw { lr 0.003; } }
$4
layer blk x 2 {
  moe {
    experts 4 { ffn gpt { hidden 128; act gelu; bias true; } }
    gate gshard { k 2; capacity 1.0; aux_loss 0.1; groups $3; }
    order tutel;
  }
}
schedule { policy fsmoe; pipeline { forward 2; backward 2; } }
EOF
}
model par 4 1 "parallel { dp 2; mp 1; ep 2; esp 1; }" >"$WORK/par.moe"
model one 8 2 "" >"$WORK/one.moe"
model pipe 8 1 "parallel { pp 2; microbatches 2; }" >"$WORK/pipe.moe"
for m in par one pipe; do
  if ! "$MOEC" build "$WORK/$m.moe" -o "$WORK/$m" 2>"$WORK/err"; then bad "build $m" "$(cat "$WORK/err")"; exit 1; fi
done
cd "$WORK"

# Waits until FILE has a line starting with "step N " (at most 60 s); 0 when it has.
wait_step() {
  for _ in $(seq 600); do grep -q "^step $2 " "$1" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}

# ---- a link cut during training ----
timeout 120 "$CLUSTER" run 2 1 100mbit -- ./par --steps 3 --save ckpt >save.out 2>&1 </dev/null ||
  { bad "a 2-node run writes a checkpoint" "$(tail -n 20 save.out)"; exit 1; }
timeout 120 "$CLUSTER" run 2 1 100mbit -- ./par --steps 8 >ref.out 2>&1 </dev/null ||
  { bad "the uninterrupted 2-node run" "$(tail -n 20 ref.out)"; exit 1; }
sum_before=$(cat ckpt ckpt.rank* | sha256sum)
timeout 180 "$CLUSTER" run 2 1 100mbit -- ./par --steps 100000 --resume ckpt --save ckpt >cut.out 2>&1 </dev/null &
bg_pid=$!
if ! wait_step cut.out 6; then
  bad "the run to be cut trains" "$(tail -n 20 cut.out)"
else
  "$CLUSTER" cut 1
  cut_at=$(date +%s.%N)
  wait "$bg_pid"; status=$?
  bg_pid=""
  secs=$(awk -v a="$cut_at" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  msgs=$(grep -c 'moert: error: rank [01] .*has not completed after' cut.out)
  left=$(pgrep -f "$WORK/par|\./par --steps 100000" | wc -l)
  if [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && awk -v s="$secs" 'BEGIN { exit !(s < 30) }' && [ "$msgs" -ge 1 ] && [ "$left" = 0 ]; then
    ok "node 1's link cut mid-training: exit $status ${secs}s after the cut, no rank left: $(grep -m1 'moert: error' cut.out | cut -c1-200)"
  else
    bad "node 1's link cut mid-training: exit $status after ${secs}s, $msgs error sentences, $left processes left" "$(tail -n 20 cut.out)"
  fi
  # Each rank waits out its own deadline; the first to pass it aborts the job, and mpirun may
  # stop the other before it prints: one sentence is certain, the second one is not.
  echo "# ranks that said it themselves: $(grep 'moert: error: rank' cut.out | sed 's/.*: rank \([0-9]*\) .*/\1/' | sort -u | paste -sd,)"
fi
"$CLUSTER" down
if [ "$(cat ckpt ckpt.rank* | sha256sum)" = "$sum_before" ]; then
  ok "the checkpoint written before the cut is intact (same bytes)"
else
  bad "the checkpoint written before the cut is intact" "$(ls -l ckpt*)"
fi
if timeout 120 ./one --steps 8 --resume ckpt >resume.out 2>&1 </dev/null &&
   same_losses <(grep '^step [4-8] ' ref.out) <(grep '^step [4-8] ' resume.out); then
  ok "it resumes on another layout (one rank): steps 4..8 equal the uninterrupted 2-node run's"
else
  bad "the checkpoint resumes on one rank with the 2-node run's losses" "$(paste <(grep '^step' ref.out | awk '{print $2, $4}') <(grep '^step' resume.out | awk '{print $2, $4}'))"
fi

# ---- a pipeline stage's link cut (pp 2: one stage per node, activations and gradients between) ----
if true; then
  timeout 180 "$CLUSTER" run 2 1 100mbit -- ./pipe --steps 100000 >pcut.out 2>&1 </dev/null &
  bg_pid=$!
  if ! wait_step pcut.out 6; then
    bad "the pp 2 run to be cut trains" "$(tail -n 20 pcut.out)"
  else
    "$CLUSTER" cut 1
    cut_at=$(date +%s.%N)
    wait "$bg_pid"; status=$?
    bg_pid=""
    secs=$(awk -v a="$cut_at" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    msgs=$(grep -c 'moert: error: rank [01] .*has not completed after' pcut.out)
    left=$(pgrep -f "\./pipe --steps 100000" | wc -l)
    if [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && awk -v s="$secs" 'BEGIN { exit !(s < 30) }' && [ "$msgs" -ge 1 ] && [ "$left" = 0 ]; then
      ok "pp 2: the second stage's link cut mid-training: exit $status ${secs}s after the cut, no rank left: $(grep -m1 'moert: error' pcut.out | cut -c1-200)"
    else
      bad "pp 2: a stage's link cut: exit $status after ${secs}s, $msgs error sentences, $left processes left" "$(tail -n 20 pcut.out)"
    fi
  fi
  "$CLUSTER" down
fi

# ---- a link slowed mid-run ----
timeout 120 "$CLUSTER" run 2 1 1gbit -- ./par --steps 150 >fast.out 2>&1 </dev/null ||
  { bad "the 2-node run at 1 Gbit/s" "$(tail -n 20 fast.out)"; exit 1; }
timeout 180 "$CLUSTER" run 2 1 1gbit -- ./par --steps 150 >slow.out 2>&1 </dev/null &
bg_pid=$!
if wait_step slow.out 5 && "$CLUSTER" rate 50mbit; then
  wait "$bg_pid"; status=$?
  bg_pid=""
  # Median step times of steps 2..4 (before) and 140..150 (after the change).
  before=$(grep '^step [2-4] ' slow.out | sed 's/.*time \([0-9.]*\) ms.*/\1/' | sort -g | sed -n 2p)
  after=$(grep '^step 1[45][0-9] ' slow.out | sed 's/.*time \([0-9.]*\) ms.*/\1/' | sort -g | sed -n 6p)
  if [ "$status" -eq 0 ] && diff <(grep '^step' fast.out | awk '{print $1, $2, $3, $4, $5, $6}') \
                                  <(grep '^step' slow.out | awk '{print $1, $2, $3, $4, $5, $6}') >/dev/null &&
     awk -v a="$before" -v b="$after" 'BEGIN { exit !(b > 2 * a) }'; then
    ok "the link slowed to 50 Mbit/s at step 5: the run completes, steps take ${before} -> ${after} ms, every loss equals the unslowed run's"
  else
    bad "a link slowed mid-run (exit $status, step ${before} -> ${after} ms)" "$(paste <(grep '^step' fast.out | cut -c1-60) <(grep '^step' slow.out | cut -c1-60))"
  fi
else
  bad "a link slowed mid-run: the run did not reach step 5" "$(tail -n 20 slow.out)"
fi
exit $failed
