#!/usr/bin/env bash
# The planning of pipeline stages (issue 62; lang/manual.md §6 and §10), one ok/FAIL line per check:
#   report     `moec build -v` of a pp 2 language model prints each stage (its layers, planned time
#              per microbatch, its forward, peak), the bubble (the stages' simulated waits beside
#              (P - 1) / (M + P - 1)) and the planned step, which is the 1F1B order of the two
#              microbatches worked by hand from the printed times (messages, the last backward's
#              reductions, the updates).
#   1f1b       at M = 8 the planned peak of 1F1B (at most P - s microbatches in flight on stage s)
#              is below GPipe's (all 8), and its planned step is at most GPipe's.
#   split      a model of three small dense layers and one large MoE layer: the cost model's split
#              (3 1) differs from the equal one (2 2), and the stages' part of the step it printed
#              is the built stages' (their planned microbatches); `pp_layers 2 2;` overrides it.
#   p2p        a profile without p2p lines gets them derived from its alltoall fit, and -v says
#              so; with them they are used; bad p2p fields are errors at file:line:col.
#   layouts    `moec plan --layouts --json` has "pp" and "microbatches" for every layout; on a
#              cluster whose AllReduce is slow, `parallel auto;` chooses stages, and `moec build`
#              builds them.
#   fig8       the FSMoE paper's Fig. 8 setting (lang/models/paper/mixtral_8x22b_lm_pp2.moe: the
#              Mixtral-8x22B widths on Testbed-A, pp 2 x dp 3 x mp 8, ep 3 x esp 8, GPipe) builds
#              and every stage fits the profile's memory with its microbatches in flight.
source "$(dirname "$0")/lib.sh"
work pp-plan
C=tests/models/overlap.cluster

# lm PARALLEL [BATCH]: tests/models/grad_lm_gpt.moe (two MoE blocks and a dense layer) with a
# parallel block and a schedule the planner plans.
lm() {
  sed "s/^layer block x 2/parallel { $1 }\nlayer block x 2/; s/batch 2;/batch ${2:-2};/" tests/models/grad_lm_gpt.moe
  echo "schedule { policy fsmoe; pipeline auto; }"
}
# num LINE-PATTERN SED-EXPR FILE: the number sed extracts from the first matching line.
num() { grep -m1 "$1" "$3" | sed -n "$2"; }

# ---- report ----
lm "pp 2; microbatches 2;" >"$WORK/lm.moe"
if "$MOEC" build "$WORK/lm.moe" --cluster "$C" -v -o "$WORK/lm" >"$WORK/lm.out" 2>&1; then
  s0=$(grep -c '^# stage 0: layers 0-1 (block0 \.\. block1) + the embedding: planned [0-9.]* ms a microbatch ([0-9.]* ms the last' "$WORK/lm.out")
  s1=$(grep -c '^# stage 1: layer 2 (dense0) + the head and loss: planned [0-9.]* ms a microbatch ([0-9.]* ms the last' "$WORK/lm.out")
  bubble=$(grep -c '^# pipeline: 2 stages, 2 microbatches, 1f1b: bubble [0-9.]* % of the step (the stages. mean wait for the others, simulated: stage 0 [0-9.]* % 1 [0-9.]* %; (P - 1) / (M + P - 1) = 33.3 % for equal stages)' "$WORK/lm.out")
  step=$(num '^# pipeline-step' 's/^# pipeline-step \([0-9.e+-]*\) .*/\1/p' "$WORK/lm.out")
  # the 1F1B order of 2 microbatches on 2 stages by hand, from the stages' printed times: stage 0
  # F0 F1 B0 B1, stage 1 F0 B0 F1 B1, a message m between them, the last backward's reductions x
  times=$(sed -n 's/^# stage [01]: .*planned \([0-9.]*\) ms a microbatch (\([0-9.]*\) ms the last.*the forward \([0-9.]*\) ms[^;]*; the update \([0-9.]*\) ms.*/\1 \2 \3 \4/p' "$WORK/lm.out" | paste -sd' ')
  msg=$(num '^# pipeline: a message between stages 0 and 1' 's/.*: \([0-9.]*\) ms (p2p alpha.*/\1/p' "$WORK/lm.out")
  hand=$(echo "$times $msg" | awk '{ t0 = $1; x0 = $2 - $1; f0 = $3; u0 = $4; t1 = $5; x1 = $6 - $5; f1 = $7; u1 = $8; m = $9
    b0 = t0 - f0; b1 = t1 - f1; max = "max"
    a = f0 + m + f1; c = a + b1; s = c > 2 * f0 + m ? c : 2 * f0 + m; d = s + f1; e = d + b1 + x1
    s = 2 * f0 > c + m ? 2 * f0 : c + m; g = s + b0; s = g > e + m ? g : e + m; h = s + b0 + x0
    printf "%.3f", (h + u0 > e + u1 ? h + u0 : e + u1) }')
  slowest=$(grep '^# stage [01]: ' "$WORK/lm.out" | sed -n 's/.*planned \([0-9.]*\) ms a microbatch.*/\1/p' | sort -g | tail -n 1)
  if [ "$s0$s1$bubble" = 111 ] && [ -n "$step" ] && [ -n "$hand" ] && awk -v s="$step" -v h="$hand" 'BEGIN {
       d = s - h; if (d < 0) d = -d; exit !(d < 0.005 + 1e-3 * s) }'; then
    ok "report: pp 2 of a language model: the stages' layers, times and peaks, the bubble, planned step $step ms = 1F1B's order of 2 microbatches by hand from the stages' printed times ($hand ms; the slowest microbatch $slowest ms)"
  else
    bad "report: the stages, bubble and planned step of pp 2" "$(grep -E '^# (stage|pipeline|stages)' "$WORK/lm.out")"
  fi
