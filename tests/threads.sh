#!/usr/bin/env bash
# The thread pool (runtime/threads.c): the kernels' results do not depend on the number of
# threads. tests/models/threads.moe (a float MoE stack) and lang/models/gpt_moe_bytes.moe (the
# demo's language model: attention, layernorm, cross-entropy) train 3 steps with OMP_NUM_THREADS
# 1, 2 and 3 and the GEMMs whole on one thread (OPENBLAS_NUM_THREADS=1: a GEMM split over the
# threads can round differently, runtime/threads.c), each run saying it had that many threads: the step lines (but their times) and the step-1
# --dump folders must be the same bytes. The binaries must be linked with OpenMP where make
# configured it (build/config.mk); where make found no OpenMP the suite is one skip line.
. "$(dirname "$0")/lib.sh"
work threads

omp=$(sed -n 's/^OMP_CFLAGS := //p' "$BUILD/config.mk" 2>/dev/null)
# Without OpenMP the kernels run on one thread whatever OMP_NUM_THREADS says: nothing to compare.
if [ -z "$omp" ]; then
  why="make configured no OpenMP ($BUILD/config.mk: OMP_CFLAGS empty; it needs Debian's libopenblas-openmp-dev and a compiler with -fopenmp): the kernels run on one thread"
  [ -f "$BUILD/config.mk" ] || why="no $BUILD/config.mk (run make first)"
  skip "threads" "$why"
  exit 0
fi
for model in tests/models/threads.moe lang/models/gpt_moe_bytes.moe; do
  name=$(basename "$model" .moe)
  if ! "$MOEC" build "$model" -o "$WORK/$name" 2>"$WORK/err"; then bad "threads $name: build" "$(cat "$WORK/err")"; continue; fi
  if ! ldd "$WORK/$name" | grep -q libgomp; then
    bad "threads $name: make configured OpenMP ($omp) but the program does not link libgomp"
  fi
  same=1 why=""
  for n in 1 2 3; do
    if ! OMP_NUM_THREADS=$n OPENBLAS_NUM_THREADS=1 "$WORK/$name" --steps 3 --dump "$WORK/$name.d$n" >"$WORK/$name.o$n" 2>&1; then
      bad "threads $name: OMP_NUM_THREADS=$n failed" "$(tail -n 5 "$WORK/$name.o$n")"; same=0; break
    fi
    # The pool really has n threads (OPENBLAS_NUM_THREADS=1 once shrank it to one: runtime/threads.c).
    grep -q "^# threads: $n per rank, each GEMM in 1 piece$" "$WORK/$name.o$n" ||
      { same=0; why="$why; with OMP_NUM_THREADS=$n the program says: $(grep '^# threads' "$WORK/$name.o$n")"; }
    sed -n 's/  time .*//p' "$WORK/$name.o$n" | grep '^step' >"$WORK/$name.s$n"
    [ -s "$WORK/$name.s$n" ] || { same=0; why="no step lines"; }
    if [ "$n" -gt 1 ]; then
      cmp -s "$WORK/$name.s1" "$WORK/$name.s$n" || { same=0; why="$why; step lines differ with $n threads"; }
      diff -r -q "$WORK/$name.d1" "$WORK/$name.d$n" >"$WORK/diff" || { same=0; why="$why; dumps differ with $n threads: $(head -n 3 "$WORK/diff")"; }
    fi
  done
  if [ $same = 1 ]; then
    ok "threads $name: 1, 2 and 3 threads give the same step lines and --dump bytes ($(ls "$WORK/$name.d1"/grad | wc -l) gradients)"
  else
    bad "threads $name: results depend on the number of threads$why" "$(diff "$WORK/$name.s1" "$WORK/$name.s2" | head -n 6)"
  fi
done
exit $failed
