#!/usr/bin/env bash
# make bench's CPU comparison (issue 14): moec's whole training step beside PyTorch eager on the
# CPU, in one run.
#   layer  bench/models/layer_cpu.moe (B 4, L 512, M 512, H 1024, 8 experts, gshard top-2,
#          capacity 1.2, tutel, ffn gpt): the binary's --profile line (median whole step of
#          steps 2..N: data, forward, backward, update; its share in GEMMs) against
#          bench/torch_ref.py --device cpu --shapes gpt:4x512x512x2 (the same layer's forward +
#          backward by autograd, median of its runs; its expert GEMMs alone); the two run in turn
#          three times each and the medians are compared (this machine's speed drifts).
#   t4     Table 4 shapes (the FSMoE paper's): the smallest as it is, two larger with L cut to 512, gpt and
#          mixtral experts, moec beside torch_ref (one run each).
#   lm     three language models: lang/models/gpt_moe_bytes.moe (the demo's GPT-MoE),
#          bench/models/lm_mid.moe and lm_large.moe (issue 28): moec's step, GEMM share and (with
#          perf) share of cycles waiting, beside bench/torch_lm.py --size demo|mid|large, the same
#          model's whole training step in PyTorch (with its update).
#   dropless  bench/models/layer_dropless.moe (the layer with 4 experts and `capacity *`: each
#          expert's worst-case buffer about half empty): the expert GEMMs and GELU gradient over
#          the filled slots (the default) beside the same binary computing every slot
#          (MOERT_ALL_SLOTS=1), the speed-up and both runs' losses (the same to 1e-5).
#   before  this checkout beside an earlier commit (BENCH_BEFORE, default ec9d643: the last before
#          the CPU program fused its elementwise ops and pooled its expert GEMMs, issue 39), built
#          from a git worktree under build/ (removed after): the three language models and the
#          layer, each built by both compilers and run in turn (5 runs each, mid 3, large 1): the
#          medians of their --profile median steps and of each run's now/before (the pair ran
#          back to back: this machine's speed drifts); the losses must be the same.
#   epilogue  the CPU program's GEMM epilogues (fused groups in the GEMMs' pieces) beside the same
#          models built with MOEC_GEMM_ROWS=0 (each group after its GEMM), in turn as `before`.
# BENCH_CPU="layer t4 lm dropless before epilogue" (the default: all) runs only the parts named.
# PyTorch comes from build/torch-venv (created here with pip when missing: PyPI's torch, whose
# Linux wheel brings NVIDIA's libraries, ~3 GB; it runs on the CPU here); without it (no network,
# no pip) the PyTorch column says so and the moec side still runs.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
STEPS=${STEPS:-12}
VENV=$BUILD/torch-venv
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-bench-cpu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  echo "# installing PyTorch into $VENV for the comparison (pip, once)"
  { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q torch numpy; } \
    >"$WORK/pip.log" 2>&1 || echo "# PyTorch could not be installed: $(tail -n 1 "$WORK/pip.log")"
fi
TORCH=""
"$VENV/bin/python" -c 'import torch' 2>/dev/null && TORCH=$VENV/bin/python

# moec NAME MODEL [ENV=VALUE]: the binary's --profile line -> "step_ms gemm_percent" (nothing, and
# why on stderr, when the build or the run fails); the step lines stay in $WORK/NAME.out.
moec_step() {
  [ -x "$WORK/${2##*/}.bin" ] || "$MOEC" build "$2" -o "$WORK/${2##*/}.bin" 2>"$WORK/$1.err" ||
    { echo "# $1: build failed: $(head -n 2 "$WORK/$1.err")" >&2; return 1; }
  env ${3:-MOEC_BENCH=1} "$WORK/${2##*/}.bin" --steps "$STEPS" --profile >"$WORK/$1.out" 2>&1 ||
    { echo "# $1: run failed: $(tail -n 2 "$WORK/$1.out")" >&2; return 1; }
  sed -n 's/^# profile: .*median whole step \([0-9.]*\) ms.*GEMM \([0-9.]*\) %.*/\1 \2/p' "$WORK/$1.out"
}

