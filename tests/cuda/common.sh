# shellcheck shell=bash
# Helpers of the CUDA suites that compare a CUDA program with the CPU program of the same model
# (sourced by tests/cuda/host.sh and tests/cuda/gpu.sh, not run): ok/FAIL/skip lines, mpirun
# flags, and the comparisons of two runs — per-step losses and whole --dump folders — to a
# relative tolerance.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN="mpirun --oversubscribe --allow-run-as-root --mca btl self,vader --bind-to none"
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
failed=0

ok() { printf 'ok    %s\n' "$1"; }
bad() { failed=1; printf 'FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -n 30 | sed 's/^/      /'; }
skip() { printf 'skip  %s: %s\n' "$1" "$2"; }

# compare_dumps REF-DIR DIR TOL: every .npy of REF-DIR (input, target, output, loss, every
# parameter's whole gradient) against DIR, max|a-b| / max|a| <= TOL each. Prints the number of
# tensors and the worst relative error; exit status 1 on a difference or a missing file.
compare_dumps() {
  "$PY" - "$1" "$2" "$3" <<'PYEOF'
import glob, os, sys
import numpy as np
a, b, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
worst, name_worst, bad = 0.0, "", []
names = sorted(os.path.relpath(p, a) for p in glob.glob(os.path.join(a, "**", "*.npy"), recursive=True))
if not names:
    print("no dump files"); sys.exit(1)
for n in names:
    x = np.load(os.path.join(a, n)).astype(np.float64)
    pb = os.path.join(b, n)
    if not os.path.exists(pb):
        bad.append(f"{n}: missing in {b}"); continue
    y = np.load(pb).astype(np.float64)
    if x.shape != y.shape:
        bad.append(f"{n}: shape {y.shape} != {x.shape}"); continue
    err = float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-30)) if x.size else 0.0
    if not err <= tol: bad.append(f"{n}: relative error {err:.3e}")
    if err > worst: worst, name_worst = err, n
print(f"{len(names)} tensors, worst {worst:.1e}{' (' + name_worst + ')' if name_worst else ''}")
for line in bad: print(line)
sys.exit(1 if bad else 0)
PYEOF
}

# same_losses FILE FILE TOL: the same number of step lines, every loss within TOL relative
# (+ 2e-6 absolute: the report prints 6 decimals).
same_losses() {
  paste <(grep '^step' "$1" | awk '{print $4}') <(grep '^step' "$2" | awk '{print $4}') |
    awk -v tol="$3" 'NF != 2 {bad = 1} { d = $1 - $2; if (d < 0) d = -d; s = $1 < 0 ? -$1 : $1; if (d > tol * s + 2e-6) bad = 1; n++ } END { exit bad || n == 0 }'
}

# bf16_losses LABEL FP32-OUT BF16-OUT: the report of a bf16 run of 20 steps against the fp32
# program's: the loss falls (the last below 0.9 x the first) and the first step's loss is within
# 1e-2 relative of the fp32 one (a bf16 GEMM operand is rounded by up to 2^-9 relative, and the
# loss passes through a few of them). One ok / FAIL line each.
bf16_losses() {
  local label=$1 first last ref ref_last
  first=$(awk '$1 == "step" && $2 == 1 {print $4}' "$3")
  last=$(awk '$1 == "step" && $2 == 20 {print $4}' "$3")
  ref=$(awk '$1 == "step" && $2 == 1 {print $4}' "$2")
  ref_last=$(awk '$1 == "step" && $2 == 20 {print $4}' "$2")
  if [ -n "$first" ] && [ -n "$last" ] && awk -v f="$first" -v l="$last" 'BEGIN { exit !(f > 0 && l < 0.9 * f) }'; then
    ok "$label: 20 steps lower the loss ($first -> $last; fp32: $ref -> $ref_last)"
  else
    bad "$label: the loss of 20 steps did not fall below 0.9 x the first step's" "$(grep -h '^step' "$3" | tail -n 20)"
  fi
  if [ -n "$first" ] && [ -n "$ref" ] &&
     awk -v a="$first" -v b="$ref" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(b > 0 && d <= 1e-2 * b) }'; then
    ok "$label: the first step's loss $first is within 1e-2 of the fp32 program's $ref"
  else
    bad "$label: the first step's loss ${first:-?} is not within 1e-2 of the fp32 program's ${ref:-?}"
  fi
}
