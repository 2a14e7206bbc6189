#!/usr/bin/env bash
# A compiled model started on the wrong number of ranks fails at start: one clear message from
# rank 0, a non-zero exit, and no hang (every run is under a timeout). Prints `ok    ...` /
# `FAIL  ...` lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-fail.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
. tests/mpi/common.sh

if ! "$MOEC" build tests/golden/parallel.moe -o "$WORK/p4" 2>"$WORK/err"; then
  bad "build a 4-rank model" "$(cat "$WORK/err")"; exit 1
fi
for np in 1 2 8; do
  start=$(date +%s)
  if [ "$np" = 1 ]; then (cd "$WORK" && timeout 60 ./p4 --steps 2 >out 2>&1 </dev/null); status=$?
  else (cd "$WORK" && timeout 60 $MPIRUN -np "$np" ./p4 --steps 2 >out 2>&1 </dev/null); status=$?; fi
  secs=$(( $(date +%s) - start ))
  errors=$(grep -c 'moert: error' "$WORK/out")
  if [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && [ "$errors" = 1 ] && ! grep -q '^step' "$WORK/out"; then
    ok "4-rank model on $np rank(s): exit $status in ${secs}s with one message: $(grep 'moert: error' "$WORK/out" | head -n 1)"
  else
    bad "4-rank model on $np rank(s): exit $status, $errors error lines" "$(cat "$WORK/out")"
  fi
done

# A rank that dies mid-step: the others exit non-zero within the timeout, and the checkpoint
# written before stays intact (resuming from it repeats the uninterrupted run's losses).
losses() { grep '^step' "$1" | awk '{print $2, $4}'; }
run4() { (cd "$WORK" && timeout 90 $MPIRUN -np 4 ./p4 "$@" </dev/null); }
if run4 --steps 6 >"$WORK/full" 2>&1 && run4 --steps 3 --save ckpt >"$WORK/first" 2>&1; then
  start=$(date +%s)
  (cd "$WORK" && MOERT_TEST_KILL=1:5 timeout 90 $MPIRUN -x MOERT_TEST_KILL -np 4 ./p4 --steps 6 --resume ckpt --save ckpt \
     >"$WORK/killed" 2>&1 </dev/null)
  status=$? secs=$(( $(date +%s) - start ))
  if [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && ! grep -q '^step 6' "$WORK/killed"; then
    ok "rank 1 of 4 killed in step 5: mpirun exits $status after ${secs}s, no rank hangs"
  else
    bad "rank 1 of 4 killed in step 5: exit $status" "$(tail -n 20 "$WORK/killed")"
  fi
  if run4 --steps 6 --resume ckpt >"$WORK/again" 2>&1 && [ "$(losses "$WORK/again")" = "$(losses "$WORK/full" | awk '$1 > 3')" ]; then
    ok "the step-3 checkpoint is intact after the crash: resuming repeats steps 4-6 exactly"
  else
    bad "the checkpoint after the crash" "$(diff <(losses "$WORK/full" | awk '$1 > 3') <(losses "$WORK/again"); tail -n 5 "$WORK/again")"
  fi
else
  bad "4-rank training and checkpoint before the crash test" "$(tail -n 20 "$WORK/full" "$WORK/first")"
fi
exit $failed
