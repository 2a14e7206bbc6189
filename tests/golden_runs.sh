#!/usr/bin/env bash
# Runs of every model against goldens, first recorded before the codegen refactor of issue 12
# (which left them bit-identical) and re-recorded since by the commits meant to change the
# numbers (vectorised kernels, the thread pool, ...: git log -- tests/golden/runs.txt); models
# added later were recorded beside them. Each model of lang/models, tests/models and tests/golden
# is built for the CPU and for the CUDA target on the fake device (MOEC_CUDA_FAKE=1), trained 3
# steps with --dump on the ranks its layout needs, and its losses and dump files (first step:
# input, target, output, loss, every whole gradient) must be bit-identical to
# tests/golden/runs.txt. And the two targets' runs of each model are bit-identical to each other
# (losses and every dump file): the CUDA program on the fake device computes the CPU program's
# bits, whatever was recorded. tests/cuda/host.sh leaves these models' CPU = fake device
# comparisons to this suite (the very programs and runs it would build and make again).
#
#   tests/golden_runs.sh            compare (one ok/FAIL line per model and target, and one per
#                                   model: its two targets against each other)
#   tests/golden_runs.sh --record   rewrite tests/golden/runs.txt (only when a change is meant
#                                   to change the numbers; say so in the commit)
#
# OpenBLAS runs on one thread with the Haswell kernels (OPENBLAS_CORETYPE), so that the bits do
# not depend on which x86-64 CPU runs the test; without AVX2 the comparisons are skipped.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
GOLDEN=tests/golden/runs.txt
. tests/mpi/common.sh
export OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=Haswell OMP_NUM_THREADS=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-golden-runs.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
record=0; [ "${1:-}" = --record ] && record=1
if ! grep -q '\bavx2\b' /proc/cpuinfo; then echo "skip  golden runs: the CPU has no AVX2 (the goldens use OpenBLAS's Haswell kernels)"; exit 0; fi

targets="cpu"
[ -f "$BUILD/cuda/libfake_cuda.a" ] && targets="cpu cuda"

# one_run NAME MODEL TARGET: prints "NAME TARGET P LOSSES-AND-DUMP-SHA" or fails with why. The
# runs go side by side (spawn, tests/lib.sh), each with files of its own name.
one_run() {
  local name=$1 model=$2 target=$3 bin=$WORK/$1.$3 np=1 out
  if [ "$target" = cuda ]; then
    # NVRTC's PTX alone (a third of its time); tiny carries the CUBIN too and runs it
    local images=ptx
    [ "$name" = lang_models_tiny ] && images=both
    MOEC_CUDA_IMAGES=$images MOEC_CUDA_FAKE=1 "$MOEC" build "$model" --target cuda -o "$bin" 2>"$bin.err" ||
      { echo "build: $(head -c 1000 "$bin.err")"; return 1; }
  else
    "$MOEC" build "$model" -o "$bin" 2>"$bin.err" || { echo "build: $(head -c 1000 "$bin.err")"; return 1; }
  fi
  # One rank first; a layout that needs more says how many, and runs again under mpirun.
  local dir=$WORK/$1.$3.dump at=$WORK/$1.$3.cwd   # a folder of its own to run in (record files)
  mkdir -p "$at"
  if ! (cd "$at" && timeout 120 "$bin" --steps 3 --dump "$dir" >"$bin.out" 2>&1 </dev/null); then
    np=$(grep -o 'needs [0-9]* ranks' "$bin.out" | awk '{print $2}')
    [ -n "$np" ] || { echo "run: $(tail -n 5 "$bin.out")"; return 1; }
    rm -rf "$dir"
    (cd "$at" && timeout 120 $MPIRUN -x OPENBLAS_NUM_THREADS -x OPENBLAS_CORETYPE -np "$np" "$bin" --steps 3 --dump "$dir" >"$bin.out" 2>&1 </dev/null) ||
      { echo "mpirun -np $np: $(tail -n 5 "$bin.out")"; return 1; }
  fi
  out=$(grep '^step' "$bin.out" | sed 's/  time .*//'; (cd "$dir" && find . -type f | LC_ALL=C sort | xargs sha256sum))
  echo "$name $target np=$np $(printf '%s\n' "$out" | sha256sum | cut -c1-16) $(grep '^step' "$bin.out" | awk '{printf "%s%s", (NR > 1 ? "," : ""), $4}')"
}
# golden_job NAME MODEL TARGET: "run LINE" or "fail WHY" (one line).
golden_job() {
  local line
  if line=$(one_run "$@"); then echo "run $line"; else echo "fail $(echo "$line" | tr '\n' ' ')"; fi
}

