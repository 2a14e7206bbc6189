# Helpers shared by the multi-rank and CUDA suites (sourced, not run): the preamble of every
# suite (tests/lib.sh: ok/FAIL/skip lines, BUILD, MOEC, work), mpirun flags, the multi-rank C test
# programs, and the comparisons of two runs — whole --dump folders and per-step losses — to a
# relative tolerance (1e-5 unless given).
. "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN="mpirun --oversubscribe --allow-run-as-root --mca btl self,vader --bind-to none"
# The C test programs' mpirun (an array): only the flags every run needs.
MPIRUN_PLAIN=(mpirun --oversubscribe)
[ "$(id -u)" = 0 ] && MPIRUN_PLAIN+=(--allow-run-as-root)

# mpi_program NAME: BIN=$BUILD/mpi/NAME, the multi-rank test program tests/mpi/NAME.c. `make test`
# builds it; standalone it is built here with mpicc when missing or older than its source or
# libmoert. A failed build is a FAIL line and exit 1. Needs WORK.
mpi_program() {
  BIN=$BUILD/mpi/$1
  if [ ! -x "$BIN" ] || [ "tests/mpi/$1.c" -nt "$BIN" ] || [ "$BUILD/libmoert.a" -nt "$BIN" ]; then
    mkdir -p "$(dirname "$BIN")"
    # shellcheck disable=SC2046
    if ! mpicc -O2 -g -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Iruntime \
         "tests/mpi/$1.c" "$BUILD/libmoert.a" $(blas_libs) -lcjson -lm -o "$BIN" 2>"$WORK/cc"; then
      bad "build $1" "$(cat "$WORK/cc")"
      exit 1
    fi
  fi
}
# numpy's Python: Debian's (python3-numpy) here; on a GPU machine without it, the venv's.
PY=/usr/bin/python3
if ! "$PY" -c 'import numpy' 2>/dev/null; then
  for py in python3 python; do command -v "$py" >/dev/null && "$py" -c 'import numpy' 2>/dev/null && { PY=$py; break; }; done
fi

# compare_dumps REF-DIR DIR [TOL]: every .npy of REF-DIR (input, target, output, loss, every
# parameter's whole gradient) against DIR, max|a-b| / max|a| <= TOL (default 1e-5) each. A
# gradient that is zero in exact arithmetic holds only rounding noise, which no relative test
# can compare (attention's key bias: softmax ignores a shift of a query's scores; its gradient is
# ~1e-12 where the others are 1e-5 and up): a tensor of REF-DIR whose largest magnitude is below
# 1e-6 of the largest gradient's is compared absolutely, max|a-b| <= 1e-6 of that largest. Prints
# the number of tensors, how many were such zeros, and the worst relative error; exit 1 on a
# difference or a missing file.
compare_dumps() {
  "$PY" - "$1" "$2" "${3:-1e-5}" <<'PYEOF'
import glob, os, sys
import numpy as np
a, b, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
worst, name_worst, bad = 0.0, "", []
names = sorted(os.path.relpath(p, a) for p in glob.glob(os.path.join(a, "**", "*.npy"), recursive=True))
if not names:
    print("no dump files"); sys.exit(1)
grads = [np.load(os.path.join(a, n)) for n in names if n.startswith("grad" + os.sep)]
largest = max((float(np.max(np.abs(g))) for g in grads if g.size), default=0.0)
zeros = 0
for n in names:
    x = np.load(os.path.join(a, n)).astype(np.float64)
    pb = os.path.join(b, n)
    if not os.path.exists(pb):
        bad.append(f"{n}: missing in {b}"); continue
    y = np.load(pb).astype(np.float64)
    if x.shape != y.shape:
        bad.append(f"{n}: shape {y.shape} != {x.shape}"); continue
    if not x.size: continue
    diff, top = float(np.max(np.abs(x - y))), float(np.max(np.abs(x)))
    if n.startswith("grad" + os.sep) and top < 1e-6 * largest:
        zeros += 1
        if not diff <= 1e-6 * largest: bad.append(f"{n}: a zero gradient (max {top:.1e}) differs by {diff:.1e}")
        continue
    err = diff / max(top, 1e-30)
    if not err <= tol: bad.append(f"{n}: relative error {err:.3e}")
    if err > worst: worst, name_worst = err, n
print(f"{len(names)} tensors{f' ({zeros} zero in exact arithmetic, compared absolutely)' if zeros else ''}, "
      f"worst {worst:.1e}{' (' + name_worst + ')' if name_worst else ''}")
for line in bad: print(line)
sys.exit(1 if bad else 0)
PYEOF
}

