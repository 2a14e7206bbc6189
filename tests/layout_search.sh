#!/usr/bin/env bash
# The layout search of `parallel auto;` (cli/layout.c, lang/manual.md §6), one ok/FAIL line per check:
#   legality   tests/models/grad_lm_gpt.moe (expert hidden 18) on a 1 x 4 cluster: the layouts
#              with mp 4 (heads 2) and esp 4 (hidden 18) are refused, each with its reason; the
#              other four are priced, fit, and are ranked by their step.
#   json       `moec plan --layouts --json F` has exactly the fields of the spec, chosen is the
#              first and fastest fitting layout. (The search also prices pipeline stages and
#              microbatches, tests/pp_plan.sh; the checks here read its one-stage layouts.)
#   memory     a `memory` one byte below the chosen peak moves the choice to a layout whose peak
#              fits (or refuses with the sentence); a memory nothing fits in refuses the build
#              with the smallest peak found and what would help.
#   training   `parallel auto;` builds for a 2 x 1 and a 2 x 2 cluster, trains one step on 2 and
#              4 ranks, and its loss, logits and every gradient equal the one-rank run of the same
#              global batch to 1e-5 (as tests/lm/layout.sh).
#   repeats    a stack of `x 6` layers is priced from 3 and 4 lowered copies: the search's step and
#              peak of its chosen layout equal what `moec build -v --layout` of that layout plans.
#   --layout   malformed and illegal layouts are refused with a sentence.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
case "$MOEC" in /*) ;; *) MOEC=$(pwd)/$MOEC ;; esac
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-layouts.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
PY=/usr/bin/python3
status=0
ok()  { echo "ok    layouts: $1"; }
bad() { echo "FAIL  layouts: $1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | sed 's/^/      /' | head -n 20; status=1; }

# cluster NODES GPUS [MEMORY]: tests/models/overlap.cluster's fits for another shape.
cluster() {
  sed "s/nodes 2; gpus_per_node 2;/nodes $1; gpus_per_node $2;${3:+ memory $3;}/" tests/models/overlap.cluster
}
# one_stage NODES GPUS: the same with a point-to-point link of 50 ms a message, so that the search
# keeps one stage (its slow AllReduce makes stages the fastest otherwise): the parts that hold the
# chosen layout against one rank and against `moec build --layout` of one stage.
one_stage() {
  cluster "$1" "$2" | sed 's/^}/  p2p { alpha 50; beta 0; }\n}/'
}
M=tests/models/grad_lm_gpt.moe
auto_model() {   # the model with parallel auto and a schedule the planner plans
  sed "s/^layer block x 2/parallel auto;\nlayer block x ${1:-2}/; s/hidden 16;/hidden ${2:-16};/; s/batch 2;/batch 4;/" "$M"
  echo "schedule { policy fsmoe; pipeline auto; }"
}

# ---- legality and the JSON ----
cluster 1 4 >"$WORK/c14.cluster"
auto_model 2 18 >"$WORK/legal.moe"
# (it keeps its own activations: recomputation, which the search prices for a layout that does not
# fit, would otherwise let every layout fit the tight memory below)
sed -i 's/seed \([0-9]*\);/seed \1; recompute layers;/' "$WORK/legal.moe"
if ! "$MOEC" plan "$WORK/legal.moe" --cluster "$WORK/c14.cluster" --layouts --json "$WORK/legal.json" >"$WORK/out" 2>&1; then
  bad "moec plan --layouts on a 1 x 4 cluster" "$(cat "$WORK/out")"
else
  if why=$($PY - "$WORK/legal.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
keys = ["dp", "mp", "ep", "esp", "pp", "microbatches", "algo", "policy", "step_ms", "peak_bytes", "fits", "shard", "recompute", "vocab_parallel", "why"]
bad = []
if sorted(d) != sorted(["layouts", "chosen", "global_batch", "search_seconds"]): bad.append("top-level keys %s" % sorted(d))
if d["global_batch"] != 4: bad.append("global batch %s, want the model's 4" % d["global_batch"])
every = d["layouts"]
for l in every + [d["chosen"]]:
    if list(l) != keys: bad.append("fields %s" % list(l))
    if l["pp"] * l["dp"] * l["mp"] != 4: bad.append("not 4 ranks: %s" % l)
ls = [l for l in every if l["pp"] == 1 and l["microbatches"] == 1]
want = {}   # (mp, esp) -> reason fragment of the refused
for mp in (1, 2, 4):
    for esp in (1, 2, 4):
        if mp == 4: want[(mp, esp)] = "heads 2 cannot be split over mp 4"
        elif esp == 4: want[(mp, esp)] = "expert hidden 18 cannot be split over esp 4"
seen = set()
for l in ls:
    k = (l["mp"], l["esp"]); seen.add(k)
    if l["dp"] * l["mp"] != 4 or l["ep"] * l["esp"] != 4: bad.append("not 4 ranks: %s" % l)
    if k in want:
        if l["fits"] or l["step_ms"] is not None or want[k] not in l["why"]: bad.append("mp %d esp %d: %s" % (k[0], k[1], l))
    elif not l["fits"] or l["why"] or not (l["step_ms"] > 0) or not (l["peak_bytes"] > 0):
        bad.append("mp %d esp %d should fit: %s" % (k[0], k[1], l))
if len(seen) != 9 or len(ls) != 9: bad.append("%d layouts, %d distinct, want 9" % (len(ls), len(seen)))
fit = [l for l in every if l["fits"]]
if [l["step_ms"] for l in fit] != sorted(l["step_ms"] for l in fit): bad.append("fitting layouts not ranked by step")
if every[:len(fit)] != fit: bad.append("the fitting layouts do not come first")
if d["chosen"] != fit[0]: bad.append("chosen is not the first fitting layout")
fit = [l for l in ls if l["fits"]]
if bad: print("; ".join(bad[:6])); sys.exit(1)
print("%d refused with their reasons, %d priced; chosen dp %d mp %d ep %d esp %d at %.3f ms" % (
    len(ls) - len(fit), len(fit), d["chosen"]["dp"], d["chosen"]["mp"], d["chosen"]["ep"], d["chosen"]["esp"], d["chosen"]["step_ms"]))
PY
  ); then ok "legality and JSON on 1 x 4: $why"; else bad "legality and JSON on 1 x 4" "$why"; fi
  grep -q "heads 2 cannot be split over mp 4" "$WORK/out" && grep -q "chosen" "$WORK/out" \
    && ok "the table on stdout names the chosen layout and the refusals" || bad "the table" "$(cat "$WORK/out")"
fi

# ---- memory ----
read -r peak chosen_mp chosen_esp <<<"$($PY -c '
import json, sys; c = json.load(open(sys.argv[1]))["chosen"]; print(c["peak_bytes"], c["mp"], c["esp"])' "$WORK/legal.json" 2>/dev/null)"
if [ -n "${peak:-}" ]; then
  cluster 1 4 $((peak - 1)) >"$WORK/tight.cluster"
  if "$MOEC" plan "$WORK/legal.moe" --cluster "$WORK/tight.cluster" --layouts --json "$WORK/tight.json" >"$WORK/out" 2>&1; then
    if why=$($PY - "$WORK/tight.json" "$peak" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); cap = int(sys.argv[2]) - 1
c = d["chosen"]
if c["peak_bytes"] > cap: print("chosen peak %d over %d" % (c["peak_bytes"], cap)); sys.exit(1)
over = [l for l in d["layouts"] if l["step_ms"] is not None and l["peak_bytes"] > cap]
if not over or any(l["fits"] or "more than the cluster's memory" not in l["why"] for l in over):
    print("layouts over the cap: %s" % over); sys.exit(1)
print("chosen moved to mp %d esp %d (peak %d <= %d); %d over the cap say so" % (c["mp"], c["esp"], c["peak_bytes"], cap, len(over)))
PY
    ); then ok "memory one byte below the chosen peak: $why"; else bad "memory below the chosen peak" "$why"; fi
  elif grep -q "no parallel layout fits in the cluster's memory" "$WORK/out"; then
    ok "memory one byte below the chosen peak: refused with the sentence"
  else
    bad "memory one byte below the chosen peak" "$(cat "$WORK/out")"
  fi
  cluster 1 4 1KiB >"$WORK/none.cluster"
  "$MOEC" build "$WORK/legal.moe" --cluster "$WORK/none.cluster" -o "$WORK/none" >"$WORK/out" 2>&1
  rc=$?
  if [ $rc = 1 ] && grep -q "error: no parallel layout fits in the cluster's memory of 1.00 KiB per rank: the smallest peak is" "$WORK/out" \
     && grep -q "a smaller batch lowers the first, more ranks or a larger esp" "$WORK/out" && grep -q "parallel auto;" "$WORK/out"; then
    ok "nothing fits: moec build refuses at 'parallel auto;' with the smallest peak"
  else
    bad "nothing fits (exit $rc)" "$(cat "$WORK/out")"
  fi
else
  bad "memory" "no chosen layout in the JSON"
fi

# ---- training: parallel auto on 2 and 4 ranks equals one rank ----
for shape in "2 1" "2 2"; do
  read -r nodes gpus <<<"$shape"
  np=$((nodes * gpus))
  one_stage "$nodes" "$gpus" >"$WORK/t.cluster"
  auto_model 2 16 >"$WORK/many.moe"
  if ! "$MOEC" build "$WORK/many.moe" --cluster "$WORK/t.cluster" -o "$WORK/many" >"$WORK/build.out" 2>&1; then
    bad "parallel auto on $nodes x $gpus: moec build" "$(cat "$WORK/build.out")"; continue
  fi
  line=$(grep "^# parallel auto: dp" "$WORK/build.out")
  dp=$(sed -n 's/^# parallel auto: dp \([0-9]*\), mp \([0-9]*\).*/\1/p' <<<"$line")
  mp=$(sed -n 's/^# parallel auto: dp \([0-9]*\), mp \([0-9]*\).*/\2/p' <<<"$line")
  if [ -z "$dp" ] || [ -z "$mp" ]; then bad "parallel auto on $nodes x $gpus: no 'parallel auto:' line" "$(cat "$WORK/build.out")"; continue; fi
  sed "s/batch 2;/batch 4;/; s/capacity 0.5;/capacity 0.5; groups $((dp * mp));/" "$M" >"$WORK/one.moe"
  if ! "$MOEC" build "$WORK/one.moe" -o "$WORK/one" 2>"$WORK/err"; then bad "one-rank build" "$(cat "$WORK/err")"; continue; fi
  rm -rf "$WORK/d1" "$WORK/d2"
  if ! (cd "$WORK" && ./one --steps 1 --dump d1 >one.out 2>&1 && $MPIRUN -np "$np" ./many --steps 1 --dump d2 >many.out 2>&1); then
    bad "parallel auto on $np ranks: a run failed" "$(tail -n 5 "$WORK/one.out" "$WORK/many.out")"; continue
  fi
  if ! grep -q "^# layout: parallel auto: dp $dp, mp $mp" "$WORK/many.out"; then
    bad "the binary does not print its layout at start" "$(head -n 12 "$WORK/many.out")"
  fi
  if why=$($PY - "$WORK/d1" "$WORK/d2" <<'PY'
import glob, os, sys
import numpy as np
a_dir, b_dir = sys.argv[1], sys.argv[2]
worst, n, bad = 0.0, 0, []
for f in sorted(glob.glob(os.path.join(a_dir, "**", "*.npy"), recursive=True)):
    rel = os.path.relpath(f, a_dir)
    a = np.load(f).astype(np.float64); b = np.load(os.path.join(b_dir, rel)).astype(np.float64)
    if a.shape != b.shape: bad.append("%s: shape %s against %s" % (rel, a.shape, b.shape)); continue
    scale = np.abs(a).max()
    if rel.endswith("attn.bk.npy"): scale = np.abs(np.load(f.replace("attn.bk", "attn.wk"))).max()
    e = np.abs(a - b).max() / max(scale, 1e-30)
    worst = max(worst, e); n += 1
    if e > 1e-5: bad.append("%s: %.3e" % (rel, e))
if bad or n == 0: print("; ".join(bad[:8]) or "no tensors"); sys.exit(1)
print("%d tensors, worst %.2e" % (n, worst))
PY
  ); then ok "parallel auto on a $nodes x $gpus cluster chose ${line#\# parallel auto: }"; ok "... and on $np ranks it equals one rank ($why)"
  else bad "parallel auto on $np ranks differs from one rank" "$why"; fi