median() { sort -g | awk '{v[NR] = $1} END {if (NR) print v[int((NR + 1) / 2)]}'; }   # of the lines of stdin
want() { case " ${BENCH_CPU:-layer t4 lm dropless before epilogue} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
echo "# moec beside PyTorch eager on the CPU: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "# moec: median whole training step of steps 2..$STEPS (data, forward, backward, adamw update), GEMM share"
echo "# PyTorch: forward + backward of the same layer (autograd, median of 10 runs), its expert GEMMs alone"
printf '%-10s %-26s %12s %8s %14s %12s %14s\n' case shape "moec ms" "GEMM %" "PyTorch ms" "torch GEMM" "moec/PyTorch"
status=0
if want layer; then
# The layer: moec and PyTorch in turn, three runs each (the machine's speed drifts); the medians.
: >"$WORK/layer.ms"; : >"$WORK/torch.ms"
for run in 1 2 3; do
  moec_step layer bench/models/layer_cpu.moe >>"$WORK/layer.ms"
  if [ -n "$TORCH" ]; then
    "$TORCH" bench/torch_ref.py --device cpu --shapes gpt:4x512x512x2 >"$WORK/torch.out" 2>&1
    awk '$1 == "gpt" && $2 == "4x512x512x2" {print $5, $6}' "$WORK/torch.out" >>"$WORK/torch.ms"
  fi
done
if read -r ms gemm < <(sort -n "$WORK/layer.ms" | sed -n 2p) && [ -n "${gemm:-}" ]; then
  tms="-" tgemm="-" ratio="-"
  if [ -z "$TORCH" ]; then
    tms="no torch"
  elif [ "$(wc -l <"$WORK/torch.ms")" = 3 ]; then
    read -r tms tgemm < <(sort -n "$WORK/torch.ms" | sed -n 2p)
    ratio=$(awk -v a="$ms" -v b="$tms" 'BEGIN {printf "%.2f", a / b}')
  else
    tms="failed"; status=1; tail -n 5 "$WORK/torch.out" | sed 's/^/# torch_ref: /'
  fi
  printf '%-10s %-26s %12.1f %8.1f %14s %12s %14s
' layer "B4 L512 M512 H1024 E8 k2" "$ms" "$gemm" "$tms" "$tgemm" "$ratio"
  echo "# layer runs (moec ms, PyTorch ms, in turn): $(awk '{printf "%s ", $1}' "$WORK/layer.ms")/ $(awk '{printf "%s ", $1}' "$WORK/torch.ms")"
else
  echo "layer: moec failed"; status=1
fi
fi
if want t4; then
# Table 4 shapes (the FSMoE paper's) on the CPU: its smallest, (B 1, L 512, M 1024, hscale 2), as it is,
# and two larger ones with L cut to 512 (scaled down to fit this machine's time), each with both
# ffns, 8 experts, gshard top-2, capacity 1.2 (f = 2.4), tutel: moec's step beside torch_ref's
# forward + backward of the same layer, one run each.
table4_model() {   # NAME FFN B L M HSCALE -> $WORK/NAME.moe
  local ffn_body
  if [ "$2" = gpt ]; then ffn_body="ffn gpt { hidden $(($5 * $6)); act gelu; bias true; }"
  else ffn_body="ffn mixtral { hidden $(($5 * $6)); }"; fi
  cat >"$WORK/$1.moe" <<MOE
model $1 {
  dtype fp32; batch $3; seqlen $4; embed $5; seed 1;
  optimizer adamw { lr 0.001; }
}
layer block {
  moe {
    experts 8 { $ffn_body }
    gate gshard { k 2; capacity 1.2; aux_loss 0.01; }
    order tutel;
  }
}
MOE
}
for shape in 1x512x1024x2 2x512x1024x4 1x512x2048x3; do
  for ffn in gpt mixtral; do
    IFS=x read -r b l m h <<<"$shape"
    name=t4_${ffn}_${b}_${l}_${m}_${h}
    table4_model "$name" "$ffn" "$b" "$l" "$m" "$h"
    if ! read -r ms gemm < <(moec_step "$name" "$WORK/$name.moe") || [ -z "${gemm:-}" ]; then
      echo "table4 $ffn:$shape: moec failed"; status=1; continue
    fi
    tms="-" tgemm="-" ratio="-"
    if [ -z "$TORCH" ]; then
      tms="no torch"
    elif "$TORCH" bench/torch_ref.py --device cpu --runs 5 --shapes "$ffn:$shape" >"$WORK/torch.out" 2>&1 &&
         read -r tms tgemm < <(awk -v f="$ffn" -v s="$shape" '$1 == f && $2 == s {print $5, $6}' "$WORK/torch.out") &&
         [ -n "${tgemm:-}" ]; then
      ratio=$(awk -v a="$ms" -v b="$tms" 'BEGIN {printf "%.2f", a / b}')
    else
      tms="failed"; status=1; tail -n 5 "$WORK/torch.out" | sed 's/^/# torch_ref: /'
    fi
    printf '%-10s %-26s %12.1f %8.1f %14s %12s %14s\n' "t4 $ffn" "B$b L$l M$m H$((m * h)) E8 k2" "$ms" "$gemm" "$tms" "$tgemm" "$ratio"
  done
done
fi
if want lm; then
# The language models (issue 28), three sizes: moec's whole step beside bench/torch_lm.py's (the
# same model in PyTorch: forward, backward, clip, AdamW), medians of their steps; the two run in
# turn three times (demo, mid) or once (large) and the medians of the runs are compared. GEMM %: moec's --profile share of the step in GEMM calls; wait %:
# with perf, the share of the moec runs' cycles (steps 2.., after a delay past step 1; the median of
# as many perf runs as timed runs) spent
# waiting: in libgomp (threads at barriers) and the kernel's scheduler, futex and sched_yield
# paths; "-" without perf.
lm_wait() {   # BIN STEPS DELAY_MS -> the waiting share in % (nothing without perf or samples)
  command -v perf >/dev/null 2>&1 || return 0
  MOEC_BENCH=1 perf record -q -D "$3" -o "$WORK/perf.data" "$1" --steps "$2" >/dev/null 2>&1 || return 0
  perf report -q -i "$WORK/perf.data" --sort dso,symbol --stdio 2>/dev/null |
    awk '$1 ~ /%$/ { p = $1 + 0; line = $0
                     if (line ~ /libgomp/ || line ~ /\[k\] .*(schedule|futex|yield|idle|switch_to|finish_task_switch)/) w += p }
         END { if (NR) printf "%.1f\n", w }'
}
for size in demo mid large; do
  case $size in   # steps per moec run, per perf run, per torch run; perf's delay when step 1's time is unknown; runs
    demo)  model=lang/models/gpt_moe_bytes.moe shape="B8 L64 M96 V256 x3" steps=$STEPS psteps=300 tsteps=20 delay=1000 runs=3 ;;
    mid)   model=bench/models/lm_mid.moe shape="B4 L256 M512 V8192 x6" steps=6 psteps=10 tsteps=5 delay=3500 runs=3 ;;
    large) model=bench/models/lm_large.moe shape="B2 L512 M1024 V32000 x4" steps=4 psteps=7 tsteps=3 delay=13000 runs=1 ;;
  esac
  # moec and PyTorch in turn, `runs` times each (the machine's speed drifts), the medians.
  : >"$WORK/lm.ms"; : >"$WORK/lm.gemm"; : >"$WORK/tlm.ms"; tstatus=""
  for run in $(seq "$runs"); do
    if read -r ms gemm < <(STEPS=$steps moec_step "lm_$size" "$model") && [ -n "${gemm:-}" ]; then
      echo "$ms" >>"$WORK/lm.ms"; echo "$gemm" >>"$WORK/lm.gemm"
    fi
    if [ -z "$TORCH" ]; then
      tstatus="no torch"
    elif "$TORCH" bench/torch_lm.py --size "$size" --steps "$tsteps" --warmup 2 >"$WORK/torch_lm.out" 2>&1 &&
         awk '$1 == "lm" {print $3}' "$WORK/torch_lm.out" >>"$WORK/tlm.ms"; then
      :
    else
      tstatus="failed"; tail -n 5 "$WORK/torch_lm.out" | sed 's/^/# torch_lm: /'
    fi
  done
  ms=$(median <"$WORK/lm.ms"); gemm=$(median <"$WORK/lm.gemm"); tms=$(median <"$WORK/tlm.ms")
  if [ -z "$ms" ]; then
    echo "lm $size: moec failed"; status=1; continue
  fi
  [ "$tstatus" = failed ] && status=1
  ratio="-"
  if [ -n "$tms" ] && [ -z "$tstatus" ]; then
    ratio=$(awk -v a="$ms" -v b="$tms" 'BEGIN {printf "%.2f", a / b}')
  else
    tms=${tstatus:-failed}
  fi
  # perf's delay: past step 1 as the last moec run took it (1.5 x its time + 0.5 s: the start), else the table's.
  step1=$(awk '$1 == "step" && $2 == 1 { for (i = 3; i < NF; i++) if ($i == "time") print int(1.5 * $(i + 1)) + 500 }' "$WORK/lm_$size.out")
  # the median of `runs` perf runs (a run in which the machine's other tenants took a core
  # waits more: 6.7 to 11.3 % for the demo model within an hour here)
  wait=$(for run in $(seq "$runs"); do lm_wait "$WORK/${model##*/}.bin" "$psteps" "${step1:-$delay}"; done | median)
  wait=${wait:--}
  printf '%-10s %-26s %12.1f %8.1f %14s %12s %14s   wait %s %%  (runs: moec %s; PyTorch %s)\n' "lm $size" "$shape" "$ms" "$gemm" "$tms" "-" "$ratio" "$wait" \
    "$(paste -sd' ' "$WORK/lm.ms")" "$(paste -sd' ' "$WORK/tlm.ms")"
