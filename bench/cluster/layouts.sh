#!/usr/bin/env bash
# make cluster-layouts (and the end of make cluster-bench): the layout search of `parallel auto;`
# judged on the emulated cluster (docs/cluster.md, "Layouts on the emulated cluster").
#
#   1. the emulated cluster of 2 nodes x 2 ranks at one link rate (--rate, default 300mbit, the
#      communication-heavy starting rate bench.sh uses on 2 x 2);
#   2. `moec tune --quick` there writes its profile (of the cluster alone; --tune-with-model:
#      with `--model M` as well);
#   3. M is bench/cluster/stack.moe with `parallel auto;` and `schedule { policy fsmoe; pipeline
#      auto; }`; under `parallel auto` its batch 4 is the global batch of every layout (dp 4: one
#      sample per rank, as bench.sh's 2 x 2; dp 2 x mp 2: two per DP rank, split over MP), so
#      every layout trains the same samples a step: `moec plan --layouts` on that profile ranks
#      every layout of the 4 ranks (dp, mp, ep, esp, AlltoAll algorithm);
#   4. every layout that fits is built explicitly (`moec build --layout D,M,E,S,ALGO`) and run on
#      the 4 ranks, `--steps STEPS --profile`, all of them in turn for ROUNDS rounds (each round
#      starts one layout later; the machine is shared: alternation, medians); a layout's measured
#      step is the median over its rounds of each run's median whole step;
#   5. the report: per layout the predicted step (the search's), the measured median, the error
#      and both ranks; Spearman's rank correlation of predicted against measured; the chosen
#      layout against the fastest measured one; the search time.
# Then (and alone with --search-only, which needs no namespaces; `make bench` runs that) the search
# at scale: `moec plan --layouts` of bench/cluster/deep64.moe (64 layers, 256 experts, M 7168) on
# lang/clusters/testbed-a.cluster grown to 256 nodes x 8 GPUs (2048 ranks): its search_seconds
# and the wall time of the whole command.
#
# The acceptance (issue 25): at least 4 fitting layouts, the chosen one measured within 10 % of
# the fastest measured one, Spearman >= 0.5. The last lines say whether each holds; the script
# exits 0 either way (a benchmark on a shared machine), 1 only when it could not measure.
#
# Output under OUT (default $BUILD/cluster-bench): layouts.md (the report), layouts.tsv (one row per
# layout), layouts-search.md / deep64-layouts.json (the 2048-rank search) and layouts/ (the model,
# the profile, the plan's JSON, every build and run).
#
# Options: --quick (1 round of 4 steps), --out DIR, --rounds N (3), --steps N (6), --rate R
# (300mbit), --model F.moe (instead of the stack, e.g. bench/cluster/gpt_moe.moe, whose MP splits
# attention by heads), --search-only, --no-search, --tune-with-model. Needs root and network namespaces for the cluster part
# (tests/cluster/cluster.sh check; without them that part says it is skipped).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=$BUILD/moec
CLUSTER=tests/cluster/cluster.sh
OUT=$BUILD/cluster-bench
ROUNDS=3 STEPS=6 RATE=300mbit SEARCH=1 MEASURE=1 WITH_MODEL=0
NODES=2 RPN=2
BASE_MODEL=bench/cluster/stack.moe
DEEP_MODEL=bench/cluster/deep64.moe
DEEP_CLUSTER=lang/clusters/testbed-a.cluster DEEP_NODES=256
RUN_LIMIT=${LAYOUTS_RUN_LIMIT:-300}    # seconds one run may take (a hung run is stopped, its cluster torn down)
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) ROUNDS=1; STEPS=4 ;;
    --out) OUT=$2; shift ;;
    --rounds) ROUNDS=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --rate) RATE=$2; shift ;;
    --model) BASE_MODEL=$2; shift ;;
    --search-only) MEASURE=0 ;;
    --tune-with-model) WITH_MODEL=1 ;;
    --no-search) SEARCH=0 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench/cluster/layouts.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
  shift