else
  bad "report: moec build of a pp 2 language model" "$(tail -n 8 "$WORK/lm.out")"
fi

# ---- 1f1b against gpipe at M = 8 ----
for sched in gpipe 1f1b; do
  lm "pp 2; microbatches 8; pp_schedule $sched;" 8 >"$WORK/$sched.moe"
  "$MOEC" build "$WORK/$sched.moe" --cluster "$C" -v -o "$WORK/$sched" >"$WORK/$sched.out" 2>&1 || bad "1f1b: moec build ($sched)" "$(tail -n 5 "$WORK/$sched.out")"
done
pg=$(num '^# pipeline: 2 stages' 's/.*per rank (\([0-9]*\) bytes.*/\1/p' "$WORK/gpipe.out")
p1=$(num '^# pipeline: 2 stages' 's/.*per rank (\([0-9]*\) bytes.*/\1/p' "$WORK/1f1b.out")
tg=$(num '^# pipeline-step' 's/^# pipeline-step \([0-9.e+-]*\) .*/\1/p' "$WORK/gpipe.out")
t1=$(num '^# pipeline-step' 's/^# pipeline-step \([0-9.e+-]*\) .*/\1/p' "$WORK/1f1b.out")
if [ -n "$pg" ] && [ -n "$p1" ] && [ "$p1" -lt "$pg" ] && [ -n "$t1" ] && awk -v g="$tg" -v o="$t1" 'BEGIN { exit !(o <= g * (1 + 1e-9)) }' &&
   grep -q '^# stage 0: .* 8 microbatches in flight' "$WORK/gpipe.out" && grep -q '^# stage 0: .* 2 microbatches in flight' "$WORK/1f1b.out" &&
   grep -q '^# stage 1: .* 1 microbatch in flight' "$WORK/1f1b.out"; then
  ok "1f1b: at M = 8 the planned peak of 1F1B, $p1 bytes (2 and 1 microbatches in flight), is below GPipe's, $pg (8); planned steps 1F1B $t1 ms, GPipe $tg ms (1F1B's backwards start before the last forward)"
else
  bad "1f1b: planned peaks at M = 8 (gpipe ${pg:-?}, 1f1b ${p1:-?}), steps ${tg:-?} / ${t1:-?}" "$(grep -E '^# (stage|pipeline)' "$WORK/gpipe.out" "$WORK/1f1b.out")"
fi

