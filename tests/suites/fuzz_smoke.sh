#!/usr/bin/env bash
# Fuzz smoke: every libFuzzer harness ($BUILD/fuzz/fuzz_*, tests/fuzz/fuzz_*.c) runs
# FUZZ_SMOKE_SECONDS (default 20) from its corpus without a crash. `make fuzz` runs them longer.
. "$(dirname "$0")/../lib.sh"
work fuzz-smoke
seconds=${FUZZ_SMOKE_SECONDS:-20}
n=0
for f in "$BUILD"/fuzz/fuzz_*; do
  [ -x "$f" ] || continue
  n=$((n + 1))
  name=$(basename "$f"); corpus=tests/fuzz/corpus_${name#fuzz_}
  mkdir -p "$WORK/$name"
  if "$f" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 "$WORK/$name" "$corpus" >"$WORK/fz" 2>&1; then
    ok "$name: $(grep -o 'Done [0-9]* runs' "$WORK/fz" | awk '{print $2}') runs in ${seconds}s, no crash"
  else
    bad "$name" "$(tail -n 40 "$WORK/fz")"
  fi
done
[ $n -gt 0 ] || bad "fuzz smoke" "no $BUILD/fuzz/fuzz_* harnesses (make check T=fuzz-smoke builds them with clang)"
exit $failed
