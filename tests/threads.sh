#!/usr/bin/env bash
# The thread pool (runtime/threads.c) and the vector paths (rt_internal.h, RT_VECTOR_PATHS): the
# results depend neither on the number of threads nor on the vector path. Four models train 3
# steps with --dump: tests/models/threads.moe (a GELU MoE stack), tests/models/threads_swiglu.moe
# (SwiGLU experts, a shared expert, bf16 compression hooks, 4 and 8 experts),
# tests/models/threads_oss.moe (gpt-oss's clamped SwiGLU experts) and lang/models/gpt_moe_bytes.moe
# (the demo's language model: attention, layernorm, cross-entropy).
# Each runs on every vector path this CPU can execute (MOERT_VECTOR: avx512, avx2, baseline; a
# path the program refuses is one skip line), with OpenBLAS's kernels of that level
# (OPENBLAS_CORETYPE SkylakeX, Haswell, Prescott), on OMP_NUM_THREADS 1, 2 and 3 with each GEMM in
# as many pieces, each run saying it had them: the step lines (but their times) and the step-1
# --dump folders must be the same bytes. With SkylakeX's kernels the GEMMs stay whole
# (OPENBLAS_NUM_THREADS=1): they pick small-matrix and direct kernels by the size of the call, so
# a piece need not round as the whole product does (runtime/kernels/ffn.c). Then each narrower path, with the widest path's OpenBLAS
# kernels on one thread, must give the widest path's bytes. The binaries must be linked with
# OpenMP where make configured it (build/config.mk); where make found no OpenMP the thread counts
# are not compared (one skip line) but the paths are.
. "$(dirname "$0")/lib.sh"
work threads

omp=$(sed -n 's/^OMP_CFLAGS := //p' "$BUILD/config.mk" 2>/dev/null)
threads="1 2 3"
if [ -z "$omp" ]; then
  why="make configured no OpenMP ($BUILD/config.mk: OMP_CFLAGS empty; it needs Debian's libopenblas-openmp-dev and a compiler with -fopenmp): the kernels run on one thread"
  [ -f "$BUILD/config.mk" ] || why="no $BUILD/config.mk (run make first)"
  skip "threads: 1, 2 and 3 threads" "$why"
  threads=1
fi

core_of() { case $1 in avx512) echo SkylakeX ;; avx2) echo Haswell ;; *) echo Prescott ;; esac; }
# pieces_of CORE N: how many pieces each GEMM is in on N threads with CORE's kernels.
pieces_of() { [ "$1" = SkylakeX ] && echo 1 || echo "$2"; }

# run BIN OUT PATH CORE N: one 3-step run with its dump in OUT.d, output in OUT.o, steps in OUT.s.
run() {
  MOERT_VECTOR=$3 OPENBLAS_CORETYPE=$4 OMP_NUM_THREADS=$5 OPENBLAS_NUM_THREADS=$(pieces_of "$4" "$5") \
    "$1" --steps 3 --dump "$2.d" >"$2.o" 2>&1 || return 1
  sed -n 's/  time .*//p' "$2.o" | grep '^step' >"$2.s"
}