# ---- split: dense layers and a large MoE layer ----
mix() {
  cat <<EOF
model mix { batch 4; seqlen 16; embed 32; vocab 64; seed 3; optimizer sgd { lr 0.01; } }
parallel { pp 2; microbatches 2; $1 }
layer dense x 3 { attention { heads 2; } mlp { ffn gpt { hidden 32; } } }
layer big { attention { heads 2; } moe { experts 8 { ffn gpt { hidden 512; } } gate gshard { k 2; capacity 2.0; } } }
schedule { policy fsmoe; pipeline auto; }
EOF
}
mix "" >"$WORK/mix.moe"
mix "pp_layers 2 2;" >"$WORK/mix22.moe"
if "$MOEC" build "$WORK/mix.moe" --cluster "$C" -v -o "$WORK/mix" >"$WORK/mix.out" 2>&1 &&
   "$MOEC" build "$WORK/mix22.moe" --cluster "$C" -v -o "$WORK/mix22" >"$WORK/mix22.out" 2>&1; then
  note=$(grep '^# stages: ' "$WORK/mix.out")
  split_t=$(echo "$note" | sed -n 's/.* = \([0-9.]*\) ms, each stage planned alone (the equal split 2 2: \([0-9.]*\) ms.*/\1 \2/p')
  built=$(num '^# pipeline-step' 's/.* fill \([0-9.e+-]*\) reduce .*/\1/p' "$WORK/mix.out" | awk '{printf "%.3f", $1}')
  if echo "$note" | grep -q 'the cost model splits the 4 layers 3 1 over the stages' &&
     grep -q '^# stage 0: layers 0-2 (dense0 \.\. dense2) + the embedding' "$WORK/mix.out" &&
     grep -q '^# stage 1: layer 3 (big0) + the head and loss' "$WORK/mix.out" && [ -n "$split_t" ] &&
     [ "$(echo "$split_t" | cut -d' ' -f1)" = "$built" ] &&
     awk -v s="$split_t" 'BEGIN {split(s, x, " "); exit !(x[1] < x[2])}'; then
    ok "split: three dense layers and a large MoE layer split 3 1 by the cost model (the stages' part of the step ${built} ms, as built; the equal split 2 2: $(echo "$split_t" | cut -d' ' -f2) ms)"
  else
    bad "split: the cost model's split of dense and MoE layers" "$(grep -E '^# (stage|stages)' "$WORK/mix.out")"
  fi
  if ! grep -q '^# stages: ' "$WORK/mix22.out" && grep -q '^# stage 0: layers 0-1 (dense0 \.\. dense1) + the embedding' "$WORK/mix22.out" &&
     grep -q '^# stage 1: layers 2-3 (dense2 \.\. big0) + the head and loss' "$WORK/mix22.out"; then
    ok "split: pp_layers 2 2 overrides the cost model's split"
  else
    bad "split: pp_layers 2 2 overrides it" "$(grep -E '^# (stage|stages)' "$WORK/mix22.out")"
  fi
else
  bad "split: moec build of the mixed model" "$(tail -n 6 "$WORK/mix.out" "$WORK/mix22.out")"
fi

# ---- p2p: derived, given, refused ----
# The stages of the 2 x 2 profile share a node (2 ranks); on 2 x 1 they are on two nodes.
sed 's/nodes 2; gpus_per_node 2;/nodes 2; gpus_per_node 1;/' "$C" >"$WORK/c21.cluster"
"$MOEC" build "$WORK/lm.moe" --cluster "$WORK/c21.cluster" -v -o "$WORK/lm21" >"$WORK/lm21.out" 2>&1
if grep -q '^# pipeline: a message between stages 0 and 1 is 128 floats .*inside a node: .*derived from the allgather fit (inside a node): the profile has no such line' "$WORK/lm.out" &&
   grep -q '^# pipeline: a message between stages 0 and 1 is 128 floats .*across nodes: .*derived from the alltoall fit (across nodes): the profile has no such line' "$WORK/lm21.out"; then
  ok "p2p: without p2p lines a message is priced from the allgather fit inside a node and the alltoall fit across nodes, and -v says so"
else
  bad "p2p: the derived p2p fits are said" "$(grep -h '^# pipeline: a message' "$WORK/lm.out" "$WORK/lm21.out")"
fi
sed 's/^}/  p2p_intra { alpha 0.5; beta 1e-3; }\n}/' "$C" >"$WORK/p2p.cluster"
"$MOEC" build "$WORK/lm.moe" --cluster "$WORK/p2p.cluster" -v -o "$WORK/lm2" >"$WORK/lm2.out" 2>&1
if grep -q '^# pipeline: a message between stages 0 and 1 is 128 floats .*: 0.6280 ms (p2p alpha 0.5 ms, beta 0.001 ms per float, p2p_intra)$' "$WORK/lm2.out"; then
  ok "p2p: a profile's p2p_intra line prices the message inside a node (0.5 + 1e-3 x 128 = 0.628 ms)"
else
  bad "p2p: the profile's p2p_intra line" "$(grep '^# pipeline: a message' "$WORK/lm2.out"; tail -n 3 "$WORK/lm2.out")"
fi
bad_p2p() {   # NAME LINE WANT: a profile with LINE in it refused with WANT at its line and column
  sed "s/^}/  $2\n}/" "$C" >"$WORK/$1.cluster"
  local line col
  line=$(grep -n "^  ${2%% *}" "$WORK/$1.cluster" | head -n 1 | cut -d: -f1)
  "$MOEC" build "$WORK/lm.moe" --cluster "$WORK/$1.cluster" -o "$WORK/x" >"$WORK/$1.out" 2>&1
  if [ $? = 1 ] && grep -q "^$WORK/$1.cluster:$line:[0-9]*: error: $3" "$WORK/$1.out" && grep -q '\^' "$WORK/$1.out"; then
    ok "p2p: '$2' is refused at $1.cluster:$line with '$3'"
  else
    bad "p2p: '$2' is refused with '$3'" "$(cat "$WORK/$1.out")"
  fi
}
bad_p2p negative "p2p { alpha -1; beta 1e-6; }" "'alpha' must not be negative, got -1"
bad_p2p missing "p2p_intra { alpha 1; }" "missing 'beta' in 'p2p_intra'"
bad_p2p unknown "p2p { alpha 1; beta 2; gamma 3; }" "unknown field 'gamma' in 'p2p'"

