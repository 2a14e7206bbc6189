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
for c in testbed-a testbed-a-solver testbed-b; do
  if "$MOEC" sweep --cluster lang/clusters/$c.cluster --quick >"$WORK/sweep.out" 2>&1 && grep -q '^OK' "$WORK/sweep.out" &&
     grep -q 'cases where fsmoe is not the fastest policy: 0' "$WORK/sweep.out"; then
    ok "moec sweep $c: fsmoe $(awk '$1 == "fsmoe" {print $2}' "$WORK/sweep.out") over tutel, fastest on every Table 4 case"
  else
    bad "moec sweep $c" "$(tail -n 20 "$WORK/sweep.out")"
  fi
done
exit $failed
