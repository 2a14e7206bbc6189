#!/usr/bin/env bash
# The model zoo test: every lang/models/*.moe is compiled with `moec build`, trained for 10
# steps on the synthetic data (a language model, whose schedule warms up: 60 steps on its
# synthetic token sequences), and must learn: the loss at the last step below 0.9 x the loss at
# step 1. One line per model, `ok    zoo NAME: loss A -> B` or `FAIL  zoo NAME: why`; exit
# status 1 if any model failed.
#
# Binaries and the files they write (a record hook's NAME.record.jsonl) go to a temporary
# directory that is removed at the end; the binaries run inside it so the repository stays clean.
#
# Environment: BUILD (default build) locates $BUILD/moec; MOEC overrides the compiler's path;
# ZOO_STEPS (default 10) and ZOO_TIMEOUT (seconds per model run, default 60).
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
case "$MOEC" in /*) ;; *) MOEC=$ROOT/$MOEC ;; esac
STEPS=${ZOO_STEPS:-10}
LIMIT=${ZOO_TIMEOUT:-60}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-zoo.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT

failed=0
fail() { failed=$((failed + 1)); printf 'FAIL  zoo %s: %s\n' "$1" "$2"; [ -n "${3:-}" ] && printf '%s\n' "$3" | head -n 20 | sed 's/^/      /'; }

if [ ! -x "$MOEC" ]; then
  printf 'FAIL  zoo: no compiler at %s (run make first)\n' "$MOEC"
  exit 1
fi

models=(lang/models/*.moe)
if [ ! -f "${models[0]}" ]; then
  printf 'FAIL  zoo: no models in lang/models\n'
  exit 1
fi

for src in "${models[@]}"; do
  name=$(basename "$src" .moe)
  dir=$WORK/$name
  mkdir -p "$dir"
  if ! out=$("$MOEC" build "$src" -o "$dir/model" 2>&1); then
    fail "$name" "moec build failed" "$out"
    continue
  fi
  steps=$STEPS
  grep -q '^[^#]*\bvocab\b' "$src" && steps=${ZOO_LM_STEPS:-60}
  # Inside its own directory: a record hook writes MODEL.record.jsonl to the current directory.
  out=$(cd "$dir" && timeout "$LIMIT" ./model --steps "$steps" 2>&1)
  status=$?
  if [ $status -ne 0 ]; then
    [ $status -eq 124 ] && fail "$name" "training did not finish within ${LIMIT} s" \
                        || fail "$name" "training exited with status $status" "$(printf '%s\n' "$out" | tail -n 20)"
    continue
  fi
  first=$(printf '%s\n' "$out" | awk '$1 == "step" && $2 == 1 && $3 == "loss" { print $4; exit }')
  last=$(printf '%s\n' "$out" | awk -v n="$steps" '$1 == "step" && $2 == n && $3 == "loss" { print $4; exit }')
  if [ -z "$first" ] || [ -z "$last" ]; then
    fail "$name" "no loss for step 1 or step $steps in the output" "$(printf '%s\n' "$out" | tail -n 20)"
    continue
  fi
  if awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.9 * a) }'; then
    printf 'ok    zoo %s: loss %s -> %s\n' "$name" "$first" "$last"
  else
    fail "$name" "loss $first -> $last: step $steps is not below 0.9 x step 1"
  fi
done

[ $failed -eq 0 ]
