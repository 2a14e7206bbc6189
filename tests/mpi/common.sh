# Helpers shared by the multi-rank and CUDA suites (sourced, not run): mpirun flags, ok/FAIL/skip
# lines, and the comparisons of two runs — whole --dump folders and per-step losses — to a
# relative tolerance (1e-5 unless given).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN="mpirun --oversubscribe --allow-run-as-root --mca btl self,vader --bind-to none"
# numpy's Python: Debian's (python3-numpy) here; on a GPU machine without it, the venv's.
PY=/usr/bin/python3
if ! "$PY" -c 'import numpy' 2>/dev/null; then
  for py in python3 python; do command -v "$py" >/dev/null && "$py" -c 'import numpy' 2>/dev/null && { PY=$py; break; }; done
fi
failed=0

ok() { printf 'ok    %s\n' "$1"; }
bad() { failed=1; printf 'FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -n 30 | sed 's/^/      /'; }
skip() { printf 'skip  %s: %s\n' "$1" "$2"; }

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

# run_model NAME [BUILD-ARGS...]: builds WORK/NAME.moe (moec build ARGS) into WORK/NAME and runs
# it on P ranks for 3 steps with --dump: WORK/NAME.out, WORK/NAME.dump. Needs MOEC, WORK, P and
# TIMEOUT; on failure prints why and returns 1.
run_model() {
  local name=$1
  shift
  "$MOEC" build "$WORK/$name.moe" "$@" -o "$WORK/$name" 2>"$WORK/err" || { echo "build: $(cat "$WORK/err")"; return 1; }
  rm -rf "$WORK/$name.dump"
  (cd "$WORK" && timeout "$TIMEOUT" $MPIRUN -np "$P" "./$name" --steps 3 --dump "$name.dump" >"$name.out" 2>&1 </dev/null) ||
    { echo "mpirun -np $P: $(tail -n 20 "$WORK/$name.out")"; return 1; }
}
