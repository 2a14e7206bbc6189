#!/usr/bin/env bash
# The vocabulary split over MP (`vocab_parallel true;` in the model block; lang/manual.md §12,
# "Memory"): each MP rank holds the table's rows (the untied head's columns) of vocab/mp tokens,
# computes its columns of the logits and the loss from every rank's row statistics.
#   - equality: gpt (tied) and qwen (untied, rope, rmsnorm) language models with adamw train 8
#     steps on mp2·ep2, mp2·esp2 and dp2·mp2·ep2·esp2 (the fsmoe policy at pipeline degree 2 for
#     one of them) with the split and without: the same losses to 1e-5 and every tensor of --dump,
#     the logits included, within 1e-5 of its largest element: the head's input gradient and the
#     softmax's sums are added in another order, and the split head multiplies vocab/mp columns
#     a call, which OpenBLAS's kernels need not round as they round the whole product's (its
#     Haswell kernels do not: a column's bits depend on the call's shape);
#   - a planted error (one rank's half of the table scaled by 1 + 1e-4, MOERT_TEST_SCALE) fails
#     that comparison;
#   - exact on top: the split with the sharded optimizer and `recompute layers` is the split alone,
#     bit for bit;
#   - --check-grad passes on mp2·ep2 with the split;
#   - checkpoints keep the layout-free format: saved by the split build at step 3, resumed by the
#     split and the plain build, steps 4-8 within 1e-5 of the uninterrupted run;
#   - --sample draws the same tokens as the plain build (the logits gathered over MP);
#   - the memory plan: the table and the logits are split (parameters and activations fall);
#   - the IR: dump-ir shows loss.xent.stats, its AllGather, loss.xent.vp and round-trips;
#   - the CUDA program with the split equals the CPU one on the fake device (2 ranks);
#   - `parallel auto;` with a memory only the split reaches chooses a layout priced with it, and
#     moec build applies it there (its last memory choice);
#   - refusals: without `vocab`, and with an mp that does not divide vocab.
. "$(dirname "$0")/../lib.sh"
work lm-vocab
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
export OMP_NUM_THREADS=1
ADAMW="optimizer adamw { lr 0.01; warmup 2; decay_steps 8; min_lr 0.001; clip 0.5; }"

# variant MODEL LAYOUT EXTRA [SCHEDULE]: adamw, the layout, EXTRA model fields, a schedule statement.
variant() { lm_variant "$1" "$3" "parallel { $2 }" "${4:-}"; }

# close A B: every float tensor of --dump folder B within 1e-5 of A's largest element (plus 1e-9
# for the gradients that are zero but for rounding: a key bias's), integers equal.
close() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import os, sys
import numpy as np
a_dir, b_dir = sys.argv[1], sys.argv[2]
worst, n, bad = 0.0, 0, []
for root, _, files in os.walk(a_dir):
    for f in sorted(files):
        if not f.endswith(".npy"): continue
        a = np.load(os.path.join(root, f)); b = np.load(os.path.join(b_dir, os.path.relpath(root, a_dir), f))
        n += 1
        if a.shape != b.shape: bad.append("%s: shape %s vs %s" % (f, a.shape, b.shape)); continue
        if a.dtype.kind != "f":
            if not np.array_equal(a, b): bad.append("%s differs" % f)
            continue
        d = float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
        m = float(np.max(np.abs(a))) if a.size else 0.0
        if m > 1e-6: worst = max(worst, d / m)   # (not the gradients that are zero but for rounding)
        if d > 1e-5 * m + 1e-9: bad.append("%s: %.3g apart (largest %.3g)" % (f, d, m))
if bad or n < 10: print("; ".join(bad[:5]) or "%d tensors" % n); sys.exit(1)
print("%d tensors, the largest difference %.2g of a tensor's largest element (above 1e-6)" % (n, worst))
PY
}

# losses_close A.out B.out: the same number of step lines, each loss within 1e-5 relative.
losses_close() {
  paste <(step_lines "$1" | awk '{print $4}') <(step_lines "$2" | awk '{print $4}') |
    awk 'NF == 2 {n++; d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * ($1 < 0 ? -$1 : $1)) bad = 1} END {exit !(n == 8 && !bad)}'
}

# same_as_plain DIR: the split run of DIR (vp.out, dv) against the plain one (plain.out, dp): ok, or
# false with why on stdout.
same_as_plain() {
  local why
  if losses_close "$1/plain.out" "$1/vp.out" && why=$(close "$1/dp" "$1/dv"); then
    echo "8 losses and every --dump tensor within 1e-5: $why"
  else
    paste <(step_lines "$1/plain.out") <(step_lines "$1/vp.out") | head -n 8; echo "$why"
    return 1
  fi
}

