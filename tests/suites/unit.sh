#!/usr/bin/env bash
# The unit tests (cmocka, tests/unit/test_*.c): every $BUILD/tests/test_* program, one line each.
. "$(dirname "$0")/../lib.sh"
n=0
for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  n=$((n + 1))
  name=$(basename "$t")
  if out=$("$t" 2>&1); then ok "$name"; else bad "$name" "$out"; fi
done
[ $n -gt 0 ] || bad "unit tests" "no $BUILD/tests/test_* programs (make check T=unit builds them)"
exit $failed
