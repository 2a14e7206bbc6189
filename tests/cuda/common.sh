# shellcheck shell=bash
# Helpers of the CUDA suites that compare a CUDA program with the CPU program of the same model
# (sourced by tests/cuda/host.sh and tests/cuda/gpu.sh from the repository root, not run): those
# of tests/mpi/common.sh (ok/FAIL/skip, mpirun flags, compare_dumps, same_losses) and the bf16
# checks.
. tests/mpi/common.sh

# bf16_losses LABEL FP32-OUT BF16-OUT [STEPS]: the report of a bf16 run of STEPS (20) steps against
# the fp32 program's: the loss falls (the last below 0.9 x the first) and the first step's loss is within
# 1e-2 relative of the fp32 one (a bf16 GEMM operand is rounded by up to 2^-9 relative, and the
# loss passes through a few of them). One ok / FAIL line each.
bf16_losses() {
  local label=$1 steps=${4:-20} first last ref ref_last
  first=$(awk '$1 == "step" && $2 == 1 {print $4}' "$3")
  last=$(awk -v n="$steps" '$1 == "step" && $2 == n {print $4}' "$3")
  ref=$(awk '$1 == "step" && $2 == 1 {print $4}' "$2")
  ref_last=$(awk -v n="$steps" '$1 == "step" && $2 == n {print $4}' "$2")
  if [ -n "$first" ] && [ -n "$last" ] && awk -v f="$first" -v l="$last" 'BEGIN { exit !(f > 0 && l < 0.9 * f) }'; then
    ok "$label: $steps steps lower the loss ($first -> $last; fp32: $ref -> $ref_last)"
  else
    bad "$label: the loss of $steps steps did not fall below 0.9 x the first step's" "$(grep -h '^step' "$3" | tail -n 20)"
  fi
  if [ -n "$first" ] && [ -n "$ref" ] &&
     awk -v a="$first" -v b="$ref" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(b > 0 && d <= 1e-2 * b) }'; then
    ok "$label: the first step's loss $first is within 1e-2 of the fp32 program's $ref"
  else
    bad "$label: the first step's loss ${first:-?} is not within 1e-2 of the fp32 program's ${ref:-?}"
  fi
}

# lm_dumps A B: a language model's step 1 --dump of the bf16 program (B) against the fp32 CPU
# program's (A): the logits and loss within 3e-2, every gradient within 5e-2 of its largest element
# (attn.bk's, zero in theory, of its layer's attn.wk's); prints the worst or what failed.
lm_dumps() {
  "$PY" - "$1" "$2" <<'PY'
import glob, os, sys
import numpy as np
a_dir, b_dir = sys.argv[1], sys.argv[2]
worst, bad = (0.0, ""), []
for f in sorted(glob.glob(os.path.join(a_dir, "**", "*.npy"), recursive=True)):
    rel = os.path.relpath(f, a_dir)
    a = np.load(f).astype(np.float64); b = np.load(os.path.join(b_dir, rel)).astype(np.float64)
    if rel == "tokens.npy":
        if not np.array_equal(a, b): bad.append("tokens differ")
        continue
    scale = np.abs(a).max()
    if rel.endswith("attn.bk.npy"): scale = np.abs(np.load(f.replace("attn.bk", "attn.wk"))).max()
    e = np.abs(a - b).max() / max(scale, 1e-30)
    worst = max(worst, (e, rel))
    if e > (5e-2 if rel.startswith("grad") else 3e-2): bad.append("%s: %.2e" % (rel, e))
print("; ".join(bad) if bad else "worst %.1e (%s)" % worst)
sys.exit(1 if bad else 0)
PY
}