# equal NAME MODEL LAYOUT RANKS [SCHEDULE]
equal() {
  local d="$WORK/$1" label="vocab_parallel $1: $3${5:+ $5}" why
  mkdir -p "$d"
  variant "$2" "$3" "" "${5:-}" >"$d/plain.moe"
  variant "$2" "$3" "vocab_parallel true;" "${5:-}" >"$d/vp.moe"
  if ! "$MOEC" build "$d/plain.moe" -o "$d/plain" 2>"$d/err" || ! "$MOEC" build "$d/vp.moe" -o "$d/vp" 2>>"$d/err"; then
    bad "$label: moec build" "$(cat "$d/err")"; return
  fi
  if ! (cd "$d" && $MPIRUN -np "$4" ./plain --steps 8 --dump dp >plain.out 2>&1 &&
        $MPIRUN -np "$4" ./vp --steps 8 --dump dv >vp.out 2>&1); then
    bad "$label: a run failed" "$(tail -n 5 "$d/plain.out" "$d/vp.out")"; return
  fi
  if why=$(same_as_plain "$d"); then
    ok "$label: $why"
  else
    bad "$label: differs from the plain build" "$why"
  fi
}

spawn gpt2 equal gpt2 gpt "mp 2; ep 2;" 2
spawn qwen2 equal qwen2 qwen "mp 2; ep 2;" 2
spawn gpt4 equal gpt4 gpt "dp 2; mp 2; ep 2; esp 2;" 4
spawn qwen4 equal qwen4 qwen "dp 2; mp 2; ep 2; esp 2;" 4 "schedule { policy fsmoe; pipeline { forward 2; backward 2; } }"
spawn gpt_esp equal gpt_esp gpt "mp 2; esp 2;" 2
collect gpt2 qwen2 gpt4 qwen4 gpt_esp

# ---- a planted error: rank 1's half of the (tied) table scaled by 1 + 1e-4 ----
d="$WORK/gpt2" p="$WORK/planted"
mkdir -p "$p"
cp "$d/plain.out" "$p/" && cp -r "$d/dp" "$p/" 2>/dev/null
if [ -x "$d/vp" ] && (cd "$p" && MOERT_TEST_SCALE=1:embed.wte:1.0001 $MPIRUN -np 2 "$d/vp" --steps 8 --dump dv >vp.out 2>&1) &&
   grep -q 'MOERT_TEST_SCALE: rank 1' "$p/vp.out"; then
  if why=$(same_as_plain "$p"); then
    bad "vocab_parallel planted error: rank 1's rows of embed.wte times 1 + 1e-4 pass the comparison" "$why"
  else
    ok "vocab_parallel planted error: rank 1's rows of embed.wte times 1 + 1e-4 fail the comparison ($(echo "$why" | tail -n 1 | cut -c1-120))"
  fi
else
  bad "vocab_parallel planted error: the run failed" "$(tail -n 5 "$p/vp.out" 2>/dev/null)"
fi

# ---- exact on top: the sharded optimizer and recompute layers ----
d="$WORK/gpt4"
sed 's/vocab_parallel true;/vocab_parallel true; recompute layers;/; s/optimizer adamw {/optimizer adamw { shard true;/' "$d/vp.moe" >"$d/all.moe"
if "$MOEC" build "$d/all.moe" -o "$d/all" 2>"$WORK/err" && (cd "$d" && $MPIRUN -np 4 ./all --steps 8 --dump da >all.out 2>&1) &&
   [ "$(step_lines "$d/vp.out" | wc -l)" -eq 8 ] && cmp -s <(step_lines "$d/vp.out") <(step_lines "$d/all.out") && diff -r "$d/dv" "$d/da" >/dev/null; then
  ok "vocab_parallel with the sharded optimizer and recompute layers on dp2·mp2·ep2·esp2: the split alone's bits (8 steps, every --dump tensor)"
else
  bad "vocab_parallel with shard and recompute layers" "$(cat "$WORK/err"; diff <(step_lines "$d/vp.out") <(step_lines "$d/all.out") | head; diff -rq "$d/dv" "$d/da" | head -n 5)"
fi

# make test's second pass (tests/run.sh: other OpenBLAS kernels, TESTS_SECOND_PASS=1) runs the
# claims of equal bits only: --check-grad, the memory plan, the IR, parallel auto and the refusals
# do not depend on the kernels, and are left to the first pass.
first_pass() { [ "${TESTS_SECOND_PASS:-0}" != 1 ]; }
first_pass || echo "# second pass: --check-grad, the memory plan, the IR, parallel auto and the refusals left to the first"

