#!/usr/bin/env bash
# Fuzz smoke: every libFuzzer harness ($BUILD/fuzz/fuzz_*, tests/fuzz/fuzz_*.c) runs
# FUZZ_SMOKE_SECONDS (default 20) from its corpus without a crash. `make fuzz` runs them longer.
. "$(dirname "$0")/../lib.sh"
work fuzz-smoke
seconds=${FUZZ_SMOKE_SECONDS:-20}
# The harnesses side by side, one per core (spawn, tests/lib.sh): each runs its seconds either way.
fuzz_one() {  # harness
  local f=$1 name corpus
  name=$(basename "$f"); corpus=tests/fuzz/corpus_${name#fuzz_}
  mkdir -p "$WORK/$name"
  if "$f" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 "$WORK/$name" "$corpus" >"$WORK/$name.out" 2>&1; then
    ok "$name: $(grep -o 'Done [0-9]* runs' "$WORK/$name.out" | awk '{print $2}') runs in ${seconds}s, no crash"
  else
    bad "$name" "$(tail -n 40 "$WORK/$name.out")"
  fi
}
ids=()
for f in "$BUILD"/fuzz/fuzz_*; do
  [ -x "$f" ] || continue
  spawn "$(basename "$f")" fuzz_one "$f"
  ids+=("$(basename "$f")")
done
[ ${#ids[@]} -gt 0 ] || bad "fuzz smoke" "no $BUILD/fuzz/fuzz_* harnesses (make check T=fuzz-smoke builds them with clang)"
[ ${#ids[@]} -gt 0 ] && collect "${ids[@]}"
exit $failed