for model in tests/models/threads.moe tests/models/threads_swiglu.moe tests/models/threads_oss.moe lang/models/gpt_moe_bytes.moe; do
  name=$(basename "$model" .moe)
  if ! "$MOEC" build "$model" -o "$WORK/$name" 2>"$WORK/err"; then bad "threads $name: build" "$(cat "$WORK/err")"; continue; fi
  if [ -n "$omp" ] && ! ldd "$WORK/$name" | grep -q libgomp; then
    bad "threads $name: make configured OpenMP ($omp) but the program does not link libgomp"
  fi
  paths=""
  for path in avx512 avx2 baseline; do
    out=$WORK/$name.$path
    if ! run "$WORK/$name" "$out.1" $path "$(core_of $path)" 1; then
      if grep -q "MOERT_VECTOR=$path: this .* runs the" "$out.1.o"; then skip "threads $name $path" "$(sed 's/^moert: error: //' "$out.1.o")"
      else bad "threads $name $path: the run on 1 thread failed" "$(tail -n 5 "$out.1.o")"; fi
      continue
    fi
    paths="$paths $path"
    same=1 why=""
    for n in $threads; do
      [ "$n" = 1 ] || run "$WORK/$name" "$out.$n" $path "$(core_of $path)" "$n" ||
        { bad "threads $name $path: OMP_NUM_THREADS=$n failed" "$(tail -n 5 "$out.$n.o")"; same=0; break; }
      # The pool really has n threads and n pieces per GEMM (OPENBLAS_NUM_THREADS=1 once shrank it
      # to one: runtime/threads.c), and the kernels took the path asked for.
      p=$(pieces_of "$(core_of $path)" "$n")
      pieces="$p piece"; [ "$p" = 1 ] || pieces="$p pieces"
      grep -q "^# threads: $n per rank, each GEMM in $pieces; vector path $path$" "$out.$n.o" ||
        { same=0; why="$why; with OMP_NUM_THREADS=$n the program says: $(grep '^# threads' "$out.$n.o")"; }
      [ -s "$out.$n.s" ] || { same=0; why="$why; no step lines"; }
      if [ "$n" -gt 1 ]; then
        cmp -s "$out.1.s" "$out.$n.s" || { same=0; why="$why; step lines differ with $n threads"; }
        diff -r -q "$out.1.d" "$out.$n.d" >"$WORK/diff" || { same=0; why="$why; dumps differ with $n threads: $(head -n 3 "$WORK/diff")"; }
      fi
    done
    if [ $same = 1 ]; then
      ok "threads $name $path: $(echo $threads | sed 's/ /, /g') threads give the same step lines and --dump bytes ($(ls "$out.1.d"/grad | wc -l) gradients, OpenBLAS $(core_of $path), each GEMM $([ "$(pieces_of "$(core_of $path)" 2)" = 2 ] && echo "in as many pieces" || echo whole))"
    else
      bad "threads $name $path: results depend on the number of threads$why" "$(diff "$out.1.s" "$out.2.s" 2>/dev/null | head -n 6)"
    fi
  done
  # The narrower paths against the widest, with the widest's OpenBLAS kernels.
  set -- $paths
  [ $# -gt 0 ] || continue
  widest=$1 core=$(core_of $1)
  shift
  for path in "$@"; do
    out=$WORK/$name.$path.as-$widest
    if ! run "$WORK/$name" "$out" $path $core 1; then bad "threads $name $path (OpenBLAS $core): the run failed" "$(tail -n 5 "$out.o")"; continue; fi
    diff -r -q "$WORK/$name.$widest.1.d" "$out.d" >"$WORK/diff"
    if cmp -s "$WORK/$name.$widest.1.s" "$out.s" && [ ! -s "$WORK/diff" ]; then
      ok "threads $name: the $path path gives the $widest path's step lines and --dump bytes (OpenBLAS $core)"
    else
      bad "threads $name: the $path path differs from the $widest path (OpenBLAS $core)" \
        "$(diff "$WORK/$name.$widest.1.s" "$out.s" | head -n 4; head -n 3 "$WORK/diff")"
    fi
  done
done

# GEMM epilogues: the CPU program runs the fused group after a GEMM in the GEMM's pieces, each
# piece's thread over its rows (codegen/emit_c.c, rt_matmul_rows); on 2 threads with Haswell's
# kernels (2 pieces a GEMM) the program must give the bytes of the one built with MOEC_GEMM_ROWS=0
# (every group after its GEMM, on the team).
name=gpt_moe_bytes
if [ -x "$WORK/$name" ] && "$MOEC" build lang/models/$name.moe --emit c -o "$WORK/rows.c" 2>"$WORK/err" &&
   MOEC_GEMM_ROWS=0 "$MOEC" build lang/models/$name.moe -o "$WORK/$name.after" 2>>"$WORK/err"; then
  in_gemm=$(grep -c 'if (!rt_matmul_rows(' "$WORK/rows.c"); in_expert=$(grep -c 'if (!rt_expert_matmul_rows(' "$WORK/rows.c")
  n=2; [ "$threads" = 1 ] && n=1
  if run "$WORK/$name" "$WORK/rows.on" avx2 Haswell $n && run "$WORK/$name.after" "$WORK/rows.off" avx2 Haswell $n &&
     [ "$in_gemm" -gt 0 ] && [ "$in_expert" -gt 0 ] && diff -q "$WORK/rows.on.s" "$WORK/rows.off.s" >/dev/null &&
     diff -r -q "$WORK/rows.on.d" "$WORK/rows.off.d" >/dev/null; then
    ok "threads $name: $in_gemm fused groups run in their GEMM's pieces and $in_expert in the expert GEMMs' (a step's); on $n threads the step lines and --dump bytes of the program that runs them after (MOEC_GEMM_ROWS=0)"
  else
    bad "threads $name: the groups in the GEMMs' pieces ($in_gemm, $in_expert in experts') differ from MOEC_GEMM_ROWS=0" "$(cat "$WORK/err"; diff "$WORK/rows.on.s" "$WORK/rows.off.s" 2>&1 | head -n 6)"
  fi
else
  bad "threads $name: the build with the groups in the GEMMs' pieces and MOEC_GEMM_ROWS=0" "$(cat "$WORK/err")"
fi

# The check can fail: with MOERT_PLANT_ORDER=1 the bias gradients' column sums are taken in one
# float piece of rows per thread (runtime/kernels/ffn.c), an order that depends on the number of
# threads; 1 and 2 threads must then give different --dump bytes, and this suite's comparison must
# say so.
if [ "$threads" = 1 ]; then
  skip "threads: a planted order change is caught" "one thread only (no OpenMP)"
elif [ -x "$WORK/threads" ]; then
  plant=$WORK/planted
  MOERT_PLANT_ORDER=1 run "$WORK/threads" "$plant.1" baseline Prescott 1 &&
    MOERT_PLANT_ORDER=1 run "$WORK/threads" "$plant.2" baseline Prescott 2
  if [ -s "$plant.1.s" ] && [ -s "$plant.2.s" ] && ! diff -r -q "$plant.1.d" "$plant.2.d" >"$WORK/diff"; then
    ok "threads: a planted order change (MOERT_PLANT_ORDER=1: column sums per thread) is caught: $(grep -c . "$WORK/diff") --dump files differ between 1 and 2 threads ($(sed -n 's/^Files .*\/\([^/]*\) and .*/\1/p' "$WORK/diff" | head -n 3 | paste -sd' '))"
  else
    bad "threads: a planted order change (MOERT_PLANT_ORDER=1) went unnoticed: 1 and 2 threads gave the same bytes" "$(tail -n 3 "$plant.2.o" 2>/dev/null)"
  fi
fi
exit $failed