ids=()
for model in lang/models/*.moe tests/models/*.moe tests/golden/*.moe; do
  name=$(echo "${model%.moe}" | tr / _)
  for target in $targets; do
    spawn "$name.$target" golden_job "$name" "$model" "$target"
    ids+=("$name.$target")
  done
done
wait
: >"$WORK/runs"; : >"$WORK/fails"
for id in "${ids[@]}"; do
  read -r kind line <"$WORK/jobs/$id"
  if [ "$kind" = run ]; then echo "$line" >>"$WORK/runs"
  else echo "FAIL  golden run ${id%.*} ${id##*.}: $line" | tee -a "$WORK/fails"; fi
done
if [ $record = 1 ]; then
  { echo "# model target ranks sha256(losses, dump files) losses -- tests/golden_runs.sh --record"; cat "$WORK/runs"; } >"$GOLDEN"
  echo "ok    golden runs recorded: $(wc -l <"$WORK/runs") runs in $GOLDEN"
  exit 0
fi
while read -r name target np sha losses; do
  want=$(awk -v n="$name" -v t="$target" '$1 == n && $2 == t' "$GOLDEN")
  if [ -z "$want" ]; then echo "FAIL  golden run $name $target: not in $GOLDEN (record it: tests/golden_runs.sh --record)"
  elif [ "$want" = "$name $target $np $sha $losses" ]; then echo "ok    golden run $name $target ($np): losses and dumps bit-identical to the recorded run"
  else echo "FAIL  golden run $name $target: got $np $sha $losses, recorded $(echo "$want" | cut -d' ' -f3-)"; fi
done <"$WORK/runs"
# The fake device against the CPU: each model's CUDA run has the CPU run's ranks, losses and sha
# of the dump files (a model whose CPU run failed has its FAIL line above).
if [ "$targets" = "cpu cuda" ]; then
  while read -r name target np sha losses; do
    [ "$target" = cpu ] || continue
    cuda=$(awk -v n="$name" '$1 == n && $2 == "cuda"' "$WORK/runs")
    if [ -z "$cuda" ]; then continue   # its cuda run failed: a FAIL line above
    elif [ "$cuda" = "$name cuda $np $sha $losses" ]; then echo "ok    golden run $name: the fake device's run ($np) is bit-identical to the CPU program's (losses and dumps)"
    else echo "FAIL  golden run $name: the fake device's run differs from the CPU program's: cuda $(echo "$cuda" | cut -d' ' -f3-), cpu $np $sha $losses"; fi
  done <"$WORK/runs"
fi
# A recorded run this one did not make (a model removed or renamed): the goldens are stale.
while read -r name target _; do
  case "$name" in \#*) continue ;; esac
  case " $targets " in *" $target "*) ;; *) continue ;; esac
  grep -q "^$name $target " "$WORK/runs" || grep -q "^FAIL  golden run $name $target:" "$WORK/fails" ||
    echo "FAIL  golden run $name $target: recorded in $GOLDEN but not run (record again: tests/golden_runs.sh --record)"
done <"$GOLDEN"
# --check-grad of a language model on the fake device: the loss it differences is the CUDA
# program's split reduction's partial sums added in double after the step (rt_loss_exact_parts),
# not the float the device writes, so block0's attention weights come out OK with no more
# unresolved than the CPU program's (in float alone all four were unresolved: FAILED).
lm=tests_models_grad_lm_gpt
unresolved() { awk '/^# [0-9]+ parameters:/ { for (i = 1; i <= NF; i++) if ($i ~ /^unresolved/) print $(i - 1) }' "$1"; }
if [ -x "$WORK/$lm.cuda" ] && [ -x "$WORK/$lm.cpu" ]; then
  for t in cpu cuda; do (cd "$WORK/$lm.$t.cwd" && timeout 300 "$WORK/$lm.$t" --check-grad=block0.attn.w >check.out 2>&1 </dev/null); done
  cpu=$(unresolved "$WORK/$lm.cpu.cwd/check.out") fake=$(unresolved "$WORK/$lm.cuda.cwd/check.out")
  if tail -n 1 "$WORK/$lm.cuda.cwd/check.out" | grep -qx OK && [ -n "$cpu" ] && [ -n "$fake" ] && [ "$fake" -le "$cpu" ]; then
    echo "ok    golden run $lm cuda: --check-grad=block0.attn.w passes on the fake device ($fake unresolved, the CPU program $cpu)"
  else
    echo "FAIL  golden run $lm cuda: --check-grad=block0.attn.w on the fake device ($fake unresolved, the CPU program $cpu)"
    tail -n 14 "$WORK/$lm.cuda.cwd/check.out" | sed 's/^/            /'
  fi
fi
