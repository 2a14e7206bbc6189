#!/usr/bin/env bash
# The test runner behind `make test` and `make check T=NAME`: runs the suites of tests/suites.txt
# (all of them, or the ones named) and ends with the totals: "N passed, N failed, N skipped".
# Exit status 1 if anything failed.
#
#   tests/run.sh             every suite (SUITE_JOBS at a time, default 2; SUITE_JOBS=1 one after
#                            another; the order below), and the suites that claim exact bits
#                            again on other kernels (below)
#   tests/run.sh NAME...     these suites (builds nothing: `make check T="NAME..."` builds what they need)
#   tests/run.sh --other-kernels [NAME...]
#                            only the second pass: these suites (default: the bits suites below)
#                            on the other kernels
#   tests/run.sh --list      the suites, with what each needs built
#
# The second pass. The suites whose checks compare two programs bit for bit (BITS below) run
# again with OpenBLAS's kernels of another class than this run's own (OPENBLAS_CORETYPE: the
# first of Haswell, SkylakeX, Prescott that is not this run's and that the CPU runs) and the
# runtime's next narrower vector path (MOERT_VECTOR: avx512 -> avx2 -> baseline), their lines
# marked "[CORE, PATH]". An exactness claim that holds only for the kernels of the machine it was
# written on (a GEMM whose shape differs between the two programs rounds alike on some kernels
# and not on others) fails there on any machine. threads and golden-runs are not in it: they set
# OPENBLAS_CORETYPE and MOERT_VECTOR themselves (threads runs every vector path with its kernels;
# golden-runs pins Haswell's, so that its recorded bytes hold on every AVX2 CPU). A suite sees
# TESTS_SECOND_PASS=1 there (mpi-twin runs its layouts nearest their tolerance only; lm-recompute,
# lm-shard and lm-vocab their claims of equal bits only, not --check-grad, plans and refusals).
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

BITS="lm-vocab lm-recompute mpi-twin lm-shard lm-checkpoint balance tiny"

if [ "${1:-}" = --list ] || [ "${1:-}" = -l ]; then
  echo "suites (make check T=NAME, or T=\"NAME NAME\"; make test runs them all; table: $TABLE):"
  for i in "${!names[@]}"; do printf '  %-14s %-11s %s\n' "${names[$i]}" "${needs[$i]}" "${titles[$i]}"; done
  exit 0
fi
case "${1:-}" in -h|--help) sed -n '2,12s/^# \{0,1\}//p' "$0"; exit 0 ;; esac

# index_of NAME...: the suites' indices in the table (exit 2 on an unknown name).
index_of() {
  local want found i
  for want in "$@"; do
    found=""
    for i in "${!names[@]}"; do [ "${names[$i]}" = "$want" ] && found=$i; done
    if [ -z "$found" ]; then
      echo "tests/run.sh: no suite '$want'; the suites: ${names[*]}" >&2
      exit 2
    fi
    echo "$found"
  done
}

# The suites to run: all, or the named ones (in the order given); second: those of the second
# pass.
run=() second=()
if [ "${1:-}" = --other-kernels ]; then
  shift
  [ $# -gt 0 ] || set -- $BITS
  second=($(index_of "$@")) || exit 2
elif [ $# -eq 0 ]; then
  run=("${!names[@]}")
  second=($(index_of $BITS)) || exit 2
else
  run=($(index_of "$@")) || exit 2
fi

# The second pass's kernels: this run's own class (OPENBLAS_CORETYPE when set, else what OpenBLAS
# picks on this CPU: SkylakeX's with AVX-512, Haswell's (Zen's) with AVX2, else Prescott's) and
# vector path (MOERT_VECTOR, else the widest the CPU runs); the other: the first of Haswell,
# SkylakeX, Prescott that differs and runs here, and the next narrower path.
cpu_has() { grep -qw "$1" /proc/cpuinfo 2>/dev/null; }
core_class() {
  case "$(echo "$1" | tr 'A-Z' 'a-z')" in
    skylakex|cooperlake|sapphirerapids) echo SkylakeX ;;
    haswell|zen|skylake|broadwell) echo Haswell ;;
    *) echo Prescott ;;
  esac
}
if [ -n "${OPENBLAS_CORETYPE:-}" ]; then own_core=$(core_class "$OPENBLAS_CORETYPE")
elif cpu_has avx512f; then own_core=SkylakeX
elif cpu_has avx2; then own_core=Haswell
else own_core=Prescott; fi
other_core=""
for c in Haswell SkylakeX Prescott; do
  [ "$c" = "$own_core" ] && continue
  [ "$c" = Haswell ] && ! cpu_has avx2 && continue
  [ "$c" = SkylakeX ] && ! cpu_has avx512f && continue
  other_core=$c; break
