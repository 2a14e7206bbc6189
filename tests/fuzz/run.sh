#!/usr/bin/env bash
# `make fuzz`: each libFuzzer harness (build/fuzz/fuzz_moe: the front end on .moe text;
# build/fuzz/fuzz_ir: the IR parser and verifier) for FUZZ_SECONDS (default 300) on its corpus
# (tests/fuzz/corpus_NAME, with tests/fuzz/NAME.dict where there is one). New inputs go to
# $BUILD/fuzz/corpus_NAME (never into git); a crash, leak, timeout or sanitizer report is saved
# as $BUILD/fuzz/artifacts/NAME/crash-* and fails the run. One ok/FAIL line per harness.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
SECONDS_EACH=${FUZZ_SECONDS:-300}
status=0 ran=0
for f in "$BUILD"/fuzz/fuzz_*; do
  [ -x "$f" ] || continue
  ran=$((ran + 1))
  name=$(basename "$f"); short=${name#fuzz_}
  corpus=$BUILD/fuzz/corpus_$short artifacts=$BUILD/fuzz/artifacts/$short
  mkdir -p "$corpus" "$artifacts"
  dict=(); [ -f "tests/fuzz/$short.dict" ] && dict=(-dict="tests/fuzz/$short.dict")
  echo "# $name: ${SECONDS_EACH}s, corpus $corpus + tests/fuzz/corpus_$short${dict:+, ${dict[0]#-dict=}}"
  if "$f" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$artifacts/" "${dict[@]}" "$corpus" "tests/fuzz/corpus_$short" >"$BUILD/fuzz/$short.log" 2>&1; then
    echo "ok    $name: $(grep -o 'Done [0-9]* runs' "$BUILD/fuzz/$short.log" | awk '{print $2}') runs in ${SECONDS_EACH}s, no crash ($(ls "$corpus" | wc -l) inputs in $corpus)"
  else
    status=1
    echo "FAIL  $name: see $BUILD/fuzz/$short.log; the input is in $artifacts/"
    tail -n 30 "$BUILD/fuzz/$short.log" | sed 's/^/      /'
  fi
done
if [ "$ran" -eq 0 ]; then echo "FAIL  fuzz: no harness in $BUILD/fuzz (make fuzz builds them with clang)"; exit 1; fi
exit $status