done

# ---- repeats: the search's numbers are the build's ----
one_stage 2 2 >"$WORK/c22.cluster"
auto_model 6 16 >"$WORK/deep.moe"
if "$MOEC" plan "$WORK/deep.moe" --cluster "$WORK/c22.cluster" --layouts --json "$WORK/deep.json" >"$WORK/out" 2>&1; then
  read -r lay step peak <<<"$($PY -c '
import json, sys; c = json.load(open(sys.argv[1]))["chosen"]
print("%d,%d,%d,%d,%s" % (c["dp"], c["mp"], c["ep"], c["esp"], c["algo"]), repr(c["step_ms"]), c["peak_bytes"])' "$WORK/deep.json")"
  sed 's/^parallel auto;//' "$WORK/deep.moe" >"$WORK/deep_explicit.moe"
  if "$MOEC" build "$WORK/deep_explicit.moe" --cluster "$WORK/c22.cluster" --layout "$lay" -v -o "$WORK/deep" >"$WORK/build.out" 2>&1; then
    bstep=$(sed -n 's/^# pipeline-plan fsmoe step [^ ]* [^ ]* \([^ ]*\) .*/\1/p' "$WORK/build.out")
    bpeak=$(sed -n 's/^# memplan: peak .* per rank (\([0-9]*\) bytes)$/\1/p' "$WORK/build.out")
    if $PY -c 'import sys; a, b, c, d = map(float, sys.argv[1:]); sys.exit(0 if abs(a - b) <= 1e-6 * b and c == d else 1)' \
         "$step" "$bstep" "$peak" "$bpeak" 2>/dev/null; then
      ok "x 6 layers priced from 3 and 4 copies = moec build --layout $lay: step $step ms, peak $peak bytes"
    else
      bad "x 6 layers: the search says step $step ms, peak $peak; the build plans ${bstep:-?} ms, peak ${bpeak:-?}"
    fi
  else
    bad "moec build --layout $lay" "$(cat "$WORK/build.out")"
  fi
else
  bad "moec plan --layouts of x 6 layers" "$(cat "$WORK/out")"
fi

# ---- --layout ----
"$MOEC" build "$WORK/legal.moe" --cluster "$WORK/c14.cluster" --layout 2,2 -o "$WORK/x" >"$WORK/out" 2>&1
grep -q "error: --layout takes DP,MP,EP,ESP or DP,MP,EP,ESP,ALGO" "$WORK/out" && ok "--layout 2,2 is refused with the form" \
  || bad "--layout 2,2" "$(cat "$WORK/out")"
"$MOEC" build "$WORK/legal.moe" --cluster "$WORK/c14.cluster" --layout 1,4,4,1 -o "$WORK/x" >"$WORK/out" 2>&1
grep -q "error: --layout 1,4,4,1: layer block: heads 2 cannot be split over mp 4" "$WORK/out" \
  && ok "--layout 1,4,4,1 is refused with the model's reason" || bad "--layout 1,4,4,1" "$(cat "$WORK/out")"
exit $status
