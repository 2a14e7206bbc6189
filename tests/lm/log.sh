#!/usr/bin/env bash
# Watching and reusing a run: --log F.jsonl, the terminal's progress line, --resume C --sample N.
#   - --log writes one JSON line per step (the printed loss, lr, grad norm; one entry per routed
#     layer with loads and drops) and per evaluation; on dp2·ep2 (2 ranks) the per-layer
#     statistics equal the single-rank twin's (same global batch, same routing groups);
#   - on a terminal (script(1)) one progress line rewrites itself instead of the step lines;
#   - --resume C --sample N samples from C without training (no --steps needed);
#   - an unwritable --log is refused before training; --resume appends to its --log (a header
#     line per run).
# Prints ok/FAIL lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
case "$MOEC" in /*) ;; *) MOEC=$(pwd)/$MOEC ;; esac
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-log.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
. tests/mpi/common.sh
export OMP_NUM_THREADS=1
M=tests/models/grad_lm_gpt.moe
sed 's/batch 2;/batch 4;/; s/capacity 0.5;/capacity 0.5; groups 2;/' "$M" >"$WORK/one.moe"
sed 's/capacity 0.5;/capacity 0.5; groups 1;/; s/^layer block x 2/parallel { dp 2; mp 1; ep 2; esp 1; }\nlayer block x 2/' "$M" >"$WORK/two.moe"
for m in one two; do
  "$MOEC" build "$WORK/$m.moe" -o "$WORK/$m" 2>"$WORK/err" || { bad "build $m" "$(cat "$WORK/err")"; exit 1; }
done
# u16 tokens below vocab 32
$PY -c "
import numpy as np, sys
b = (np.arange(4000) * 7 % 29).astype(np.uint16)
b.tofile('$WORK/train.u16')"
(cd "$WORK" && ./one --steps 4 --data train.u16 --val train.u16 --eval-every 2 --val-windows 4 --log one.jsonl >one.out 2>&1)
(cd "$WORK" && timeout 120 $MPIRUN -np 2 ./two --steps 4 --data train.u16 --val train.u16 --eval-every 2 --val-windows 4 --log two.jsonl >two.out 2>&1 </dev/null)
if out=$($PY - "$WORK/one.jsonl" "$WORK/one.out" "$WORK/two.jsonl" <<'EOF'
import json, sys
one = [json.loads(l) for l in open(sys.argv[1])]
two = [json.loads(l) for l in open(sys.argv[3])]
steps = [r for r in one if "step" in r]
evals = [r for r in one if "eval" in r]
printed = [l.split() for l in open(sys.argv[2]) if l.startswith("step ")]
assert [r["step"] for r in steps] == [1, 2, 3, 4], "one line per step"
assert [r["eval"] for r in evals] == [2, 4], "one line per evaluation"
for r, p in zip(steps, printed):
    assert abs(r["loss"] - float(p[3])) < 1e-6 and abs(r["grad_norm"] - float(p[13])) < 1e-4, "the printed loss and grad norm"
    assert len(r["layers"]) == 2 and all(set(l) == {"load_min", "load_mean", "load_max", "dropped"} for l in r["layers"]), "two routed layers"
    assert any(l["dropped"] > 0 for l in r["layers"]) or r["dropped"] == 0
for a, b in zip([r for r in one if "step" in r], [r for r in two if "step" in r]):
    for la, lb in zip(a["layers"], b["layers"]):
        for k in la:
            assert abs(la[k] - lb[k]) < 1e-9, f"step {a['step']}: layer {k} {la[k]} on one rank, {lb[k]} on two"
print(f"{len(steps)} steps, {len(evals)} evaluations; step 1 layers {steps[0]['layers']}")
EOF
); then
  ok "--log: a JSON line per step and evaluation, the printed values, per-layer loads equal on 1 and 2 ranks: $out"
else
  bad "--log" "$out $(tail -n 5 "$WORK/one.out" "$WORK/two.out")"
fi

if command -v script >/dev/null; then
  (cd "$WORK" && script -qec "./one --steps 3" /dev/null >tty.out 2>&1 </dev/null)
  if grep -q $'\rstep 3/3  loss' "$WORK/tty.out" && ! grep -q '^step 1  loss' "$WORK/tty.out"; then
    ok "on a terminal one progress line rewrites itself: $(tr '\r' '\n' <"$WORK/tty.out" | grep '^step 3/3')"
  else
    bad "progress line on a terminal" "$(cat -A "$WORK/tty.out" | head -n 5)"
  fi
else
  skip "progress line" "script(1) is not installed"
fi

(cd "$WORK" && ./one --steps 2 --save c.json --log r.jsonl >save.out 2>&1)
# --resume appends to its --log: a header line per run, the steps before the checkpoint kept.
(cd "$WORK" && ./one --resume c.json --steps 4 --log r.jsonl >resume.out 2>&1)
if out=$($PY - "$WORK/r.jsonl" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
runs = [r["run"] for r in lines if "run" in r]
assert [r["resumed_from"] for r in runs] == [None, "c.json"], "a header per run: %r" % runs
assert [r.get("step") or "run" for r in lines] == ["run", 1, 2, "run", 3, 4], "lines %r" % [list(r) for r in lines]
print("%d lines: the first run's steps 1-2, the resumed run's 3-4" % len(lines))
EOF
); then
  ok "--log on --resume appends, one header line per run: $out"
else
  bad "--log on --resume" "$out $(tail -n 3 "$WORK/resume.out")"
fi
if (cd "$WORK" && ./one --resume c.json --sample 5 >sample.out 2>&1) && grep -q '^# sample: 5 tokens' "$WORK/sample.out" &&
   ! grep -q '^step ' "$WORK/sample.out"; then
  ok "--resume C --sample N samples from C without training: $(grep -c '' "$WORK/sample.out") lines, no step"
else
  bad "--resume C --sample N" "$(cat "$WORK/sample.out")"
fi

if (cd "$WORK" && ./one --steps 2 --log /nonexistent/dir/x.jsonl >bad.out 2>&1); then
  bad "an unwritable --log was accepted"
elif grep -q "^moert: error: --log '/nonexistent/dir/x.jsonl': the folder '/nonexistent/dir' does not exist" "$WORK/bad.out" && ! grep -q '^step' "$WORK/bad.out"; then
  ok "an unwritable --log is refused before training: $(cat "$WORK/bad.out")"
else
  bad "unwritable --log" "$(cat "$WORK/bad.out")"
fi
exit $failed
