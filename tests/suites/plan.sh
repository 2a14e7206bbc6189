#!/usr/bin/env bash
# The scheduler's commands: `moec plan` (table, SVG timeline, Chrome trace, JSON plan) and
# `moec sweep --quick` on every cluster profile of the paper (fsmoe the fastest on every case).
. "$(dirname "$0")/../lib.sh"
work plan
if "$MOEC" plan tests/golden/parallel.moe --cluster lang/clusters/testbed-b.cluster --policy all \
     --svg "$WORK/plan.svg" --trace "$WORK/plan.json" --json "$WORK/planfull.json" >"$WORK/plan.out" 2>&1 &&
   grep -q '^OK' "$WORK/plan.out" && head -c 4 "$WORK/plan.svg" | grep -q '<svg' &&
   "$PY" -c 'import json,sys; json.load(open(sys.argv[1])); json.load(open(sys.argv[2]))' "$WORK/plan.json" "$WORK/planfull.json"; then
  ok "moec plan: table, SVG timeline, Chrome trace and JSON plan"
else
  bad "moec plan" "$(tail -n 20 "$WORK/plan.out")"
fi
# One figure for the planned step: the SVG's title gives the table's iteration time (the layers'
# timeline plus the time outside the layers) for a language model, where the two differ.
if "$MOEC" plan bench/models/lm_mid.moe --cluster lang/clusters/testbed-a.cluster --svg "$WORK/lm.svg" >"$WORK/lm.out" 2>&1 &&
   table=$(awk '$1 == "fsmoe" {print $4}' "$WORK/lm.out") &&
   grep -q "fsmoe, planned step $table ms = the layers' timeline [0-9.]* ms + [0-9.]* ms outside them" "$WORK/lm.svg"; then
  ok "moec plan --svg: the title's planned step is the table's ($table ms; $(grep -o "the layers' timeline [0-9.]* ms + [0-9.]* ms outside them" "$WORK/lm.svg"))"
else
  bad "moec plan --svg: the title and the table disagree" "$(grep -o '<text x="10" y="20"[^<]*' "$WORK/lm.svg"; grep -A3 '^policy' "$WORK/lm.out")"
fi
# moec plan -v: the sequential step per class of work (what the binaries' --profile measures); on
# the 4-rank parallel model every class a collective of its layout has is priced and the classes
# add up to the sequential step within 10 % (the planner's simulation overlaps the dense
# gradients' AllReduce with the backward; hand-offs and chunk assemblies are its alone); the
# language model has attention.
if "$MOEC" plan tests/golden/parallel.moe --cluster lang/clusters/testbed-b.cluster -v >"$WORK/v.out" 2>&1 &&
   "$MOEC" plan bench/models/lm_mid.moe --cluster lang/clusters/testbed-a.cluster -v >"$WORK/vl.out" 2>&1 &&
   line=$(grep '^# per class' "$WORK/v.out") && lline=$(grep '^# per class' "$WORK/vl.out") &&
   echo "$line" | awk '{ for (i = 1; i < NF; i++) { if ($i == "AlltoAll" || $i == "AllGather" || $i == "ReduceScatter" || $i == "AllReduce") { v = $(i + 1); sub(/,/, "", v); if (v + 0 <= 0) bad = 1 }
                         if ($i == "sum") s = $(i + 1); if ($i == "(sequential") q = $(i + 1) } }
                       END { sub(/\)/, "", q); d = s - q; if (d < 0) d = -d; exit bad || q <= 0 || d > 0.1 * q }' &&
   echo "$lline" | awk '{ for (i = 1; i < NF; i++) if ($i == "attention") { v = $(i + 1); sub(/,/, "", v) } } END { exit !(v > 0) }'; then
  ok "moec plan -v: the step per class ($(echo "$line" | sed 's/.*the same classes): //' | head -c 150))"
else
  bad "moec plan -v: the step per class" "$(grep -h '^# per class\|^sequential' "$WORK/v.out" "$WORK/vl.out")"
