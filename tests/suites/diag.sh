#!/usr/bin/env bash
# The diagnostics goldens: tests/diag/NAME.moe with NAME.err, the exact stderr of
# `moec check NAME.moe` (exit status 1), with $BUILD/moec and with the ASan+UBSan build
# $BUILD/asan/moec. NAME.args, when present, replaces the arguments: either a whole command line
# after `moec` (starting with check, build or dump-ir) or the arguments of `moec check`.
. "$(dirname "$0")/../lib.sh"
work diag
ASAN_MOEC=$BUILD/asan/moec
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

diag_args() {
  local base=$1 args
  if [ -f "$base.args" ]; then
    args=$(head -n 1 "$base.args")
    case "$args" in check\ *|build\ *|dump-ir\ *) echo "$args" ;; *) echo "check $args" ;; esac
  else
    echo "check $base.moe"
  fi
}
for err in tests/diag/*.err; do
  [ -f "$err" ] || continue
  base=${err%.err}
  name=diag/$(basename "$base")
  args=$(diag_args "$base")
  for bin in "$MOEC" "$ASAN_MOEC"; do
    label=$name; [ "$bin" = "$ASAN_MOEC" ] && label="$name (asan+ubsan)"
    # shellcheck disable=SC2086
    "$bin" $args >"$WORK/out" 2>"$WORK/err" </dev/null
    status=$?
    if [ $status -ne 1 ]; then bad "$label" "exit status $status, expected 1; stderr: $(head -c 2000 "$WORK/err")"; continue; fi
    if ! diff -u "$err" "$WORK/err" >"$WORK/diff"; then bad "$label" "$(head -n 40 "$WORK/diff")"; continue; fi
    ok "$label"
  done
done
exit $failed
