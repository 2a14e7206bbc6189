#!/usr/bin/env bash
# IR round trips: print(parse(print(m))) == print(m) after every pass, for every model of
# lang/models, tests/models and tests/golden.
. "$(dirname "$0")/../lib.sh"
work roundtrip
passes="lower $("$MOEC" passes | awk '{print $1}' | tr '\n' ' ')"
for model in lang/models/*.moe tests/models/*.moe tests/golden/*.moe; do
  [ -f "$model" ] || continue
  for pass in $passes; do
    label="roundtrip $(basename "$model") after $pass"
    if ! "$MOEC" dump-ir "$model" --after="$pass" >"$WORK/a.ir" 2>"$WORK/err"; then bad "$label" "$(cat "$WORK/err")"; continue; fi
    if ! "$MOEC" dump-ir "$WORK/a.ir" >"$WORK/b.ir" 2>"$WORK/err"; then bad "$label" "$(cat "$WORK/err")"; continue; fi
    if cmp -s "$WORK/a.ir" "$WORK/b.ir"; then ok "$label"; else bad "$label" "$(diff -u "$WORK/a.ir" "$WORK/b.ir" | head -n 20)"; fi
  done
done
# The CUDA target's fuse pass (issue 39): its groups (`fused G KIND reads (...) writes (...) { ... }`,
# the parser checking the header against the members), inner=1 and moved ops round-trip too, and
# the language models have groups to show.
grouped=0
for model in lang/models/*.moe; do
  label="roundtrip $(basename "$model") --target cuda after fuse"
  if ! "$MOEC" dump-ir "$model" --target cuda --after=fuse >"$WORK/a.ir" 2>"$WORK/err"; then bad "$label" "$(cat "$WORK/err")"; continue; fi
  if ! "$MOEC" dump-ir "$WORK/a.ir" >"$WORK/b.ir" 2>"$WORK/err"; then bad "$label" "$(cat "$WORK/err")"; continue; fi
  grep -qE '^  fused [0-9]+ ' "$WORK/a.ir" && grouped=$((grouped + 1))
  if cmp -s "$WORK/a.ir" "$WORK/b.ir"; then ok "$label"; else bad "$label" "$(diff -u "$WORK/a.ir" "$WORK/b.ir" | head -n 20)"; fi
done
if [ "$grouped" -ge 3 ]; then ok "dump-ir --target cuda --after=fuse: $grouped models with fused groups"
else bad "dump-ir --target cuda --after=fuse" "$grouped models with fused groups (expected 3 or more)"; fi
exit $failed
