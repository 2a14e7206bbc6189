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
for c in testbed-a testbed-a-solver testbed-b; do
  if "$MOEC" sweep --cluster lang/clusters/$c.cluster --quick >"$WORK/sweep.out" 2>&1 && grep -q '^OK' "$WORK/sweep.out" &&
     grep -q 'cases where fsmoe is not the fastest policy: 0' "$WORK/sweep.out"; then
    ok "moec sweep $c: fsmoe $(awk '$1 == "fsmoe" {print $2}' "$WORK/sweep.out") over tutel, fastest on every Table 4 case"
  else
    bad "moec sweep $c" "$(tail -n 20 "$WORK/sweep.out")"
  fi
done
exit $failed
