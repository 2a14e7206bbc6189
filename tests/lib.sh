# The preamble every test suite shares (sourced, not run; tests/mpi/common.sh sources it too):
# the repository root as the working folder, BUILD and MOEC, a scratch folder WORK removed at the
# end (suite NAME: `work NAME`), and the result lines tests/run.sh counts: `ok    WHAT`,
# `FAIL  WHAT` (with WHY indented below it) and `skip  WHAT: WHY`. A suite ends with
# `exit $failed` (1 when anything failed).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
PY=/usr/bin/python3
failed=0 passed=0 nfailed=0    # failed: 1 after any FAIL (the exit status); the counts

ok()   { passed=$((passed + 1)); printf 'ok    %s\n' "$1"; }
bad()  { failed=1 nfailed=$((nfailed + 1)); printf 'FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -n 30 | sed 's/^/      /'; return 0; }
skip() { printf 'skip  %s: %s\n' "$1" "$2"; }

# work NAME: WORK, a fresh folder under TMPDIR, removed when the suite exits.
work() {
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-$1.XXXXXX") || exit 1
  trap 'rm -rf "$WORK"' EXIT
}

# OpenBLAS's link flags as make configured them (its OpenMP build, -fopenmp), as libmoert needs.
blas_libs() {
  local libs
  libs=$(sed -n 's/^BLAS_LIBS := //p' "$BUILD/config.mk" 2>/dev/null)
  echo "${libs:--lopenblas}"
}

# Checks side by side (the suites' independent builds and runs; each job one core, mostly):
# `spawn ID CMD ARGS...` runs CMD (a function or program) in the background with its output in
# $WORK/jobs/ID, at most TEST_JOBS at a time (default: the cores); `collect ID...` waits for them
# all and prints each job's output in the order given, counting its ok and FAIL lines as this
# shell's (a job reports by its lines; its exit status is not looked at). A job must not share
# files with another: each writes under a folder or names of its own.
TEST_JOBS=${TEST_JOBS:-$(nproc 2>/dev/null || echo 1)}
spawn() {
  local id=$1
  shift
  mkdir -p "$WORK/jobs"
  while [ "$(jobs -rp | wc -l)" -ge "$TEST_JOBS" ]; do wait -n; done
  ("$@") >"$WORK/jobs/$id" 2>&1 </dev/null &
}
collect() {
  wait
  local id n
  for id in "$@"; do
    [ -f "$WORK/jobs/$id" ] || { bad "job $id: no output"; continue; }
    cat "$WORK/jobs/$id"
    n=$(grep -c '^FAIL  ' "$WORK/jobs/$id")
    [ "$n" -gt 0 ] && failed=1 nfailed=$((nfailed + n))
    passed=$((passed + $(grep -c '^ok    ' "$WORK/jobs/$id")))
  done
}

# The memory features' suites (tests/lm/shard.sh, tests/lm/recompute.sh, tests/lm/vocab.sh):
# lm_variant MODEL FIELDS PARALLEL SCHEDULE: tests/models/grad_lm_MODEL.moe with the caller's $ADAMW
# for its optimizer, the model fields FIELDS after its seed, and the statements PARALLEL and
# SCHEDULE before its first layer.
lm_variant() {
  local seed
  seed=$(sed -n 's/.*\(seed [0-9]*;\).*/\1/p' "tests/models/grad_lm_$1.moe" | head -n 1)
  sed "s/optimizer sgd { lr 0.01; }/$ADAMW/; s/$seed/$seed $2/; s/^layer \([a-z]*\) x 2/$3\n$4\nlayer \1 x 2/" \
    "tests/models/grad_lm_$1.moe"
}
# step_lines OUT: a run's step lines without their times (what two runs of the same bits share).
step_lines() { grep '^step' "$1" | sed 's/  time.*//'; }
# plan_peak F.moe: the memory plan's peak per rank in bytes, as `moec build -v` prints it ("" when
# moec fails). With --emit c: the passes that plan the memory run, the C compiler does not (the
# program itself is not needed for its plan).
plan_peak() { "$MOEC" build "$1" -v --emit c -o "$WORK/plan_peak.c" 2>&1 | sed -n 's/^# memplan: peak .*(\([0-9]*\) bytes)$/\1/p' | tail -n 1; }
# ir_roundtrip F.moe PASS PATTERN...: dump-ir of F after PASS ($WORK/a.ir) reads back the same and
# holds a line matching each grep pattern; false otherwise ($WORK/err and a diff of $WORK/b.ir say why).
ir_roundtrip() {
  local model=$1 pass=$2 pat
  shift 2
  "$MOEC" dump-ir "$model" --after="$pass" >"$WORK/a.ir" 2>"$WORK/err" &&
    "$MOEC" dump-ir "$WORK/a.ir" >"$WORK/b.ir" 2>>"$WORK/err" && cmp -s "$WORK/a.ir" "$WORK/b.ir" || return 1
  for pat in "$@"; do grep -q "$pat" "$WORK/a.ir" || return 1; done
}
