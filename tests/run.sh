#!/usr/bin/env bash
# The test runner behind `make test` and `make check T=NAME`: runs the suites of tests/suites.txt
# (all of them, or the ones named) and ends with the totals: "N passed, N failed, N skipped".
# Exit status 1 if anything failed.
#
#   tests/run.sh             every suite, in the table's order
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

passed=0 failed=0 skipped=0
failures=()
ok()   { passed=$((passed + 1)); printf 'ok    %s\n' "$1"; }
bad()  { failed=$((failed + 1)); failures+=("$1"); printf 'FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | sed 's/^/      /' | head -n 40; }
skip() { skipped=$((skipped + 1)); printf 'skip  %s: %s\n' "$1" "$2"; }

# run_suite NAME SCRIPT: counts the script's `ok    `, `FAIL  ` and `skip  ` lines.
run_suite() {
  local label=$1 script=$2 results=0 fails=0 line l
  while IFS= read -r line; do
    case "$line" in
      "ok    "*) ok "${line#ok    }"; results=$((results + 1)) ;;
      "FAIL  "*) bad "${line#FAIL  }"; results=$((results + 1)); fails=$((fails + 1)) ;;
      "skip  "*) l=${line#skip  }; skip "${l%%: *}" "${l#*: }"; results=$((results + 1)) ;;
      "exit status "*) [ "${line#exit status }" = 0 ] || [ "$fails" -gt 0 ] || bad "$label" "$script exited with ${line#exit status } without reporting a failure" ;;
      *) printf '      %s\n' "$line" ;;
    esac
  done < <(BUILD=$BUILD MOEC=$MOEC bash "$script" 2>&1; echo "exit status $?")
  [ "$results" -gt 0 ] || bad "$label" "$script reported no result"
}

times=()
for i in "${run[@]}"; do
  printf '\n# %s (%s: %s)\n' "${titles[$i]}" "${names[$i]}" "${scripts[$i]}"
  start=$SECONDS
  run_suite "${names[$i]}" "${scripts[$i]}"
  times+=("${names[$i]} $((SECONDS - start))s")
done

echo
[ ${#run[@]} -gt 1 ] && echo "time per suite: $(printf '%s, ' "${times[@]}" | sed 's/, $//')"
for f in "${failures[@]}"; do echo "failed: $f"; done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