done
own_path=${MOERT_VECTOR:-}
[ -n "$own_path" ] || { if cpu_has avx512f; then own_path=avx512; elif cpu_has avx2; then own_path=avx2; else own_path=baseline; fi; }
case $own_path in avx512) other_path=avx2 ;; *) other_path=baseline ;; esac

# moec build's cache of NVRTC's images (codegen/cache.c) under the build folder: the suites build
# many of the same models for the CUDA target, each NVRTC compilation a second or more.
export MOEC_CACHE=${MOEC_CACHE:-$PWD/$BUILD/cache}

passed=0 failed=0 skipped=0
failures=()
ok()   { passed=$((passed + 1)); printf 'ok    %s\n' "$1"; }
bad()  { failed=$((failed + 1)); failures+=("$1"); printf 'FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | sed 's/^/      /' | head -n 40; }
skip() { skipped=$((skipped + 1)); printf 'skip  %s: %s\n' "$1" "$2"; }

# count_suite NAME FILE K [MARK]: counts the `ok    `, `FAIL  ` and `skip  ` lines of a suite's
# output (ending with its "exit status N" line), each marked MARK (the second pass's kernels).
count_suite() {
  local label=$1 file=$2 results=0 fails=0 line l m=${4:+$4 }
  while IFS= read -r line; do
    case "$line" in
      "ok    "*) ok "$m${line#ok    }"; results=$((results + 1)) ;;
      "FAIL  "*) bad "$m${line#FAIL  }"; results=$((results + 1)); fails=$((fails + 1)) ;;
      "skip  "*) l=${line#skip  }; skip "$m${l%%: *}" "${l#*: }"; results=$((results + 1)) ;;
      "exit status "*) [ "${line#exit status }" = 0 ] || [ "$fails" -gt 0 ] || bad "$label" "$file exited with ${line#exit status } without reporting a failure" ;;
      *) printf '      %s\n' "$line" ;;
    esac
  done <"$file"
  [ "$results" -gt 0 ] || bad "$label" "${scripts[$3]} reported no result"
}