# ---- layouts: pp and microbatches in the search ----
lm "" 4 | sed 's/^parallel { *}/parallel auto;/' >"$WORK/auto.moe"
if "$MOEC" plan "$WORK/auto.moe" --cluster "$WORK/c21.cluster" --layouts --json "$WORK/auto.json" >"$WORK/auto.out" 2>&1 &&
   why=$("$PY" - "$WORK/auto.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
bad = []
for l in d["layouts"] + [d["chosen"]]:
    if "pp" not in l or "microbatches" not in l: bad.append("no pp/microbatches: %s" % l)
    elif l["pp"] * l["dp"] * l["mp"] != 2: bad.append("not 2 ranks: %s" % l)
staged = [l for l in d["layouts"] if l["pp"] == 2 and l["step_ms"] is not None]
if not staged: bad.append("no priced layout of 2 stages")
if not any(l["microbatches"] > 1 for l in staged): bad.append("no layout of several microbatches")
c = d["chosen"]
if c["pp"] != 2: bad.append("chosen %s, want 2 stages (the AllReduce of this profile is slow)" % c)
if bad: print("; ".join(bad[:4])); sys.exit(1)
print("%d layouts, %d of 2 stages; chosen pp %d x dp %d, microbatches %d at %.3f ms" % (
    len(d["layouts"]), len(staged), c["pp"], c["dp"], c["microbatches"], c["step_ms"]))
PY
   ); then
  ok "layouts: the JSON of moec plan --layouts has pp and microbatches: $why"
else
  bad "layouts: pp and microbatches in the search" "${why:-$(tail -n 5 "$WORK/auto.out")}"
fi
if "$MOEC" build "$WORK/auto.moe" --cluster "$WORK/c21.cluster" -v -o "$WORK/auto" >"$WORK/autob.out" 2>&1 &&
   grep -q '^# parallel auto: dp 1, mp 1, ep 1, esp 1, alltoall nccl, pp 2, microbatches [0-9]* for cluster' "$WORK/autob.out" &&
   grep -q '^# pipeline: planned step' "$WORK/autob.out" && [ -x "$WORK/auto" ]; then
  ok "layouts: parallel auto builds the stages it chose ($(grep -o 'pp 2, microbatches [0-9]*' "$WORK/autob.out" | head -n 1))"
else
  bad "layouts: parallel auto builds the stages it chose" "$(grep -E '^# (parallel auto|pipeline)|error' "$WORK/autob.out" | head)"
fi

# ---- fig8: the paper's setting with stages ----
F8=lang/models/paper/mixtral_8x22b_lm_pp2.moe
if "$MOEC" build "$F8" -v --cluster lang/clusters/testbed-a.cluster -o "$WORK/f8" >"$WORK/f8.out" 2>&1; then
  peak=$(num '^# pipeline: 2 stages' 's/.*per rank (\([0-9]*\) bytes.*/\1/p' "$WORK/f8.out")
  step=$(num '^# pipeline: planned step' 's/.*planned step \([0-9.]*\) ms.*/\1/p' "$WORK/f8.out")
  within=$(grep -c "^# memory: peak .* within the memory of cluster 'testbed_a' (46.00 GiB)" "$WORK/f8.out")
  if [ "$within" = 2 ] && [ -n "$peak" ] && [ "$peak" -le $((46 * 1024 * 1024 * 1024)) ] && [ -n "$step" ] &&
     grep -q '^# pipeline: 2 stages, 2 microbatches, gpipe: bubble [0-9.]* % .*(P - 1) / (M + P - 1) = 33.3 % for equal stages' "$WORK/f8.out"; then
    ok "fig8: Mixtral-8x22B on Testbed-A at pp 2 x dp 3 x mp 8 builds and fits: $(grep '^# stages: ' "$WORK/f8.out" | sed 's/^# stages: the cost model splits the 33 layers \([0-9 ]*\) over.*/split \1/'), largest stage's peak $peak bytes of 46 GiB with 2 microbatches in flight, planned step $step ms (fsmoe)"
  else
    bad "fig8: the stages fit and are planned" "$(grep -E '^# (stage|stages|pipeline|memory)' "$WORK/f8.out" | grep -v 'pipeline-plan\|policy')"
  fi
else
  bad "fig8: moec build $F8" "$(tail -n 6 "$WORK/f8.out")"
fi
exit $failed