fi
# The profile's kernel fits price their ops: with update_adamw at 1 ms a parameter tiny's update is
# its 33792 parameters; with elementwise_math at 1 ms an element its math ops are their elements:
# GELU and its gradient over each layer's [4, 20, 64] slots, the gates' noise and softmax over
# [32, 4] (2 layers: 2 x (2 x 5120 + 2 x 128) = 20992).
cp lang/clusters/testbed-a.cluster "$WORK/kf.cluster"
sed -i 's/^}$/  update_adamw { alpha 0; beta 1; }\n  elementwise_math { alpha 0; beta 1; }\n}/' "$WORK/kf.cluster"
if "$MOEC" plan lang/models/tiny.moe --cluster "$WORK/kf.cluster" -v >"$WORK/kf.out" 2>&1 &&
   grep -q '^# per class.*update 33792\.000,.*the rest 20992\.000;' "$WORK/kf.out"; then
  ok "moec plan -v: update_adamw prices tiny's 33792 parameters, elementwise_math its 20992 GELU, noise and softmax elements"
else
  bad "moec plan -v with update_adamw and elementwise_math" "$(grep '^# per class' "$WORK/kf.out"; tail -n 3 "$WORK/kf.out")"
fi
# attention_grad prices attention's backward apart: with attention at 1 ms and attention_grad at 2 ms
# a multiply-accumulate, the mid LM's attention class is 5/3 of what attention alone gives it (the
# backward counts twice the forward's multiply-accumulates); update_sgd prices an SGD model's update
# (tiny with SGD, 1000 ms a parameter), update_adamw does not.
attn_class() { sed -n 's/^# per class.*: GEMM [0-9.]*, attention \([0-9.]*\),.*/\1/p' "$1"; }
cp lang/clusters/testbed-a.cluster "$WORK/a1.cluster"
sed -i 's/^}$/  attention { alpha 0; beta 1; }\n}/' "$WORK/a1.cluster"
sed 's/^  attention { alpha 0; beta 1; }$/&\n  attention_grad { alpha 0; beta 2; }/' "$WORK/a1.cluster" >"$WORK/a2.cluster"
cp lang/clusters/testbed-a.cluster "$WORK/a3.cluster"
sed -i 's/^}$/  update_adamw { alpha 0; beta 1; }\n  update_sgd { alpha 0; beta 1000; }\n}/' "$WORK/a3.cluster"
sed 's/optimizer adamw { lr 0.003; }/optimizer sgd { lr 0.003; }/' lang/models/tiny.moe >"$WORK/tiny_sgd.moe"
if "$MOEC" plan bench/models/lm_mid.moe --cluster "$WORK/a1.cluster" -v >"$WORK/a1.out" 2>&1 &&
   "$MOEC" plan bench/models/lm_mid.moe --cluster "$WORK/a2.cluster" -v >"$WORK/a2.out" 2>&1 &&
   "$MOEC" plan "$WORK/tiny_sgd.moe" --cluster "$WORK/a3.cluster" -v >"$WORK/a3.out" 2>&1 &&
   a1=$(attn_class "$WORK/a1.out") && a2=$(attn_class "$WORK/a2.out") && [ -n "$a1" ] && [ -n "$a2" ] &&
   awk -v a="$a1" -v b="$a2" 'BEGIN { r = b / a; exit !(a > 0 && r > 5 / 3 - 1e-6 && r < 5 / 3 + 1e-6) }' &&
   grep -q '^# per class.*update 33792000\.000,' "$WORK/a3.out"; then
  ok "moec plan -v: attention_grad prices the backward (the mid LM's attention $a1 -> $a2, 5/3), update_sgd an SGD model's update"
else
  bad "moec plan -v with attention_grad and update_sgd" "$(grep -h '^# per class' "$WORK"/a[123].out; tail -n 2 "$WORK"/a[123].out)"
fi
for c in testbed-a testbed-a-solver testbed-b; do
  if "$MOEC" sweep --cluster lang/clusters/$c.cluster --quick >"$WORK/sweep.out" 2>&1 && grep -q '^OK' "$WORK/sweep.out" &&
     grep -q 'cases where fsmoe is not the fastest policy: 0' "$WORK/sweep.out"; then
    ok "moec sweep $c: fsmoe $(awk '$1 == "fsmoe" {print $2}' "$WORK/sweep.out") over tutel, fastest on every Table 4 case"
  else
    bad "moec sweep $c" "$(tail -n 20 "$WORK/sweep.out")"
  fi
done
exit $failed