# Suites run SUITE_JOBS at a time (default 2: most suites keep one core busy, so two at a time
# take the 2-core machine's both), each one's report printed whole as soon as it is done. The suites
# that time themselves or the network (a build under 1 s, tune's bounded time, the emulated
# cluster's links and timeouts, MPI's failure detection) run alone, first. Then the others, the
# long ones first (LONG, in about the order of their times on a 2-core machine), so that the
# last to finish are short and no core waits long for another at the end; a suite of the second
# pass starts when its first-pass run is done (a script never runs twice at once).
SOLO=" plan-build tune cluster-link cluster-smoke cluster-faults mpi-comm mpi-failures "
LONG=" cuda-host cuda-kernels gradcheck golden-runs lm-layout ref lm-recompute tune-cuda mpi-twin mpi-chunks lm-pipeline lm-lora lm-hf "
JOBS=${SUITE_JOBS:-2}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/moec-run.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
# The runs: item K is suite index[K] of pass passof[K] (1, or 2: the second pass), its output
# $OUT/K.out, its seconds $OUT/K.time.
# The suites of QUICK_C build their programs with MOEC_OPT=-O0 (codegen/link.c; unless the caller
# set MOEC_OPT), those of QUICK_C1 with -O1: they build many small programs and run each for a
# step or a few (gradcheck: many passes, where -O1 is the quicker of the two), and compare
# programs of one build with each other, where the C compiler's -O2 took most of a suite's time
# (-O0: 1.2 s less a build). Every -O level gives the same bits (no FMA contraction under
# -std=c11, no reassociation): golden-runs, tiny, zoo, threads, the README's suite and the CUDA
# kernels' keep -O2, the users' default, and hold its bits (golden-runs' recorded ones); so do the
# suites that time the programs (tune, the plans against measured steps, the emulated cluster).
QUICK_C=" lm-layout lm-checkpoint lm-shard lm-recompute lm-vocab lm-hf lm-inputs lm-gradpart lm-pipeline lm-lora "
QUICK_C+="lm-lora-hf mpi-rt-main mpi-reshard mpi-twin mpi-chunks mpi-gradpart balance cuda-host cuda-pipeline "
QUICK_C1=" gradcheck "
SECOND_ENV="" SECOND_MARK=""   # the second pass's environment words and mark (set below)
mark_of() { [ "${passof[$1]}" = 2 ] && echo "$SECOND_MARK"; }
start_suite() {   # K: item K, in the background
  local i=${index[$1]} o=$OUT/$1 opt=${MOEC_OPT:-} penv=""
  [ "${passof[$1]}" = 2 ] && penv=$SECOND_ENV
  case "$QUICK_C" in *" ${names[$i]} "*) opt=${MOEC_OPT:--O0} ;; esac
  case "$QUICK_C1" in *" ${names[$i]} "*) opt=${MOEC_OPT:--O1} ;; esac
  ( s0=$SECONDS
    env $penv BUILD=$BUILD MOEC=$MOEC ${opt:+MOEC_OPT=$opt} bash "${scripts[$i]}" >"$o.part" 2>&1 </dev/null
    echo "exit status $?" >>"$o.part"
    echo $((SECONDS - s0)) >"$o.time"
    mv "$o.part" "$o.out" ) &
}
times=() printed=()
second_header=false
show_done() {   # prints the reports of the finished items not printed yet (in the items' order)
  local k i m
  for k in "${!index[@]}"; do
    [ -z "${printed[$k]:-}" ] && [ -f "$OUT/$k.out" ] || continue
    printed[$k]=1
    i=${index[$k]}
    m=$(mark_of "$k")
    if [ "${passof[$k]}" = 2 ] && ! $second_header; then
      second_header=true
      printf '\n# the second pass: the suites that claim exact bits, with OpenBLAS'"'"'s %s kernels (this run'"'"'s: %s) and the %s vector path (this run'"'"'s: %s)\n' \
        "$other_core" "$own_core" "$other_path" "$own_path"
    fi
    printf '\n# %s%s (%s: %s)\n' "${m:+$m }" "${titles[$i]}" "${names[$i]}" "${scripts[$i]}"
    count_suite "${names[$i]}" "$OUT/$k.out" "$i" "$m"
    times+=("${m:+$m }${names[$i]} $(cat "$OUT/$k.time")s")
  done
}
is_in() { case "$1" in *" $2 "*) return 0 ;; esac; return 1; }
run_items() {
  local k j order=() w
  # The order they start in: the solo suites, the long ones, the rest (each in the items' order).
  for k in "${!index[@]}"; do is_in "$SOLO" "${names[${index[$k]}]}" && [ "${passof[$k]}" = 1 ] && order+=("$k"); done
  for w in $LONG; do
    for k in "${!index[@]}"; do [ "${names[${index[$k]}]}" = "$w" ] && [ "${passof[$k]}" = 1 ] && order+=("$k"); done
  done
  for k in "${!index[@]}"; do
    is_in "$SOLO" "${names[${index[$k]}]}" && [ "${passof[$k]}" = 1 ] && continue
    is_in "$LONG" "${names[${index[$k]}]}" && [ "${passof[$k]}" = 1 ] && continue
    order+=("$k")
  done
  for k in "${order[@]}"; do
    if is_in "$SOLO" "${names[${index[$k]}]}" || [ "$JOBS" -le 1 ]; then
      wait
      show_done
      start_suite "$k"
      wait
    else
      while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; show_done; done
      if [ "${passof[$k]}" = 2 ]; then   # after its first-pass run
        for j in "${!index[@]}"; do
          [ "${passof[$j]}" = 1 ] && [ "${index[$j]}" = "${index[$k]}" ] || continue
          while [ ! -f "$OUT/$j.out" ]; do wait -n; show_done; done
        done
      fi
      start_suite "$k"
    fi
    show_done
  done
  wait
  show_done
}
t0=$SECONDS
index=() passof=()
for i in "${run[@]}"; do index+=("$i") passof+=(1); done
if [ ${#second[@]} -gt 0 ]; then
  if [ -z "$other_core" ]; then
    skip "second pass (${BITS// /, })" "this CPU runs no OpenBLAS kernels but its own ($own_core: no AVX2)"
  else
    SECOND_ENV="OPENBLAS_CORETYPE=$other_core MOERT_VECTOR=$other_path TESTS_SECOND_PASS=1"
    SECOND_MARK="[$other_core, $other_path]"
    for i in "${second[@]}"; do index+=("$i") passof+=(2); done
  fi
fi
[ ${#index[@]} -eq 0 ] || run_items

echo
[ ${#times[@]} -gt 1 ] && echo "time per suite: $(printf '%s, ' "${times[@]}" | sed 's/, $//'); $((SECONDS - t0)) s in all"
for f in "${failures[@]}"; do echo "failed: $f"; done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