done
fi
if want dropless; then
# Dropless: filled slots only (A) against every slot of the worst-case buffers (B), same binary,
# run in turn A B A B A B (the machine's speed drifts): the medians of the three runs' medians.
: >"$WORK/a.ms"; : >"$WORK/b.ms"
for run in 1 2 3; do
  moec_step dropless bench/models/layer_dropless.moe >>"$WORK/a.ms"
  moec_step dropless_all bench/models/layer_dropless.moe MOERT_ALL_SLOTS=1 >>"$WORK/b.ms"
done
if read -r ms_a gemm_a < <(sort -n "$WORK/a.ms" | sed -n 2p) && [ -n "${gemm_a:-}" ] &&
   read -r ms_b gemm_b < <(sort -n "$WORK/b.ms" | sed -n 2p) && [ -n "${gemm_b:-}" ]; then
  la=$(awk '/^step/ {l = $4} END {print l}' "$WORK/dropless.out"); lb=$(awk '/^step/ {l = $4} END {print l}' "$WORK/dropless_all.out")
  same=$(paste <(awk '/^step/ {print $4}' "$WORK/dropless.out") <(awk '/^step/ {print $4}' "$WORK/dropless_all.out") |
         awk '{d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * ($2 < 0 ? -$2 : $2)) bad = 1} END {print bad ? "DIFFER" : "same"}')
  printf '%-10s %-26s %12.1f %8.1f %14s %12s %14s
