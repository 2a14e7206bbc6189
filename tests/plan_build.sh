#!/usr/bin/env bash
# One pricing for `moec plan` and `moec build` (issue 12; run by tests/run.sh, one ok/FAIL line
# per model): for every policy P, `moec build -v` of the model with
# `schedule { policy P; pipeline auto; grad_partition auto; }` prints (its "# pipeline-plan"
# lines) the per-layer degrees, model times and gradient slots and the predicted step that
# `moec plan --json` gives for P, to the 9 digits both print. Models: every lang/models/*.moe
# (the language models too: their attention is priced from the IR), the paper's GPT2-XL-MoE on
# testbed-a as a MoE stack and as the language model (25 heads, vocab 50257, dp48·ep6·esp8), and
# the planner goldens on their own profiles.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
PY=${PY:-/usr/bin/python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-plan-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# expect PLAN.json POLICY: the "# pipeline-plan" lines of `moec build -v`, made from the plan.
expect() {
  "$PY" - "$1" "$2" <<'PY'
import json, sys
plan, policy = json.load(open(sys.argv[1])), sys.argv[2]
names = [layer["name"] for layer in plan["layers"]]
p = next(p for p in plan["policies"] if p["name"] == policy)
for i, layer in enumerate(p["layers"]):
    fwd, bwd = layer["forward"], layer["backward"]
    grad = bwd["gradient_elements"]
    print("# pipeline-plan %s layer %s r %d %d t_model %.9g %.9g grad %.0f %.0f" % (
        policy, names[i], fwd["r"], bwd["r"], fwd["model_ms"], bwd["model_ms"], grad["moe_slot"], grad["dense_slot"]))
print("# pipeline-plan %s step %.9g %.9g %.9g tail %.0f partition %s" % (
    policy, p["forward_ms"], p["backward_ms"], p["iteration_ms"], p["tail_gradient_elements"],
    p["gradient_partition"] or "-"))
PY
}

# check MODEL CLUSTER
check() {
  local model=$1 cluster=$2 label why="" nlayers policies
  label="plan = build: $model on $(basename "$cluster" .cluster)"
  if ! "$MOEC" plan "$model" --cluster "$cluster" --json "$WORK/plan.json" >"$WORK/plan.out" 2>&1; then
    echo "FAIL  $label: moec plan failed: $(tail -n 5 "$WORK/plan.out")"
    return
  fi
  read -r nlayers policies < <("$PY" -c 'import json, sys; p = json.load(open(sys.argv[1]))
print(len(p["layers"]), " ".join(q["name"] for q in p["policies"]))' "$WORK/plan.json")
  for policy in $policies; do
    # The model without its schedule block (if any), then the one under test.
    awk '/^schedule[ \t]*\{/ {skip = 1} skip {depth += gsub(/\{/, "{") - gsub(/\}/, "}"); if (depth <= 0) skip = 0; next} {print}' \
      "$model" >"$WORK/m.moe"
    echo "schedule { policy $policy; pipeline auto; grad_partition auto; }" >>"$WORK/m.moe"
    if ! "$MOEC" build "$WORK/m.moe" --cluster "$cluster" --emit c -o /dev/null -v >/dev/null 2>"$WORK/build.err"; then
      why="$why
moec build with policy $policy failed: $(tail -n 3 "$WORK/build.err")"
      continue
    fi
    grep '^# pipeline-plan ' "$WORK/build.err" >"$WORK/build.lines"
    expect "$WORK/plan.json" "$policy" >"$WORK/plan.lines"
    diff "$WORK/plan.lines" "$WORK/build.lines" >"$WORK/diff" ||
      why="$why
policy $policy: < moec plan --json, > moec build -v
$(head -n 10 "$WORK/diff")"
  done
  if [ -z "$why" ]; then
    echo "ok    $label: $nlayers layers x $(echo $policies | wc -w) policies, same degrees, model times, gradient slots and predicted step"
  else
    echo "FAIL  $label:$why"
  fi
}

[ -x "$PY" ] || { echo "FAIL  plan = build: $PY is missing (make deps installs python3)"; exit 1; }
for model in lang/models/*.moe lang/models/paper/gpt2_xl_moe.moe lang/models/paper/gpt2_xl_moe_lm.moe; do
  # A model without MoE layers (the dense GPT) has nothing to plan: moec plan says so.
  if ! grep -q '^[^#]*\bmoe *{' "$model"; then
    if "$MOEC" plan "$model" --cluster lang/clusters/testbed-a.cluster 2>&1 | grep -q 'has no MoE layer'; then
      echo "ok    plan = build: $model: no MoE layer, moec plan says there is nothing to plan"
    else
      echo "FAIL  plan = build: $model: moec plan did not say that a model without MoE layers has nothing to plan"
    fi
    continue
  fi
  check "$model" lang/clusters/testbed-a.cluster
done
check tests/golden/plan.moe tests/models/overlap.cluster
check tests/golden/parallel.moe lang/clusters/testbed-b.cluster

# The paper's GPT2-XL-MoE as a language model (48 layers, 25 heads, M 1600, vocab 50257, 6 experts,
# dp48·ep6·esp8): `moec build` (lowering, autodiff, planning, memory plan, C emission) in under a
# second (the best of three runs: the machine may be busy), and its memory plan printed.
XL=lang/models/paper/gpt2_xl_moe_lm.moe
best=""
for i in 1 2 3; do
  t0=$(date +%s.%N)
  "$MOEC" build "$XL" --emit c -o /dev/null -v >/dev/null 2>"$WORK/xl.err" || { best=fail; break; }
  t=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.3f", b - a}')
  if [ -z "$best" ] || awk -v t="$t" -v b="$best" 'BEGIN {exit !(t < b)}'; then best=$t; fi
done
peak=$(grep -o 'memplan: peak .* per rank ([0-9]* bytes)' "$WORK/xl.err")
if [ "$best" != fail ] && awk -v t="$best" 'BEGIN {exit !(t < 1.0)}' && [ -n "$peak" ]; then
  printf 'ok    moec build %s in %.2f s (under 1 s), %s\n' "$XL" "$best" "$peak"
else
  echo "FAIL  moec build $XL: ${best:-?} s (must be under 1 s), memory plan: ${peak:-not printed}"
  tail -n 3 "$WORK/xl.err"
fi

# The paper's language models against their testbeds' `memory` (the GPU's less 1-2 GiB; manual §12,
# "Memory"): Mixtral-8x7B's widths on Testbed-B fit once moec build shards AdamW's moments (its
# planned step within 15 % of the one without), Mixtral-8x22B's on Testbed-A fit as written, and
# GPT2-XL-MoE on Testbed-B fits with every choice, `recompute layers` the last (within 15 % too).
paper() {   # MODEL EXPECT (fits-as-written | fits-with | refused)
  local model=lang/models/paper/$1.moe out
  if "$MOEC" build "$model" --emit c -o /dev/null -v >/dev/null 2>"$WORK/mem.err"; then out=fits; else out=refused; fi
  local chose step peak
  chose=$(grep -c '^# memory: .* chose ' "$WORK/mem.err")
  # the planned step with every choice against the one without (each line: one round's change)
  step=$(sed -n 's/.*planned step \([0-9.]*\) -> \([0-9.]*\) ms.*/\1 \2/p' "$WORK/mem.err" |
         awk 'NR == 1 {a = $1} {b = $2} END {if (NR) printf "%+.1f", 100 * (b - a) / a}')
  peak=$(grep -o 'memplan: peak [0-9.]* [KMG]iB' "$WORK/mem.err" | tail -n 1)
  case $2 in
    fits-as-written) [ "$out" = fits ] && [ "$chose" = 0 ] ;;
    fits-with) [ "$out" = fits ] && [ "$chose" -gt 0 ] && [ -n "$step" ] && awk -v s="$step" 'BEGIN {exit !(s <= 15)}' ;;
    refused) [ "$out" = refused ] && grep -q 'error: the program does not fit: its smallest peak per rank is' "$WORK/mem.err" ;;
  esac
  if [ $? -eq 0 ]; then
    echo "ok    memory: $1: $2 ($([ "$out" = fits ] && echo "$peak${step:+, planned step $step %}" || grep -o 'smallest peak per rank is [0-9.]* [KMG]iB' "$WORK/mem.err"))"
  else
    echo "FAIL  memory: $1: expected $2, got $out"
    sed 's/^/      /' "$WORK/mem.err" | grep -v '^      #  ' | tail -n 6
  fi
}
paper mixtral_8x7b_lm fits-with
paper mixtral_8x22b_lm fits-as-written
paper gpt2_xl_moe_lm fits-as-written
paper gpt2_xl_moe_lm_b fits-with
