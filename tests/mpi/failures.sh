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
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN="mpirun --oversubscribe --allow-run-as-root --mca btl self,vader --bind-to none"
failed=0
ok() { printf 'ok    %s\n' "$1"; }
bad() { failed=1; printf 'FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -n 20 | sed 's/^/      /'; }

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
exit $failed
