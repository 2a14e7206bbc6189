#!/usr/bin/env bash
# The command line (run by tests/run.sh, one ok/FAIL line per check):
# - every command `moec --help` lists answers `moec COMMAND --help` (and -h) with its usage on
#   stdout and exit status 0; an unknown option names the command's --help;
# - the moec under test was built with this machine's configuration: the flags `moec --version -v`
#   links programs with equal what mk/configure.sh finds now (a moec built before the packages
#   were installed would carry empty MPI flags, issue 11).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}

commands=$("$MOEC" --help | awk '/^commands:/ {on = 1; next} on && /^  [a-z]/ {print $1}' | sort -u)
[ -n "$commands" ] || echo "FAIL  moec --help lists no commands"
for c in $commands; do
  for flag in --help -h; do
    out=$("$MOEC" "$c" $flag 2>&1); st=$?
    if [ $st -eq 0 ] && printf '%s\n' "$out" | head -n 1 | grep -q "^usage: .*moec $c\b"; then
      echo "ok    moec $c $flag: usage, exit 0"
    else
      echo "FAIL  moec $c $flag: exit $st, first line '$(printf '%s\n' "$out" | head -n 1)'"
    fi
  done
done
for c in check build plan; do
  out=$("$MOEC" "$c" --no-such-option x.moe 2>&1); st=$?
  if [ $st -eq 2 ] && printf '%s' "$out" | grep -q "moec $c --help"; then echo "ok    moec $c --no-such-option: exit 2, points at 'moec $c --help'"
  else echo "FAIL  moec $c --no-such-option: exit $st: $out"; fi
done

# A relative `cluster "F";` is read from the .moe file's folder first: the paper's models (which
# name ../../clusters/testbed-a.cluster) plan from any folder.
root=$(pwd)
case "$MOEC" in /*) moec_abs=$MOEC ;; *) moec_abs=$root/$MOEC ;; esac
out=$(cd / && "$moec_abs" plan "$root/lang/models/paper/gpt2_xl_moe.moe" 2>&1); st=$?
if [ $st -eq 0 ] && printf '%s' "$out" | grep -q 'testbed-a'; then
  echo "ok    a .moe file's cluster path is relative to the file: the paper's model plans from / ($(printf '%s' "$out" | grep -m1 '^# cluster' | cut -c1-80))"
else
  echo "FAIL  the paper's model from another folder: exit $st: $(printf '%s' "$out" | head -n 5)"
fi

# The configuration: mk/configure.sh's variables -> the keys of `moec --version -v`.
now=$(bash mk/configure.sh - 2>&1) || { echo "FAIL  mk/configure.sh: $now"; exit 0; }
built=$("$MOEC" --version -v)
value() { printf '%s\n' "$1" | awk -v k="$2" '{key = $1; sub(/^[^ ]* ?(:= ?)?/, "")} key == k {print; exit}'; }
mismatch=""
for pair in MPI_CFLAGS:mpi_cflags MPI_LIBS:mpi_libs CUDA_PROGRAM_CFLAGS:cuda_cflags CUDA_PROGRAM_LIBS:cuda_libs BLAS_LIBS:blas_libs; do
  want=$(value "$now" "${pair%%:*}"); got=$(value "$built" "${pair#*:}")
  [ "$want" = "$got" ] || mismatch="$mismatch
  ${pair#*:}: moec was built with '$got', this machine has '$want'"
done
if [ -z "$mismatch" ]; then
  echo "ok    moec --version -v: built with this machine's configuration (MPI: $(value "$built" mpi_cflags | cut -c1-60))"
else
  echo "FAIL  moec was built with another configuration than this machine's (rebuild: make):$mismatch"
fi

# The build cache keeps linked programs (lang/manual.md §14): the same model built again comes
# from it, byte for byte, and trains alike; a changed model misses it; MOEC_CACHE=off links every
# time; past MOEC_CACHE_PROGRAMS_MB the least recently used programs go.
bc=$(mktemp -d)
sed 's/seed 42;/seed 43;/' lang/models/tiny.moe >"$bc/tiny43.moe"
sed 's/seed 42;/seed 44;/' lang/models/tiny.moe >"$bc/tiny44.moe"
b() { MOEC_CACHE=$bc/cache "$MOEC" build -v "$@" 2>&1 >/dev/null | grep -c '^# build cache:'; }
h1=$(b lang/models/tiny.moe -o "$bc/t1"); h2=$(b lang/models/tiny.moe -o "$bc/t2"); h3=$(b "$bc/tiny43.moe" -o "$bc/t3")
h4=$(MOEC_CACHE=off "$MOEC" build -v lang/models/tiny.moe -o "$bc/t4" 2>&1 >/dev/null | grep -c '^# build cache:')
h5=$(MOEC_CACHE_PROGRAMS_MB=1 b "$bc/tiny44.moe" -o "$bc/t5"); left=$(ls "$bc/cache" | grep -c '\.bin$')
h6=$(b lang/models/tiny.moe -o "$bc/t6")
l1=$("$bc/t1" --steps 3 | awk '/^step/ {print $4}'); l2=$("$bc/t2" --steps 3 | awk '/^step/ {print $4}')
if [ "$h1$h2$h3$h4$h5$h6" = 010000 ] && cmp -s "$bc/t1" "$bc/t2" && [ "$left" = 0 ] && [ -n "$l1" ] && [ "$l1" = "$l2" ]; then
  echo "ok    the build cache: a second build of tiny.moe takes the linked program from it (the same bytes, the same losses); another seed and MOEC_CACHE=off link again, and a link past MOEC_CACHE_PROGRAMS_MB=1 drops the cached programs (tiny.moe links again after it)"
else
  echo "FAIL  the build cache of programs: cache lines per build $h1 $h2 $h3 $h4 $h5 $h6 (want 0 1 0 0 0 0), $left programs left after pruning to 1 MiB"
fi
# MOEC_OPT: the program at -O0 trains to the bits of the -O2 one (the same losses); a level it does
# not take is refused, saying which it takes.
o0=$(MOEC_CACHE=off MOEC_OPT=-O0 "$MOEC" build -v lang/models/tiny.moe -o "$bc/t0" 2>&1 >/dev/null | grep -c '^# link: .* -O0 ')
l0=$("$bc/t0" --steps 3 2>/dev/null | awk '/^step/ {print $4}')
if [ "$o0" = 1 ] && [ -n "$l0" ] && [ "$l0" = "$l1" ] &&
   ! MOEC_OPT=-Ofast "$MOEC" build lang/models/tiny.moe -o "$bc/tf" 2>"$bc/err" &&
   grep -q "MOEC_OPT is '-Ofast'; it takes -O0, -O1, -O2 or -O3" "$bc/err"; then
  echo "ok    MOEC_OPT=-O0 builds tiny.moe at -O0 and it trains to the -O2 program's losses; MOEC_OPT=-Ofast is refused: $(head -n 1 "$bc/err" | cut -c1-90)"
else
  echo "FAIL  MOEC_OPT: -O0 link lines $o0 (want 1), losses '$l0' against '$l1'; -Ofast: $(cat "$bc/err" 2>/dev/null | head -n 2)"
fi
rm -rf "$bc"