' dropless "B4 L512 M512 H1024 E4 k2 *" "$ms_a" "$gemm_a" "-" "-" "-"
  echo "# dropless: filled slots $ms_a ms/step, every slot (MOERT_ALL_SLOTS=1) $ms_b ms/step (medians of 3 runs each, in turn: $(tr '\n' ' ' <"$WORK/a.ms" | awk '{print $1, $3, $5}') / $(tr '\n' ' ' <"$WORK/b.ms" | awk '{print $1, $3, $5}')): $(awk -v a="$ms_a" -v b="$ms_b" 'BEGIN {printf "%.2fx", b / a}') faster; losses $same (last $la vs $lb)"
  [ "$same" = same ] || status=1
else
  echo "dropless: moec failed"; status=1
fi
fi
# build_pair NAME MODEL BIN CMD...: BIN.now built from MODEL by this moec, BIN.before by the moec
# command CMD (with its environment); says so and fails when either build fails.
build_pair() {
  local name=$1 model=$2 bin=$3
  shift 3
  if ! "$MOEC" build "$model" -o "$bin.now" >"$WORK/b.err" 2>&1 || ! "$@" build "$model" -o "$bin.before" >>"$WORK/b.err" 2>&1; then
    echo "$name: build failed: $(head -n 2 "$WORK/b.err")"; status=1; return 1
  fi
}