losses() { grep '^step' "$1" | awk '{print $4}'; }

# same_losses FILE FILE [TOL]: the same number of step lines, every loss within TOL (default
# 1e-5) relative (+ 2e-6 absolute: the report prints 6 decimals).
same_losses() {
  paste <(losses "$1") <(losses "$2") |
    awk -v tol="${3:-1e-5}" 'NF != 2 {bad = 1} { d = $1 - $2; if (d < 0) d = -d; s = $1 < 0 ? -$1 : $1; if (d > tol * s + 2e-6) bad = 1; n++ } END { exit bad || n == 0 }'
}

# run_model NAME [BUILD-ARGS...]: builds WORK/NAME.moe (moec build ARGS; its stderr in WORK/err)
# into WORK/NAME and runs it on P ranks for 3 steps with --dump: WORK/NAME.out, WORK/NAME.dump.
# Needs MOEC, WORK, P and TIMEOUT; on failure prints why and returns 1. run_built NAME: the run
# alone, of the WORK/NAME built before.
run_model() {
  local name=$1
  shift
  "$MOEC" build "$WORK/$name.moe" "$@" -o "$WORK/$name" 2>"$WORK/err" || { echo "build: $(cat "$WORK/err")"; return 1; }
  run_built "$name"
}
run_built() {
  local name=$1
  rm -rf "$WORK/$name.dump"
  (cd "$WORK" && timeout "$TIMEOUT" $MPIRUN -np "$P" "./$name" --steps 3 --dump "$name.dump" >"$name.out" 2>&1 </dev/null) ||
    { echo "mpirun -np $P: $(tail -n 20 "$WORK/$name.out")"; return 1; }
}

# Checkpoints across layouts (tests/mpi/reshard.sh, tests/lm/checkpoint.sh): WORK/pN.moe is the
# model for N ranks, WORK/pN its binary.
# late_losses FILE: "step loss" of the steps after 3 (the ones a checkpoint of step 3 resumes).
late_losses() { grep '^step' "$1" | awk '$2 > 3 {print $2, $4}'; }
# close_after_3 FILE FILE: the same steps 4-6, losses within 1e-5 relative (+ 2e-6 absolute).
close_after_3() {
  paste <(late_losses "$1") <(late_losses "$2") | awk 'NF != 4 || $1 != $3 {bad = 1} { d = $2 - $4; if (d < 0) d = -d; s = $2 < 0 ? -$2 : $2; if (d > 1e-5 * s + 2e-6) bad = 1; n++ } END { exit bad || n != 3 }'
}
# build_layouts PREFIX N...: moec build WORK/pN.moe -o WORK/pN for every N; a failure is a FAIL
# line (PREFIX: the label's start) and exit 1.
build_layouts() {
  local prefix=$1 n; shift
  for n in "$@"; do
    if ! "$MOEC" build "$WORK/p$n.moe" -o "$WORK/p$n" 2>"$WORK/err"; then bad "${prefix}build the $n-rank layout" "$(cat "$WORK/err")"; exit 1; fi
  done
}
# run_layout N ARGS...: WORK/pN on N ranks (one: without mpirun) in WORK, under timeout 90.
run_layout() {
  local n=$1; shift
  if [ "$n" = 1 ]; then (cd "$WORK" && timeout 90 ./p1 "$@" </dev/null)
  else (cd "$WORK" && timeout 90 $MPIRUN -np "$n" ./p"$n" "$@" </dev/null); fi
}

# blocks_4ranks NAME: the model tests/mpi/chunks.sh and gradpart.sh start from, on 4 ranks (dp 2,
# mp 2, ep 2, esp 2): 48 tokens per DP rank, 24 per MP rank (one routing group), two blocks of 4
# experts, k 2, capacity 1.0: C = ceil(2 * 1.0 * 24 / 4) = 12 slots per expert.
blocks_4ranks() {
  cat <<EOF2
model $1 { batch 4; seqlen 12; embed 16; seed 9; optimizer adamw { lr 0.01; } }
parallel { dp 2; mp 2; ep 2; esp 2; }
layer blk x 2 {
  moe {
    experts 4 { ffn gpt { hidden 32; act gelu; bias true; } }
    gate gshard { k 2; capacity 1.0; noise 0.5; aux_loss 0.1; z_loss 0.01; }
    order tutel;
  }
}
EOF2
}