# ---- --check-grad ----
variant gpt "mp 2; ep 2;" "vocab_parallel true;" >"$WORK/cg.moe"
if ! first_pass; then :
elif "$MOEC" build "$WORK/cg.moe" -o "$WORK/cg" 2>"$WORK/err" && (cd "$WORK" && $MPIRUN -np 2 ./cg --check-grad >cg.out 2>&1) &&
   [ "$(tail -n 1 "$WORK/cg.out")" = OK ]; then
  ok "vocab_parallel --check-grad on mp2·ep2: $(grep -m1 'parameters:' "$WORK/cg.out" | cut -c3-100)"
else
  bad "vocab_parallel --check-grad on mp2·ep2" "$(cat "$WORK/err"; tail -n 8 "$WORK/cg.out")"
fi

# ---- checkpoints ----
if [ -x "$d/vp" ] && [ -x "$d/plain" ]; then
  (cd "$d" && rm -rf ck* && $MPIRUN -np 4 ./vp --steps 3 --save ckv >v3.out 2>&1 &&
     $MPIRUN -np 4 ./vp --steps 8 --resume ckv >v8.out 2>&1 &&
     $MPIRUN -np 4 ./plain --steps 8 --resume ckv >p8.out 2>&1) 2>"$WORK/err"
  want=$(step_lines "$d/vp.out" | tail -n 5)
  if [ -n "$want" ] && [ "$(step_lines "$d/v8.out")" = "$want" ]; then
    ok "vocab_parallel checkpoint: the split build resumes its own checkpoint: steps 4-8 as the uninterrupted run"
  else
    bad "vocab_parallel checkpoint: resumed by the split build" "$(diff <(echo "$want") <(step_lines "$d/v8.out") | head; tail -n 3 "$d/v8.out")"
  fi
  if [ -n "$want" ] && [ "$(step_lines "$d/p8.out" | wc -l)" -eq 5 ] &&
     paste <(echo "$want" | awk '{print $4}') <(step_lines "$d/p8.out" | awk '{print $4}') |
       awk '{d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * $1) bad = 1} END {exit bad}'; then
    ok "vocab_parallel checkpoint: the plain build resumes the split one: steps 4-8 within 1e-5 of the uninterrupted run"
  else
    bad "vocab_parallel checkpoint: resumed by the plain build" "$(paste <(echo "$want") <(step_lines "$d/p8.out") | head; tail -n 3 "$d/p8.out")"
  fi
fi

# ---- --sample: the logits gathered over MP ----
d="$WORK/gpt2"
if (cd "$d" && $MPIRUN -np 2 ./plain --steps 0 --sample 6 >sp.out 2>&1 &&
    $MPIRUN -np 2 ./vp --steps 0 --sample 6 >sv.out 2>&1) &&
   grep -q '^# sample' "$d/sv.out" && cmp -s <(grep -A1 '^# sample' "$d/sp.out") <(grep -A1 '^# sample' "$d/sv.out"); then
  ok "vocab_parallel --sample: the plain build's 6 tokens after the default prompt"
else
  bad "vocab_parallel --sample" "$(tail -n 3 "$d/sp.out" "$d/sv.out")"
fi

# ---- the memory plan, the IR ----
if first_pass; then
for f in plain vp; do
  "$MOEC" build -v "$WORK/gpt4/$f.moe" -o /dev/null --emit c 2>"$WORK/$f.err" >/dev/null