# in_turn NAME SHAPE BIN STEPS RUNS: BIN.before and BIN.now run in turn RUNS times (--steps STEPS
# --profile); prints the medians of their median steps and of each pair's now/before, and whether
# the losses are the same.
in_turn() {
  local name=$1 shape=$2 bin=$3 steps=$4 runs=$5 same=same b n r
  : >"$WORK/now.ms"; : >"$WORK/before.ms"; : >"$WORK/ratio"
  for run in $(seq "$runs"); do
    for which in before now; do
      MOEC_BENCH=1 "$bin.$which" --steps "$steps" --profile >"$WORK/$which.out" 2>&1 || { status=1; echo "$name: $which run failed"; }
      sed -n 's/^# profile: .*median whole step \([0-9.]*\) ms.*/\1/p' "$WORK/$which.out" >>"$WORK/$which.ms"
    done
    cmp -s <(awk '/^step/ {print $4}' "$WORK/before.out") <(awk '/^step/ {print $4}' "$WORK/now.out") || same=DIFFER
    paste <(tail -n 1 "$WORK/now.ms") <(tail -n 1 "$WORK/before.ms") | awk '$2 > 0 {printf "%.3f\n", $1 / $2}' >>"$WORK/ratio"
  done
  b=$(median <"$WORK/before.ms"); n=$(median <"$WORK/now.ms"); r=$(median <"$WORK/ratio")
  if [ -z "$b" ] || [ -z "$n" ] || [ -z "$r" ]; then echo "$name: no profile line"; status=1; return; fi
  [ "$same" = same ] || status=1
  printf '%-10s %-26s %12.1f %12.1f %12s   losses %s  (now/before of each run: %s)\n' "$name" "$shape" "$b" "$n" "$r" "$same" \
    "$(paste -sd' ' "$WORK/ratio")"
}
if want before; then
REV=${BENCH_BEFORE:-ec9d643}
BEFORE=$(cd "$BUILD" && pwd)/before-$REV
echo "# before: this checkout beside $REV (its moec built in $BEFORE), in turn; median --profile steps, ms"
if ! git rev-parse -q --verify "$REV^{commit}" >/dev/null 2>&1; then
  echo "# before: commit $REV is not in this clone (a shallow clone?): skipped"
elif ! { [ -x "$BEFORE/build/moec" ] ||
         { git worktree add -f --detach "$BEFORE" "$REV" >"$WORK/before.log" 2>&1 &&
           make -C "$BEFORE" build/moec build/libmoert.a >>"$WORK/before.log" 2>&1; }; }; then
  echo "before: building $REV failed: $(tail -n 2 "$WORK/before.log")"; status=1
else
  printf '%-10s %-26s %12s %12s %12s\n' case shape "before ms" "now ms" "now/before"
  for c in "lm demo|lang/models/gpt_moe_bytes.moe|B8 L64 M96 V256 x3|300|5" "lm mid|bench/models/lm_mid.moe|B4 L256 M512 V8192 x6|6|3" \
           "lm large|bench/models/lm_large.moe|B2 L512 M1024 V32000 x4|4|1" "layer|bench/models/layer_cpu.moe|B4 L512 M512 H1024 E8 k2|$STEPS|5"; do
    IFS='|' read -r name model shape steps runs <<<"$c"
    build_pair "$name" "$model" "$WORK/before_${model##*/}" env MOEC_ROOT="$BEFORE" "$BEFORE/build/moec" &&
      in_turn "$name" "$shape" "$WORK/before_${model##*/}" "$steps" "$runs"
  done
fi
if [ -d "$BEFORE" ] && [ -z "${BENCH_BEFORE_KEEP:-}" ]; then git worktree remove --force "$BEFORE" >/dev/null 2>&1 || rm -rf "$BEFORE"; git worktree prune; fi
fi
if want epilogue; then
# The CPU program's GEMM epilogues (the fused group after a GEMM run in the GEMM's pieces) beside
# the same model built with MOEC_GEMM_ROWS=0 (each group after its GEMM), in turn.
echo "# epilogue: the groups in their GEMMs' pieces (now) beside MOEC_GEMM_ROWS=0 (before: after the GEMMs), in turn; median --profile steps, ms"
printf '%-10s %-26s %12s %12s %12s\n' case shape "after ms" "in ms" "in/after"
for c in "lm demo|lang/models/gpt_moe_bytes.moe|B8 L64 M96 V256 x3|300|5" "lm mid|bench/models/lm_mid.moe|B4 L256 M512 V8192 x6|6|3" \
         "layer|bench/models/layer_cpu.moe|B4 L512 M512 H1024 E8 k2|$STEPS|5" "dropless|bench/models/layer_dropless.moe|B4 L512 M512 H1024 E4 k2 *|$STEPS|5"; do
  IFS='|' read -r name model shape steps runs <<<"$c"
  build_pair "$name" "$model" "$WORK/epilogue_${model##*/}" env MOEC_GEMM_ROWS=0 "$MOEC" &&
    in_turn "$name" "$shape" "$WORK/epilogue_${model##*/}" "$steps" "$runs"
done
fi
[ $status -eq 0 ] && echo OK || echo FAILED
exit $status