done
[ -x "$MOEC" ] || { echo "bench/cluster/layouts.sh: $MOEC is not built (make all)" >&2; exit 1; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
PY=$(command -v python3)

# ---- the emulated cluster: cluster.sh run, under timeout (its own process group, so a stop
# reaches mpirun and cluster.sh's trap tears the namespaces down); INT or TERM here is passed on
# to the run in flight and waited for, so no exit path leaves the cluster up.
CHILD=""
stop() {
  if [ -n "$CHILD" ]; then kill -TERM "$CHILD" 2>/dev/null || true; wait "$CHILD" 2>/dev/null || true; fi
  exit "$1"
}
trap 'stop 130' INT
trap 'stop 143' TERM
crun() {  # crun LIMIT OUTFILE CMD ARGS...: CMD on the 2 x 2 cluster at RATE, output to OUTFILE
  local limit=$1 out=$2 st=0; shift 2
  timeout -k 20 "$limit" "$CLUSTER" run "$NODES" "$RPN" "$RATE" -- "$@" >"$out" 2>&1 </dev/null &
  CHILD=$!
  wait "$CHILD" || st=$?
  CHILD=""
  return "$st"
}
# A run that did not print its step is tried again (twice): another cluster user's `cluster.sh
# down` (tests/cluster/faults.sh clears leftovers that way) kills a run in flight.
crun_retry() {  # crun_retry LIMIT OUTFILE PATTERN CMD ARGS...
  local limit=$1 out=$2 pat=$3 try; shift 3
  for try in 1 2 3; do
    crun "$limit" "$out" "$@" || true
    grep -q "$pat" "$out" && return 0
    cp "$out" "$out.failed$try"
    echo "  (attempt $try failed: $(grep -v '^-*$' "$out" | tail -n 1 | cut -c1-160); again)" >&2
    sleep 2
  done
  return 1
}

# ---- the cluster part ----
measure() {
  local W=$OUT/layouts
  rm -rf "$W"; mkdir -p "$W"
  local md=$OUT/layouts.md
  : >"$md"
  say() { echo "$*" | tee -a "$md"; }
  say "# make cluster-layouts, $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname) ($(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)); $NODES nodes x $RPN ranks at $RATE; $ROUNDS round(s) of $STEPS steps"
  if ! why=$($CLUSTER check); then
    say "layouts: the cluster part is skipped: network namespaces cannot be made here: $why"
    return 0
  fi
  # The model: the stack with the layout left to the search and the planned fsmoe schedule.
  sed -e 's|^parallel .*|parallel auto;|' \
      -e 's|^schedule .*|schedule { policy fsmoe; pipeline auto; }|' "$BASE_MODEL" >"$W/model.moe"
  echo "profiling the cluster (moec tune --quick, about 1-2 minutes)..."
  local with=()
  [ "$WITH_MODEL" = 1 ] && with=(--model "$W/model.moe")
  if ! crun_retry 900 "$W/tune.out" "^# wrote" "$MOEC" tune --quick "${with[@]}" \
       --gpus-per-node "$RPN" -o "$W/c.cluster"; then
    say "layouts: moec tune failed: $(tail -n 3 "$W/tune.out")"; return 1
  fi
  "$MOEC" plan "$W/model.moe" --cluster "$W/c.cluster" --layouts --json "$W/plan.json" >"$W/plan.out" 2>&1 ||
    { say "layouts: moec plan --layouts failed: $(tail -n 3 "$W/plan.out")"; return 1; }
  # The fitting layouts in the search's order: index dp mp ep esp algo predicted pp microbatches
  "$PY" - "$W/plan.json" >"$W/fitting.txt" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
for i, l in enumerate(x for x in j["layouts"] if x["fits"]):
    print(i, l["dp"], l["mp"], l["ep"], l["esp"], l["algo"], repr(l["step_ms"]), l.get("pp", 1), l.get("microbatches", 1))
EOF
  local n
  n=$(wc -l <"$W/fitting.txt")
  echo "the search: $n fitting layouts ($(head -n 1 "$W/plan.out"))"
  [ "$n" -ge 1 ] || { say "layouts: no layout fits"; return 1; }
  while read -r i dp mp ep esp algo pred pp mb; do
    if ! "$MOEC" build "$W/model.moe" --cluster "$W/c.cluster" --layout "$dp,$mp,$ep,$esp,$algo,pp=$pp,microbatches=$mb" \
         -o "$W/L$i" -v >"$W/L$i.build" 2>&1; then
      say "layouts: build of $dp,$mp,$ep,$esp,$algo failed: $(tail -n 3 "$W/L$i.build")"; return 1
    fi
  done <"$W/fitting.txt"
  echo "built $n layouts; running them: $ROUNDS round(s) of $STEPS steps each"
  local round k i
  for ((round = 0; round < ROUNDS; round++)); do
    for ((k = 0; k < n; k++)); do
      i=$(((k + round) % n))
      local lay
      lay=$(awk -v i="$i" '$1 == i { printf "%s,%s,%s,%s,%s,pp=%s,microbatches=%s", $2, $3, $4, $5, $6, $8, $9 }' "$W/fitting.txt")
      if crun_retry "$RUN_LIMIT" "$W/L$i.run$round" "median whole step" "$W/L$i" --steps "$STEPS" --profile --quiet; then
        echo "  round $((round + 1)) $lay: $(grep -o 'median whole step [0-9.]* ms' "$W/L$i.run$round")"
      else
        echo "  round $((round + 1)) $lay: failed: $(tail -n 2 "$W/L$i.run$round" | tr '\n' ' ')" >&2
      fi
    done
  done
  "$PY" - "$W" "$OUT" "$RATE" "$ROUNDS" "$STEPS" <<'EOF' | tee -a "$md"
import glob, json, os, re, statistics, sys
W, OUT, rate, rounds, steps = sys.argv[1:6]
plan = json.load(open(os.path.join(W, "plan.json")))
base = open(os.path.join(W, "model.moe")).read()
batch = int(re.search(r"batch (\d+);", base).group(1))
seqlen = int(re.search(r"seqlen (\d+);", base).group(1))
fit = [l for l in plan["layouts"] if l["fits"]]
chosen = plan.get("chosen")
name = lambda l: "dp%d mp%d ep%d esp%d %s%s" % (l["dp"], l["mp"], l["ep"], l["esp"], l["algo"],
                                               " pp%d x%d" % (l["pp"], l["microbatches"]) if l.get("pp", 1) > 1 or l.get("microbatches", 1) > 1 else "")
rows = []
for i, l in enumerate(fit):
    build = open(os.path.join(W, "L%d.build" % i)).read()
    m = re.findall(r"^# pipeline-plan %s step \S+ \S+ (\S+)" % re.escape(l["policy"]), build, re.M)
    if l.get("pp", 1) > 1:   # stages: the pipelined step (each stage's own plan lines are a microbatch's)
        m = re.findall(r"^# stages: .* = ([0-9.]+) ms", build, re.M)
    bpred = float(m[-1]) if m else float("nan")
    steps_ms, comm = [], []
    for f in sorted(glob.glob(os.path.join(W, "L%d.run[0-9]*" % i))):
        if ".failed" in f:
            continue
        t = open(f).read()
        s = re.search(r"median whole step ([0-9.]+) ms", t)
        if s:
            steps_ms.append(float(s.group(1)))
        c = re.search(r"communication ([0-9.]+) ms per step", t)
        if c:
            comm.append(float(c.group(1)))
    meas = statistics.median(steps_ms) if steps_ms else float("nan")
    rows.append(dict(l=l, name=name(l), pred=l["step_ms"], bpred=bpred, meas=meas, runs=steps_ms,
                     comm=statistics.median(comm) if comm else float("nan"),
                     gb=plan.get("global_batch", l["dp"] * batch), chosen=chosen is not None and all(l.get(k) == chosen.get(k) for k in ("dp", "mp", "ep", "esp", "algo", "pp", "microbatches"))))

def ranks(v):   # average ranks (1 = smallest), ties shared
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r

def spearman(a, b):   # Pearson's correlation of the ranks
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    sab = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    sa = sum((x - ma) ** 2 for x in ra) ** 0.5
    sb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return sab / (sa * sb) if sa > 0 and sb > 0 else float("nan")

ok = [r for r in rows if r["meas"] == r["meas"]]
rp = ranks([r["pred"] for r in ok])
rm = ranks([r["meas"] for r in ok])
for r, a, b in zip(ok, rp, rm):
    r["rp"], r["rm"] = a, b
fmt = lambda x: ("%d" % x) if x == int(x) else ("%.1f" % x)
with open(os.path.join(OUT, "layouts.tsv"), "w") as f:
    f.write("layout\tdp\tmp\tep\tesp\talgo\tglobal_batch\tpredicted_ms\tbuild_predicted_ms\tmeasured_ms\truns_ms\terror_pct\trank_predicted\trank_measured\tcomm_ms\tchosen\n")
    for r in rows:
        l = r["l"]
        err = 100 * (r["pred"] - r["meas"]) / r["meas"] if r["meas"] == r["meas"] else float("nan")
        f.write("%s\t%d\t%d\t%d\t%d\t%s\t%d\t%.3f\t%.3f\t%.3f\t%s\t%.1f\t%s\t%s\t%.1f\t%d\n" % (
            r["name"], l["dp"], l["mp"], l["ep"], l["esp"], l["algo"], r["gb"], r["pred"], r["bpred"], r["meas"],
            ",".join("%.1f" % x for x in r["runs"]), err, fmt(r["rp"]) if "rp" in r else "nan",
            fmt(r["rm"]) if "rm" in r else "nan", r["comm"], r["chosen"]))
print()
print("| layout | global batch | predicted ms | measured ms (runs) | error | rank predicted | rank measured | communication ms |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    err = "%+.1f %%" % (100 * (r["pred"] - r["meas"]) / r["meas"]) if r["meas"] == r["meas"] else "-"
    print("| %s%s | %d | %.1f | %.1f (%s) | %s | %s | %s | %.1f |" % (
        r["name"], " (chosen)" if r["chosen"] else "", r["gb"], r["pred"], r["meas"],
        ", ".join("%.0f" % x for x in r["runs"]) or "no run", err,
        fmt(r["rp"]) if "rp" in r else "-", fmt(r["rm"]) if "rm" in r else "-", r["comm"]))
    if abs(r["bpred"] - r["pred"]) > 1e-6 * max(1.0, abs(r["pred"])):
        print("|   (moec build -v predicted %.3f ms for it, the search %.3f) |||||||" % (r["bpred"], r["pred"]))
print()
rho = spearman([r["pred"] for r in ok], [r["meas"] for r in ok]) if len(ok) >= 2 else float("nan")
print("layouts: %d candidates, %d fit, %d measured; Spearman rank correlation of predicted and measured step: %.3f"
      % (len(plan["layouts"]), len(fit), len(ok), rho))
fastest = min(ok, key=lambda r: r["meas"]) if ok else None
ch = [r for r in ok if r["chosen"]]
within = float("nan")
if ch and fastest:
    within = 100 * (ch[0]["meas"] - fastest["meas"]) / fastest["meas"]
    print("chosen %s: measured %.1f ms (predicted %.1f); fastest measured %s %.1f ms: chosen within %.1f %% of the fastest"
          % (ch[0]["name"], ch[0]["meas"], ch[0]["pred"], fastest["name"], fastest["meas"], within))
else:
    print("chosen: %s (not measured)" % (name(chosen) if chosen else "none"))
errs = [abs(r["pred"] - r["meas"]) / r["meas"] * 100 for r in ok]
if errs:
    print("prediction error: median %.1f %%, worst %.1f %%" % (statistics.median(errs), max(errs)))
# Under `parallel auto` every layout trains the model's global batch. Should the layouts differ in
# it (a search that reads batch per DP rank), the lines below compare the layouts of one global
# batch among themselves, and all of them by time per sample.
for gb in sorted(set(r["gb"] for r in ok)):
    g = [r for r in ok if r["gb"] == gb]
    if len(g) >= 2:
        print("global batch %d (%d layouts): Spearman %.3f" % (gb, len(g), spearman([r["pred"] for r in g], [r["meas"] for r in g])))
if len(set(r["gb"] for r in ok)) > 1:
    rs = spearman([r["pred"] / r["gb"] for r in ok], [r["meas"] / r["gb"] for r in ok])
    bp = min(ok, key=lambda r: r["pred"] / r["gb"])
    bm = min(ok, key=lambda r: r["meas"] / r["gb"])
    print("per sample (step / global batch): Spearman %.3f; fastest predicted %s (%.1f ms per sample), fastest measured %s (%.1f)"
          % (rs, bp["name"], bp["pred"] / bp["gb"], bm["name"], bm["meas"] / bm["gb"]))
print("throughput (global batch x seqlen / measured step): " + "; ".join(
    "%s %.0f tok/s" % (r["name"], r["gb"] * seqlen / r["meas"] * 1000) for r in ok))
print("search: %.3f s for the %d layouts of %s (search_seconds of moec plan --layouts)" % (
    plan["search_seconds"], len(plan["layouts"]), "2 x 2"))
print("acceptance: >= 4 fitting layouts measured: %s; chosen within 10 %% of the fastest: %s; Spearman >= 0.5: %s" % (
    "yes" if len(ok) >= 4 else "NO", "yes" if within == within and within <= 10 else "NO",
    "yes" if rho == rho and rho >= 0.5 else "NO"))
EOF
  say "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) (runs on a loaded machine measure its other jobs too)"
  echo "wrote $OUT/layouts.md and $OUT/layouts.tsv (runs under $W)"
}

# ---- the search at scale (no namespaces) ----
search() {
  local md=$OUT/layouts-search.md cl=$OUT/testbed-a-$DEEP_NODES.cluster json=$OUT/deep64-layouts.json
  # (without the testbed's `memory`: the model's peaks are TiB per rank; the search's time is measured)
  sed -e "s|^\( *\)nodes [0-9]*;|\1nodes $DEEP_NODES;|" -e '/^ *memory /d' "$DEEP_CLUSTER" >"$cl"
  local t0 t1
  t0=$(date +%s.%N)
  if ! "$MOEC" plan "$DEEP_MODEL" --cluster "$cl" --layouts --json "$json" >"$OUT/deep64-layouts.out" 2>&1; then
    echo "layouts: moec plan --layouts of $DEEP_MODEL failed: $(tail -n 3 "$OUT/deep64-layouts.out")" | tee "$md"
    return 1
  fi
  t1=$(date +%s.%N)
  local gpn
  gpn=$(sed -n 's/^ *gpus_per_node \([0-9]*\);.*/\1/p' "$cl")
  "$PY" - "$json" "$DEEP_MODEL" "$DEEP_CLUSTER" "$DEEP_NODES" "$t0" "$t1" "$gpn" <<'EOF' | tee "$md"
import json, sys
j = json.load(open(sys.argv[1]))
model, cluster, nodes, t0, t1, gpn = sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
L = j["layouts"]
fit = [l for l in L if l["fits"]]
c = j.get("chosen")
name = lambda l: "dp%d mp%d ep%d esp%d %s%s" % (l["dp"], l["mp"], l["ep"], l["esp"], l["algo"],
                                               " pp%d x%d" % (l["pp"], l["microbatches"]) if l.get("pp", 1) > 1 or l.get("microbatches", 1) > 1 else "")
print("search at scale: moec plan --layouts %s on %s with nodes %d (%d ranks): %d candidates, %d priced and fit, "
      "chosen %s (predicted %.0f ms); search_seconds %.3f s, wall time of the command %.3f s"
      % (model, cluster, nodes, nodes * gpn, len(L), len(fit), name(c) if c else "none",
         c["step_ms"] if c else float("nan"), j["search_seconds"], t1 - t0))
for l in fit:
    print("  %-28s predicted %12.1f ms, peak %.2f TiB per rank" % (name(l), l["step_ms"], l["peak_bytes"] / 2**40))
EOF
}

status=0
if [ "$MEASURE" = 1 ]; then measure || status=1; fi
if [ "$SEARCH" = 1 ]; then
  [ "$MEASURE" = 1 ] && echo
  search || status=1
fi
exit "$status"