done
pp=$(sed -n 's/.*memplan: parameters \([0-9.]* [KMG]*i*B\) .*/\1/p' "$WORK/plain.err")
pv=$(sed -n 's/.*memplan: parameters \([0-9.]* [KMG]*i*B\) .*/\1/p' "$WORK/vp.err")
ap=$(sed -n 's/.*memplan: activations \([0-9.]* [KMG]*i*B\) .*/\1/p' "$WORK/plain.err")
av=$(sed -n 's/.*memplan: activations \([0-9.]* [KMG]*i*B\) .*/\1/p' "$WORK/vp.err")
want=$($PY - tests/models/grad_lm_gpt.moe <<'PY'
import re, sys
t = open(sys.argv[1]).read()
V, M = int(re.search(r'vocab (\d+)', t).group(1)), int(re.search(r'embed (\d+)', t).group(1))
print(V * M * 4 // 2)   # the table's bytes that a rank of mp 2 no longer holds
PY
)
tob() { awk -v v="${1% *}" -v u="${1#* }" 'BEGIN {printf "%d", v * (u == "KiB" ? 1024 : u == "MiB" ? 1048576 : u == "GiB" ? 1073741824 : 1)}'; }
if [ -n "$pp" ] && [ -n "$pv" ] && [ $(($(tob "$pp") - $(tob "$pv"))) -eq "$want" ] && [ "$(tob "$av")" -le "$(tob "$ap")" ]; then
  ok "vocab_parallel memory plan on dp2·mp2·ep2·esp2: parameters $pp -> $pv per rank (the table's half: $want bytes), activations $ap -> $av"
else
  bad "vocab_parallel memory plan" "parameters '$pp' -> '$pv' (want $want bytes less), activations '$ap' -> '$av'"
fi
if ir_roundtrip "$WORK/gpt4/vp.moe" memplan '= loss.xent.stats ' '= comm.allgather %xent.stats' '= loss.xent.vp .*parts=2' \
     '= loss.xent.vp.grad ' '= comm.allreduce %h '; then
  ok "vocab_parallel IR: dump-ir shows the split embedding's AllReduce, the loss's statistics and their AllGather, and round-trips"
else
  bad "vocab_parallel IR" "$(cat "$WORK/err"; diff "$WORK/a.ir" "$WORK/b.ir" | head)"
fi
fi

# ---- the CUDA target on the fake device ----
if [ -f "$BUILD/cuda/libfake_cuda.a" ]; then
  if MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/gpt2/vp.moe" --target cuda -o "$WORK/vp.cuda" 2>"$WORK/err" &&
     (cd "$WORK" && $MPIRUN -np 2 ./vp.cuda --steps 8 --dump dc >vp.cuda.out 2>&1) &&
     cmp -s <(step_lines "$WORK/vp.cuda.out") <(step_lines "$WORK/gpt2/vp.out") && diff -r "$WORK/dc" "$WORK/gpt2/dv" >/dev/null; then
    ok "vocab_parallel on the CUDA target (fake device, mp2·ep2): the CPU program's 8 steps and --dump bytes (the logits gathered from the device)"
  else
    bad "vocab_parallel on the CUDA target (fake device)" "$(cat "$WORK/err"; tail -n 3 "$WORK/vp.cuda.out" 2>/dev/null)"
  fi
else
  skip "vocab_parallel on the CUDA target (fake device)" "no CUDA toolkit here ($BUILD/cuda/libfake_cuda.a not built)"
fi

first_pass || exit $failed

# ---- parallel auto: a memory only the split reaches ----
# make bench's mid-size model with `parallel auto;` on cpu-2core (2 nodes x 2) with 330 MB a rank:
# the search prices every legal layout with the memory choices, the vocabulary split last; the
# chosen layout fits only with it, and moec build applies it to that layout.
sed 's/^layer block x 6/parallel auto;\nlayer block x 6/' bench/models/lm_mid.moe >"$WORK/auto.moe"
sed 's/^  memory [0-9]*;.*/  memory 330000000;/' lang/clusters/cpu-2core.cluster >"$WORK/auto.cluster"
if "$MOEC" plan "$WORK/auto.moe" --cluster "$WORK/auto.cluster" --layouts --json "$WORK/auto.json" >"$WORK/auto.out" 2>&1 &&
   $PY -c 'import json, sys; c = json.load(open(sys.argv[1]))["chosen"]; sys.exit(not (c["vocab_parallel"] and c["mp"] > 1 and c["fits"]))' "$WORK/auto.json" &&
   "$MOEC" build "$WORK/auto.moe" --cluster "$WORK/auto.cluster" --emit c -o /dev/null 2>"$WORK/err" >/dev/null &&
   grep -q "chose 'vocab_parallel true;'" "$WORK/err"; then
  ok "parallel auto with 330 MB a rank: $(grep -m1 chosen "$WORK/auto.out" | sed 's/  */ /g' | cut -c1-150); moec build splits the vocabulary last"
else
  bad "parallel auto with the vocabulary split" "$(cat "$WORK/auto.out" "$WORK/err" | cut -c1-200 | tail -n 12)"
fi

# ---- refusals ----
printf 'model m { batch 2; seqlen 4; embed 8; vocab_parallel true; optimizer sgd { lr 0.1; } }\nlayer l { moe { experts 2 { ffn gpt { hidden 8; } } gate gshard { k 1; } } }\n' >"$WORK/novocab.moe"
if ! "$MOEC" build "$WORK/novocab.moe" -o "$WORK/x" 2>"$WORK/err" && grep -q "novocab.moe:1:.*'vocab_parallel' belongs to a language model" "$WORK/err"; then
  ok "vocab_parallel without vocab refused: $(grep -m1 error "$WORK/err" | cut -c1-100)"
else
  bad "vocab_parallel without vocab" "$(cat "$WORK/err")"
fi
variant gpt "mp 2; ep 2;" "vocab_parallel true;" | sed 's/vocab 32;/vocab 33;/' >"$WORK/odd.moe"
if ! "$MOEC" build "$WORK/odd.moe" -o "$WORK/x" 2>"$WORK/err" && grep -q "mp does not divide vocab 33" "$WORK/err" && grep -q '\^' "$WORK/err"; then
  ok "vocab_parallel with mp 2 and vocab 33 refused at the field: $(grep -m1 error "$WORK/err" | cut -c1-110)"
else
  bad "vocab_parallel with vocab 33" "$(cat "$WORK/err")"
fi
exit $failed
