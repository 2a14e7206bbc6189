#!/usr/bin/env bash
# The test runner behind `make test` and `make check T=NAME`: runs the suites of tests/suites.txt
# (all of them, or the ones named) and ends with the totals: "N passed, N failed, N skipped".
# Exit status 1 if anything failed.
#
#   tests/run.sh             every suite, in the table's order (SUITE_JOBS at a time, default 2:
#                            the reports in order; SUITE_JOBS=1 one after another)
#   tests/run.sh NAME...     these suites (builds nothing: `make check T="NAME..."` builds what they need)
#   tests/run.sh --list      the suites, with what each needs built
#
# Every suite is a script that prints one line per check (`ok    WHAT`, `FAIL  WHAT`, or
# `skip  WHAT: WHY`) and exits non-zero on a failure; a suite that reports nothing, or exits
# non-zero without a FAIL line, fails. Lines of other shapes are shown indented.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
TABLE=tests/suites.txt

names=() scripts=() needs=() titles=()
while IFS='|' read -r name script need title; do
  name=$(echo $name); [ -z "$name" ] || [ "${name#\#}" != "$name" ] && continue
  names+=("$name"); scripts+=("$(echo $script)"); needs+=("$(echo $need)"); titles+=("$(echo "$title" | sed 's/^ *//; s/ *$//')")
done <"$TABLE"

if [ "${1:-}" = --list ] || [ "${1:-}" = -l ]; then
  echo "suites (make check T=NAME, or T=\"NAME NAME\"; make test runs them all; table: $TABLE):"
  for i in "${!names[@]}"; do printf '  %-14s %-11s %s\n' "${names[$i]}" "${needs[$i]}" "${titles[$i]}"; done
  exit 0
fi
case "${1:-}" in -h|--help) sed -n '2,12s/^# \{0,1\}//p' "$0"; exit 0 ;; esac

# The suites to run: all, or the named ones (in the order given).
run=()
if [ $# -eq 0 ]; then
  run=("${!names[@]}")
else
  for want in "$@"; do
    found=""
    for i in "${!names[@]}"; do [ "${names[$i]}" = "$want" ] && found=$i; done
    if [ -z "$found" ]; then
      echo "tests/run.sh: no suite '$want'; the suites: ${names[*]}" >&2
      exit 2
    fi
    run+=("$found")
  done
fi

# moec build's cache of NVRTC's images (codegen/cache.c) under the build folder: the suites build
# many of the same models for the CUDA target, each NVRTC compilation a second or more.
export MOEC_CACHE=${MOEC_CACHE:-$PWD/$BUILD/cache}

passed=0 failed=0 skipped=0
failures=()
ok()   { passed=$((passed + 1)); printf 'ok    %s\n' "$1"; }
bad()  { failed=$((failed + 1)); failures+=("$1"); printf 'FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | sed 's/^/      /' | head -n 40; }
skip() { skipped=$((skipped + 1)); printf 'skip  %s: %s\n' "$1" "$2"; }

# count_suite NAME FILE: counts the `ok    `, `FAIL  ` and `skip  ` lines of a suite's output
# (ending with its "exit status N" line).
count_suite() {
  local label=$1 file=$2 results=0 fails=0 line l
  while IFS= read -r line; do
    case "$line" in
      "ok    "*) ok "${line#ok    }"; results=$((results + 1)) ;;
      "FAIL  "*) bad "${line#FAIL  }"; results=$((results + 1)); fails=$((fails + 1)) ;;
      "skip  "*) l=${line#skip  }; skip "${l%%: *}" "${l#*: }"; results=$((results + 1)) ;;
      "exit status "*) [ "${line#exit status }" = 0 ] || [ "$fails" -gt 0 ] || bad "$label" "$file exited with ${line#exit status } without reporting a failure" ;;
      *) printf '      %s\n' "$line" ;;
    esac
  done <"$file"
  [ "$results" -gt 0 ] || bad "$label" "${scripts[$3]} reported no result"
}

# Suites run SUITE_JOBS at a time (default 2: most suites keep one core busy, so two at a time
# take the 2-core machine's both), their reports printed whole and in the table's order as soon
# as they and the ones before them are done. The suites that time themselves or the network
# (a build under 1 s, tune's bounded time, the emulated cluster's links and timeouts, MPI's
# failure detection) run alone.
SOLO=" plan-build tune cluster-link cluster-smoke cluster-faults mpi-comm mpi-failures "
JOBS=${SUITE_JOBS:-2}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/moec-run.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
start_suite() {   # K: suite run[K], in the background, its output to $OUT/K.out, its seconds to $OUT/K.time
  local i=${run[$1]}
  ( s0=$SECONDS
    BUILD=$BUILD MOEC=$MOEC bash "${scripts[$i]}" >"$OUT/$1.part" 2>&1 </dev/null
    echo "exit status $?" >>"$OUT/$1.part"
    echo $((SECONDS - s0)) >"$OUT/$1.time"
    mv "$OUT/$1.part" "$OUT/$1.out" ) &
}
times=() shown=0
show_done() {   # prints the finished suites whose predecessors are all printed
  while [ "$shown" -lt "${#run[@]}" ] && [ -f "$OUT/$shown.out" ]; do
    local i=${run[$shown]}
    printf '\n# %s (%s: %s)\n' "${titles[$i]}" "${names[$i]}" "${scripts[$i]}"
    count_suite "${names[$i]}" "$OUT/$shown.out" "$i"
    times+=("${names[$i]} $(cat "$OUT/$shown.time")s")
    shown=$((shown + 1))
  done
}
for k in "${!run[@]}"; do
  if [ "${SOLO/ ${names[${run[$k]}]} /}" != "$SOLO" ] || [ "$JOBS" -le 1 ]; then
    wait
    show_done
    start_suite "$k"
    wait
  else
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; show_done; done
    start_suite "$k"
  fi
  show_done
done
wait
show_done

echo
[ ${#run[@]} -gt 1 ] && echo "time per suite: $(printf '%s, ' "${times[@]}" | sed 's/, $//')"
for f in "${failures[@]}"; do echo "failed: $f"; done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
