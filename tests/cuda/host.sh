#!/usr/bin/env bash
# The CUDA target's programs without a GPU (make test). `moec build --target cuda` with
# MOEC_CUDA_FAKE=1 (a test hook) links the program against the fake device,
# build/cuda/libfake_cuda.a (tests/cuda/fake_cuda.cpp: rt_cuda.h on host memory, the kernels
# emulated on the CPU, GEMMs and collectives by libmoert); its runs are compared with the CPU
# program of the same model:
#   - the gate x order x expert matrix (tests/cuda/matrix.sh, 34 stacks): losses and --dump bit
#     for bit;
#   - the language models and the shared-expert stack on 2 and 4 ranks (MP by heads, EP, ESP,
#     DP): the losses of 3 steps to 1e-5 relative, the first step's --dump (output or logits,
#     every whole gradient) bit for bit;
#   - every model of lang/models, tests/models and tests/golden (the zoo's gates, orders,
#     experts and hooks, the language models, sched and parallel on 4 ranks: scheduled streams
#     with events, EP AlltoAll, ESP AllGather/ReduceScatter, MP, 2dh) is compared in
#     tests/golden_runs.sh, which builds both programs and runs them 3 steps with --dump anyway:
#     losses and dump files bit for bit to each other (not built and run here a second time);
#   - tiny.moe: --check-grad passes, a checkpoint saved and resumed continues the CPU run, the
#     PTX of --gpu-arch sm_80 is what a newer device loads, an sm_90 program refuses an older
#     device; gpt2_moe.moe's record hooks write the CPU program's lines (to 1e-6);
#   - dtype bf16 (mixed precision: bf16 GEMM inputs, fp32 accumulation, master weights and the
#     rest), tiny.moe with 'dtype bf16' against the fp32 CPU program of tiny.moe: 20 steps lower
#     the loss (last < 0.9 x first), the first step's loss is within 1e-2 relative; tiny without
#     gate noise (tinyq), whose first step routes every token alike in bf16 and fp32: --dump
#     (output and every whole gradient) within 3e-2 of each tensor's largest element; bf16
#     storage (values only GEMMs read, saved activations read by the backward's elementwise
#     kernels): gpt_moe_bytes' peak, its device block, the bits of --no-fuse with
#     MOEC_BF16_SAVED=0, and the language model on 4 ranks with fsmoe streams;
#   - `moec build --target cuda` without the hook links the real runtime (libmoert_cuda,
#     cuBLAS, NCCL), and without a GPU the binary says so and exits 1; `--target auto` says
#     which target it picked and why.
# One line per check, "ok    ..." / "FAIL  ..." / "skip  ..."; without the CUDA toolkit one skip
# line and exit status 0. What the fake device does not show (GPU arithmetic, concurrency of the
# streams, NCCL itself) is left to tests/cuda/gpu.sh on a GPU.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
CUDA=${CUDA:-/usr/local/cuda}
. tests/cuda/common.sh
# The fake device loads either image, so these programs embed NVRTC's PTX alone (MOEC_CUDA_IMAGES=ptx,
# a third of NVRTC's time: no CUBIN), as golden-runs' do but tiny's, which carries both and runs the CUBIN.
export MOEC_CUDA_IMAGES=${MOEC_CUDA_IMAGES:-ptx}
if [ ! -f "$CUDA/include/nvrtc.h" ]; then
  skip "cuda host" "no CUDA toolkit (nothing at $CUDA/include/nvrtc.h)"
  exit 0
fi
if [ ! -f "$BUILD/cuda/libfake_cuda.a" ]; then
  bad "cuda host: $BUILD/cuda/libfake_cuda.a is missing (make builds it where the CUDA toolkit is)"
  exit 1
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-cuda-host.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
TIMEOUT=120
TOL=1e-5

# build NAME MODEL [BUILD-ARGS...]: WORK/NAME.cpu (the CPU program) and WORK/NAME.cuda (the CUDA
# program on the fake device); on failure prints why and returns 1. NAME_bf16 (MODEL X_bf16.moe,
# dtype bf16): the CPU program is X.moe's, the fp32 twin (the CPU target refuses bf16).
build() {
  local name=$1 model=$2 cpu_model=$2
  shift 2
  case $name in *_bf16) cpu_model=${model%_bf16.moe}.moe ;; esac
  "$MOEC" build "$cpu_model" -o "$WORK/$name.cpu" "$@" 2>"$WORK/err" || { echo "cpu build: $(head -c 2000 "$WORK/err")"; return 1; }
  MOEC_CUDA_FAKE=1 "$MOEC" build "$model" --target cuda -o "$WORK/$name.cuda" "$@" 2>"$WORK/err" ||
    { echo "cuda build: $(head -c 2000 "$WORK/err")"; return 1; }
}

# run NAME KIND P ARGS...: WORK/NAME.KIND on P ranks (1: no mpirun) in WORK, output in
# WORK/NAME.KIND.out.
run() {
  local name=$1 kind=$2 np=$3
  shift 3
  if [ "$np" = 1 ]; then
    (cd "$WORK" && timeout "$TIMEOUT" "./$name.$kind" "$@" >"$name.$kind.out" 2>&1 </dev/null)
  else
    (cd "$WORK" && timeout "$TIMEOUT" $MPIRUN -np "$np" "./$name.$kind" "$@" >"$name.$kind.out" 2>&1 </dev/null)
  fi
}

# The bf16 variants of tiny.moe and their fp32 twins (tinyq: no gate noise).
cp lang/models/tiny.moe "$WORK/tiny.moe"
sed 's/noise 1\.0;/noise 0.0;/' lang/models/tiny.moe >"$WORK/tinyq.moe"
for v in tiny tinyq; do sed 's/dtype fp32;/dtype bf16;/' "$WORK/$v.moe" >"$WORK/${v}_bf16.moe"; done
# The GPT-style language model on dp2·mp2·ep4: attention split by heads over MP; with adamw, and
# its bf16 twin.
sed 's/optimizer sgd { lr 0.01; }/optimizer adamw { lr 0.01; }/' tests/models/grad_lm_gpt.moe >"$WORK/lm_adam.moe"
sed 's/^model grad_lm_gpt { /model grad_lm_gpt { dtype bf16; /' "$WORK/lm_adam.moe" >"$WORK/lm_adam_bf16.moe"
# A language model with heads of 32 (tests/cuda/lm_tc.moe): the bf16 program's attention on tensor cores.
cp tests/cuda/lm_tc.moe "$WORK/lm_tc.moe"
sed 's/dtype fp32;/dtype bf16;/' "$WORK/lm_tc.moe" >"$WORK/lm_tc_bf16.moe"
sed 's/^layer block x 2/parallel { dp 2; mp 2; ep 4; }\nlayer block x 2/' tests/models/grad_lm_gpt.moe >"$WORK/lm_mp.moe"
# The Qwen-style language model (bias qkv, head_dim apart from embed/heads, renormalize false and a
# renormalised top-1) on mp2·ep2 (attention split by heads of head_dim).
sed 's/^layer block x 2/parallel { mp 2; ep 2; }\nlayer block x 2/' tests/models/grad_lm_qwen.moe >"$WORK/lm_qwen_mp.moe"

# The programs of every comparison, built two at a time (NVRTC takes most of a build). The models
# of lang/models, tests/models and tests/golden on their own layouts are golden-runs' comparisons
# (above); tiny, gpt2_moe and sched are built for the checks below (graphs, record hooks, tiny's).
MODELS="tiny:lang/models/tiny.moe gpt2_moe:lang/models/gpt2_moe.moe sched:tests/golden/sched.moe
        tiny_bf16:$WORK/tiny_bf16.moe tinyq_bf16:$WORK/tinyq_bf16.moe
        lm_mp:$WORK/lm_mp.moe lm_qwen_mp:$WORK/lm_qwen_mp.moe lm_adam_bf16:$WORK/lm_adam_bf16.moe
        lm_tc_bf16:$WORK/lm_tc_bf16.moe"
# The shared expert (Qwen2-MoE: a SwiGLU expert every token goes through, gated by sigmoid(x·w) per
# token, and an ungated one): the gradient-check stack on dp2·mp2·ep2·esp2, the language model on
# mp2·ep2.
sed 's/^layer gated x 2/parallel { dp 2; mp 2; ep 2; esp 2; }\nlayer gated x 2/' tests/models/grad_shared.moe >"$WORK/shared_par.moe"
sed 's/^layer block x 2/parallel { mp 2; ep 2; }\nlayer block x 2/' tests/models/grad_lm_shared.moe >"$WORK/lm_shared_mp.moe"
MODELS="$MODELS shared_par:$WORK/shared_par.moe lm_shared_mp:$WORK/lm_shared_mp.moe"
# The attention options of the Hugging Face families on mp2·ep2: Qwen3-MoE's per-head RMSNorm of q
# and k (each rank normalises its heads), and Mixtral's sliding windows (3, 1 and the whole
# sequence).
sed 's/^layer block x 2/parallel { mp 2; ep 2; }\nlayer block x 2/' tests/models/grad_lm_qknorm.moe >"$WORK/lm_qknorm_mp.moe"
sed 's/^layer block x 2/parallel { mp 2; ep 2; }\nlayer block x 2/' tests/models/grad_lm_window.moe >"$WORK/lm_window_mp.moe"
MODELS="$MODELS lm_qknorm_mp:$WORK/lm_qknorm_mp.moe lm_window_mp:$WORK/lm_window_mp.moe"
# The gate x order x expert matrix (tests/cuda/matrix.sh: every configuration of the CPU gradient
# check's matrix, as layers of 34 small stacks), the models tests/cuda/gpu.sh runs on a GPU.
bash tests/cuda/matrix.sh "$WORK/matrix" >"$WORK/matrix.names"
for name in $(cat "$WORK/matrix.names"); do MODELS="$MODELS $name:$WORK/matrix/$name.moe"; done
for entry in $MODELS; do
  [ "$(jobs -rp | wc -l)" -ge 2 ] && wait -n
  (build "${entry%%:*}" "${entry#*:}" >"$WORK/${entry%%:*}.build" 2>&1; echo $? >"$WORK/${entry%%:*}.built") &
done
wait

# compare LABEL NAME P: both programs 3 steps with --dump of the first; losses and dumps. The
# comparisons and the matrix's run side by side (spawn, tests/lib.sh; each its own files).
compare() {
  local label=$1 name=$2 np=$3 why
  if [ "$(cat "$WORK/$name.built" 2>/dev/null)" != 0 ]; then bad "cuda host $label: build" "$(cat "$WORK/$name.build")"; return; fi
  if ! run "$name" cpu "$np" --steps 3 --dump "$name.cpu.dump"; then
    bad "cuda host $label: the CPU program failed" "$(tail -n 20 "$WORK/$name.cpu.out")"; return
  fi
  if ! run "$name" cuda "$np" --steps 3 --dump "$name.cuda.dump"; then
    bad "cuda host $label: the CUDA program failed on the fake device" "$(tail -n 20 "$WORK/$name.cuda.out")"; return
  fi
  if same_losses "$WORK/$name.cpu.out" "$WORK/$name.cuda.out" "$TOL"; then
    ok "cuda host $label: losses of 3 steps equal the CPU program's ($TOL)"
  else
    bad "cuda host $label: losses differ from the CPU program's" "$(grep -h '^step' "$WORK/$name.cpu.out" "$WORK/$name.cuda.out")"
  fi
  if why=$(compare_dumps "$WORK/$name.cpu.dump" "$WORK/$name.cuda.dump" "$TOL"); then
    ok "cuda host $label: --dump output and whole gradients equal the CPU program's ($why)"
  else
    bad "cuda host $label: --dump differs from the CPU program's" "$why"
  fi
}

spawn "c_lm_mp" compare "GPT-style language model on 4 ranks (dp2, mp2 by heads, ep4)" lm_mp 4
spawn "c_lm_qwen_mp" compare "Qwen-style language model on 2 ranks (mp2 by heads of head_dim, ep2)" lm_qwen_mp 2
spawn "c_shared_par" compare "shared expert stack on 4 ranks (dp2, mp2, ep2, esp2)" shared_par 4
spawn "c_lm_shared_mp" compare "Qwen2-MoE-style language model with shared experts on 2 ranks (mp2, ep2)" lm_shared_mp 2
spawn "c_lm_qknorm_mp" compare "Qwen3-MoE-style language model on 2 ranks (mp2 by heads, ep2; qk_norm head)" lm_qknorm_mp 2
spawn "c_lm_window_mp" compare "Mixtral-style language model with sliding windows on 2 ranks (mp2, ep2)" lm_window_mp 2
# The matrix: the losses of 3 steps and every --dump file bit for bit, one line a model.
matrix_one() {
  local name=$1
  if [ "$(cat "$WORK/$name.built" 2>/dev/null)" != 0 ]; then bad "cuda host $name: build" "$(cat "$WORK/$name.build")"; return; fi
  if ! run "$name" cpu 1 --steps 3 --dump "$name.cpu.dump" || ! run "$name" cuda 1 --steps 3 --dump "$name.cuda.dump"; then
    bad "cuda host $name: a program failed" "$(tail -n 20 "$WORK/$name.cpu.out" "$WORK/$name.cuda.out")"; return
  fi
  if same_losses "$WORK/$name.cpu.out" "$WORK/$name.cuda.out" 0 && diff -r "$WORK/$name.cpu.dump" "$WORK/$name.cuda.dump" >/dev/null; then
    ok "cuda host $name: losses of 3 steps equal and every --dump file bit-identical to the CPU program's ($(grep -c '^layer' "$WORK/matrix/$name.moe") layers)"
  else
    bad "cuda host $name: differs from the CPU program" "$(grep -h '^step' "$WORK/$name.cpu.out" "$WORK/$name.cuda.out"; diff -rq "$WORK/$name.cpu.dump" "$WORK/$name.cuda.dump" | head -n 5)"
  fi
}
ids="c_lm_mp c_lm_qwen_mp c_shared_par c_lm_shared_mp c_lm_qknorm_mp c_lm_window_mp"
for name in $(cat "$WORK/matrix.names"); do
  spawn "m_$name" matrix_one "$name"
  ids="$ids m_$name"
done
collect $ids
# The language models' dumps (tokens, logits, every gradient) bit for bit: the attention kernels do
# the CPU kernels' float operations in their order (with a window too: each row over its keys
# from the first it sees, ascending).
for name in lm_mp lm_qwen_mp lm_qknorm_mp lm_window_mp; do
  if [ -d "$WORK/$name.cpu.dump" ] && [ -d "$WORK/$name.cuda.dump" ]; then
    if diff -r "$WORK/$name.cpu.dump" "$WORK/$name.cuda.dump" >/dev/null; then
      ok "cuda host $name: every --dump file (logits, loss, every gradient) is bit-identical to the CPU program's"
    else bad "cuda host $name: --dump files differ from the CPU program's bit for bit" "$(diff -rq "$WORK/$name.cpu.dump" "$WORK/$name.cuda.dump" | head -n 10)"; fi
  fi
done

# CUDA graphs: every program above ran its steps op by op at the first step, captured them into
# graphs at the second and replayed them at the third (the fake device refuses what a capture may
# not do). Here: 5 steps with graphs (3 replays, the step, lr and gate noise set in the nodes) end
# with the parameters and AdamW moments, bit for bit, of 5 steps op by op (MOERT_CUDA_GRAPH=0),
# on one rank and on 4 (sched: fsmoe streams joined by events, EP and ESP collectives; lm_mp).
graph_same() {
  local name=$1 np=$2
  if [ "$(cat "$WORK/$name.built" 2>/dev/null)" != 0 ]; then bad "cuda host graphs $name: build" "$(cat "$WORK/$name.build")"; return; fi
  if ! run "$name" cuda "$np" --steps 5 --save "$name.g.ckpt" || ! grep -q 'steps as CUDA graphs' "$WORK/$name.cuda.out"; then
    bad "cuda host graphs $name: the run with graphs" "$(tail -n 20 "$WORK/$name.cuda.out")"; return
  fi
  cp "$WORK/$name.cuda.out" "$WORK/$name.g.out"
  if ! MOERT_CUDA_GRAPH=0 run "$name" cuda "$np" --steps 5 --save "$name.e.ckpt" || grep -q 'steps as CUDA graphs' "$WORK/$name.cuda.out"; then
    bad "cuda host graphs $name: the run op by op" "$(tail -n 20 "$WORK/$name.cuda.out")"; return
  fi
  local files=0 f
  for f in "$WORK/$name.e.ckpt".*.safetensors; do   # the shards (the index names them)
    if ! cmp -s "$f" "$WORK/$name.g.ckpt${f#"$WORK/$name.e.ckpt"}"; then
      bad "cuda host graphs $name: ${f##*/} differs from the op-by-op run's" "$(grep -h '^step' "$WORK/$name.g.out" "$WORK/$name.cuda.out")"; return
    fi
    files=$((files + 1))
  done
  if same_losses "$WORK/$name.g.out" "$WORK/$name.cuda.out" 0 && [ "$files" -eq "$np" ]; then
    ok "cuda host graphs $name ($np rank(s)): 5 steps replayed from graphs end with the op-by-op run's checkpoint bit for bit ($files shards) and losses"
  else bad "cuda host graphs $name: losses" "$(grep -h '^step' "$WORK/$name.g.out" "$WORK/$name.cuda.out")"; fi
}
graph_same tiny 1
graph_same sched 4
graph_same lm_mp 4
graph_same tiny_bf16 1

# tiny op by op (--no-fuse) on the fake device, with -v: the planted faults below take its link
# line, the --no-fuse check further below its launch count and the program itself.
MOEC_CUDA_FAKE=1 "$MOEC" build lang/models/tiny.moe --target cuda --no-fuse -v -o "$WORK/tiny_nofuse.cuda" 2>"$WORK/nf.err"

# The checks can fail: tiny's program (op by op, no fused kernels to compile) with the gate noise
# launched as a plain launch replays the second step's noise at the third, and with a read-back in
# its forward it is refused at the capture.
if [ -x "$WORK/tiny_nofuse.cuda" ] && "$MOEC" build lang/models/tiny.moe --target cuda --no-fuse --emit c -o "$WORK/gm.c" 2>"$WORK/gm.err" &&
   link=$(sed -n 's/^# link: //p' "$WORK/nf.err") &&
   [ -n "$link" ] && c_file=$(echo "$link" | tr ' ' '\n' | grep -m1 '\.c$') && [ -n "$c_file" ] &&
   sed 's/launch_step(\([0-9]*\), RT_STREAM_COMPUTE, mk_gate_noise,/launch(\1, RT_STREAM_COMPUTE, mk_gate_noise,/' "$WORK/gm.c" >"$WORK/gm_stale.c" &&
   awk '{print} /^static void f0\(RtStep \*st\) \{/ {print "  CK(rt_cuda_sync(cu, RT_STREAM_COMPUTE), 0);"}' "$WORK/gm.c" >"$WORK/gm_sync.c" &&
   ! cmp -s "$WORK/gm.c" "$WORK/gm_stale.c" && ! cmp -s "$WORK/gm.c" "$WORK/gm_sync.c" &&
   ${link//$c_file/$WORK/gm_stale.c} -o "$WORK/gm_stale.cuda" 2>"$WORK/gm.err" &&
   ${link//$c_file/$WORK/gm_sync.c} -o "$WORK/gm_sync.cuda" 2>"$WORK/gm.err"; then
  run gm_stale cuda 1 --steps 3 && run tiny cpu 1 --steps 3 && ! MOERT_CUDA_GRAPH=1 run gm_sync cuda 1 --steps 3
  s2=$(grep -h '^step 2 ' "$WORK/gm_stale.cuda.out" "$WORK/tiny.cpu.out" | awk '{print $4}' | sort -u | wc -l)
  s3=$(grep -h '^step 3 ' "$WORK/gm_stale.cuda.out" "$WORK/tiny.cpu.out" | awk '{print $4}' | sort -u | wc -l)
  if [ "$s2" = 1 ] && [ "$s3" = 2 ] && grep -q 'rt_cuda_sync while a graph is captured' "$WORK/gm_sync.cuda.out"; then
    ok "cuda host graphs: a per-step argument left out of the nodes' updates changes step 3's loss, a read-back inside a step is refused at the capture"
  else
    bad "cuda host graphs: the planted faults were not caught" "$(grep -h '^step' "$WORK/gm_stale.cuda.out" "$WORK/tiny.cpu.out"; tail -n 3 "$WORK/gm_sync.cuda.out")"
  fi
else
  bad "cuda host graphs: building the planted programs" "$(tail -n 5 "$WORK/nf.err" "$WORK/gm.err")"
fi

# The shared expert's programs bit for bit too (scale_rows and its gradient sum in the CPU's order).
for name in shared_par lm_shared_mp; do
  if [ -d "$WORK/$name.cpu.dump" ] && [ -d "$WORK/$name.cuda.dump" ]; then
    if diff -r "$WORK/$name.cpu.dump" "$WORK/$name.cuda.dump" >/dev/null; then
      ok "cuda host $name: every --dump file (output or logits, loss, every gradient) is bit-identical to the CPU program's"
    else bad "cuda host $name: --dump files differ from the CPU program's bit for bit" "$(diff -rq "$WORK/$name.cpu.dump" "$WORK/$name.cuda.dump" | head -n 10)"; fi
  fi
done

# The record hooks' lines: the GPU's statistics (mk_record_stats) against rt_record's.
if [ "$(cat "$WORK/gpt2_moe.built" 2>/dev/null)" != 0 ]; then
  bad "cuda host gpt2_moe: build" "$(cat "$WORK/gpt2_moe.build")"
else
  rm -f "$WORK"/*.jsonl
  run gpt2_moe cpu 1 --steps 2 --record cpu.jsonl && run gpt2_moe cuda 1 --steps 2 --record cuda.jsonl
  if why=$("$PY" - "$WORK/cpu.jsonl" "$WORK/cuda.jsonl" <<'PYEOF'
import json, math, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
if len(a) != len(b) or not a:
    print(f"{len(a)} lines against {len(b)}"); sys.exit(1)
for x, y in zip(a, b):
    for k in x:
        u, v = x[k], y.get(k)
        same = u == v if not isinstance(u, float) else v is not None and abs(u - v) <= 1e-6 * max(abs(u), 1e-12)
        if not same:
            print(f"{k}: {u} against {v} in {x}"); sys.exit(1)
print(f"{len(a)} lines")
PYEOF
  ); then ok "cuda host gpt2_moe: the record hooks write the CPU program's lines ($why, 1e-6)"
  else bad "cuda host gpt2_moe: record lines differ" "$why"; fi
fi

# tiny: the gradient check, a checkpoint, the PTX and the architecture check.
if [ -x "$WORK/tiny.cuda" ]; then
  if run tiny cuda 1 --check-grad && tail -n 1 "$WORK/tiny.cuda.out" | grep -qx OK; then
    ok "cuda host tiny: --check-grad passes on the fake device"
  else
    bad "cuda host tiny: --check-grad" "$(tail -n 15 "$WORK/tiny.cuda.out")"
  fi
  run tiny cpu 1 --steps 4 && cp "$WORK/tiny.cpu.out" "$WORK/tiny4.out"
  if [ "$MOEC_CUDA_IMAGES" = ptx ]; then
    if run tiny cuda 1 --steps 1 && grep -q "(sm_90), kernels from the PTX, compiled by the driver" "$WORK/tiny.cuda.out"; then
      ok "cuda host tiny: a program of MOEC_CUDA_IMAGES=ptx (no CUBIN) loads its PTX on the sm_90 device it was built for"
    else
      bad "cuda host tiny: MOEC_CUDA_IMAGES=ptx" "$(grep '^# device' "$WORK/tiny.cuda.out")"
    fi
  fi
  if run tiny cuda 1 --steps 2 --save ck && run tiny cuda 1 --steps 4 --resume ck &&
     same_losses <(grep -E '^step [34] ' "$WORK/tiny4.out") "$WORK/tiny.cuda.out" "$TOL"; then
    ok "cuda host tiny: saved after step 2 and resumed, steps 3-4 equal the CPU program's 4-step run"
  else
    bad "cuda host tiny: --save / --resume" "$(cat "$WORK/tiny4.out" "$WORK/tiny.cuda.out" | tail -n 20)"
  fi
  if (cd "$WORK" && MOERT_FAKE_ARCH=80 ./tiny.cuda --steps 1 >arch.out 2>&1); then
    bad "cuda host tiny: an sm_90 program ran on an sm_80 device" "$(cat "$WORK/arch.out")"
  elif grep -q "compiled for sm_90 and need a GPU of that architecture or newer" "$WORK/arch.out"; then
    ok "cuda host tiny: an sm_90 program refuses an sm_80 device (exit 1, says why)"
  else
    bad "cuda host tiny: sm_90 program on an sm_80 device" "$(cat "$WORK/arch.out")"
  fi
  if MOEC_CUDA_FAKE=1 "$MOEC" build lang/models/tiny.moe --target cuda --gpu-arch sm_80 -o "$WORK/tiny80.cuda" 2>"$WORK/err" &&
     run tiny80 cuda 1 --steps 3 && grep -q "kernels from the PTX" "$WORK/tiny80.cuda.out" &&
     same_losses <(grep -E '^step [123] ' "$WORK/tiny4.out") "$WORK/tiny80.cuda.out" "$TOL"; then
    ok "cuda host tiny: --gpu-arch sm_80 on an sm_90 device loads the embedded PTX, losses equal"
  else
    bad "cuda host tiny: --gpu-arch sm_80 (PTX)" "$(cat "$WORK/err" "$WORK/tiny80.cuda.out" 2>/dev/null | tail -n 15)"
  fi
fi

# dtype bf16 on the fake device, whose GEMMs take the program's bf16 operands (rounded by
# mk_compress_bf16, nearest even) as cuBLAS does: widened exactly, products exact in fp32,
# accumulated in fp32. Tolerances: a bf16 operand carries a relative rounding error of up to 2^-9
# (2e-3); the loss passes through a few rounded GEMMs (1e-2), a gradient through a few more
# (3e-2 of its tensor's largest element). tiny itself is not used for the gradients: at its first
# step one token's top-2 experts differ between bf16 and fp32 (their scores are closer than the
# rounding), which changes that token's output by a fifth: a different routing, not an error.
bf16_built() { [ "$(cat "$WORK/$1.built" 2>/dev/null)" = 0 ] || { bad "cuda host $1: build" "$(cat "$WORK/$1.build")"; return 1; }; }
if bf16_built tiny_bf16; then
  if run tiny_bf16 cpu 1 --steps 20 && run tiny_bf16 cuda 1 --steps 20 && grep -q 'bf16 GEMM inputs' "$WORK/tiny_bf16.cuda.out"; then
    bf16_losses "cuda host tiny bf16" "$WORK/tiny_bf16.cpu.out" "$WORK/tiny_bf16.cuda.out"
  else
    bad "cuda host tiny bf16: 20 steps (fp32 CPU, then bf16 on the fake device)" \
      "$(tail -n 20 "$WORK/tiny_bf16.cpu.out" "$WORK/tiny_bf16.cuda.out" 2>/dev/null)"
  fi
fi
if bf16_built tinyq_bf16; then
  if run tinyq_bf16 cpu 1 --steps 1 --dump tinyq.cpu.dump && run tinyq_bf16 cuda 1 --steps 1 --dump tinyq.cuda.dump &&
     why=$(compare_dumps "$WORK/tinyq.cpu.dump" "$WORK/tinyq.cuda.dump" 3e-2); then
    ok "cuda host tinyq bf16: --dump output and whole gradients within 3e-2 of the fp32 CPU program's ($why)"
  else
    bad "cuda host tinyq bf16: --dump against the fp32 CPU program's" "${why:-$(tail -n 20 "$WORK/tinyq_bf16.cuda.out")}"
  fi
fi
# The language model in bf16 (attention's projections, the experts and the head as bf16 GEMMs; the
# attention kernels, norms and cross-entropy in fp32): step 1's logits within 3e-2 and its
# gradients within 5e-2 of the fp32 CPU program's (a gradient of the first layer passes through
# every layer's rounded GEMMs twice, and a norm's weight gradient sums them over the tokens with
# cancellation: 2.9e-2 is the largest seen; attn.bk's, exactly zero in theory, is measured
# against its layer's attn.wk), and
# 100 steps of adamw on the synthetic tokens lower the loss below 0.9 x the first step's.
if bf16_built lm_adam_bf16; then
  if run lm_adam_bf16 cpu 1 --steps 1 --dump lm.cpu.dump && run lm_adam_bf16 cuda 1 --steps 1 --dump lm.cuda.dump &&
     why=$(lm_dumps "$WORK/lm.cpu.dump" "$WORK/lm.cuda.dump"); then
    ok "cuda host lm bf16: step 1's logits and loss within 3e-2, every gradient within 5e-2 of the fp32 CPU program's ($why)"
  else
    bad "cuda host lm bf16: step 1 against the fp32 CPU program" "${why:-$(tail -n 20 "$WORK/lm_adam_bf16.cuda.out")}"
  fi
  if run lm_adam_bf16 cuda 1 --steps 100 && grep -q 'bf16 GEMM inputs' "$WORK/lm_adam_bf16.cuda.out" &&
     first=$(awk '$1 == "step" && $2 == 1 {print $4}' "$WORK/lm_adam_bf16.cuda.out") &&
     last=$(awk '$1 == "step" && $2 == 100 {print $4}' "$WORK/lm_adam_bf16.cuda.out") &&
     awk -v f="$first" -v l="$last" 'BEGIN { exit !(f > 0 && l < 0.9 * f) }'; then
    ok "cuda host lm bf16: 100 steps lower the loss ($first -> $last)"
  else
    bad "cuda host lm bf16: 100 steps did not lower the loss below 0.9 x the first" "$(grep -h '^step' "$WORK/lm_adam_bf16.cuda.out" | awk 'NR % 10 == 1')"
  fi
fi

# Attention on tensor cores (dtype bf16, heads a multiple of 16: codegen/cuda/attn.cu's mk_attn_tc_*,
# run on the fake device through their emulated mma.sync): tests/cuda/lm_tc.moe (heads of 32 over
# 72 positions; sinks, a window), every attention op on them (moec build -v says so), and step 1
# within the same bounds of the fp32 CPU program (worst seen 1.6e-2, a gradient of attn.bq; the
# same program on the CUDA cores, MOEC_ATTN_TC=0: 1.3e-2).
if bf16_built lm_tc_bf16; then
  if ! "$MOEC" build "$WORK/lm_tc_bf16.moe" --target cuda --emit c -v -o "$WORK/lm_tc.c" 2>"$WORK/tc.err" ||
     ! grep -q '^# attention: 9 of 9 ops a step on tensor cores' "$WORK/tc.err"; then
    bad "cuda host lm bf16 on tensor cores: moec build -v does not put every attention op on tensor cores" \
      "$(grep '^# attention' "$WORK/tc.err" || tail -n 5 "$WORK/tc.err")"
  elif run lm_tc_bf16 cpu 1 --steps 1 --dump tc.cpu.dump && run lm_tc_bf16 cuda 1 --steps 1 --dump tc.cuda.dump &&
       why=$(lm_dumps "$WORK/tc.cpu.dump" "$WORK/tc.cuda.dump"); then
    ok "cuda host lm bf16 on tensor cores: step 1's logits and loss within 3e-2, every gradient within 5e-2 of the fp32 CPU program's ($why)"
  else
    bad "cuda host lm bf16 on tensor cores: step 1 against the fp32 CPU program" "${why:-$(tail -n 20 "$WORK/lm_tc_bf16.cuda.out")}"
  fi
fi

# moec's grouped GEMM on tensor cores (mk_expert_gemm_tc, its mma.sync and ldmatrix emulated on the
# fake device), which a bf16 program runs where the GPU's cuBLASLt has no grouped GEMM
# (MOERT_CUDA_GROUPED=moec: here, in place of the fake's own GEMM over the counted rows): the device
# line names it; tinyq's 3 steps (the second captured, the third replayed from a graph) give the
# losses of the fake's GEMM, and step 1's --dump is within 1e-3 of the fake GEMM's (the sums' order
# differs; where that moves a value across a bf16 rounding, 2^-9 of it) and within 3e-2 of the fp32
# CPU program's; the language model with heads of 32 (lm_tc) within lm_dumps' bounds of the CPU's.
if bf16_built tinyq_bf16 && bf16_built lm_tc_bf16; then
  if MOERT_CUDA_GROUPED=moec run tinyq_bf16 cuda 1 --steps 3 && cp "$WORK/tinyq_bf16.cuda.out" "$WORK/tq_moec.out" &&
     grep -q '12 expert GEMMs a step over their filled rows (moec.s grouped GEMM on tensor cores' "$WORK/tq_moec.out" &&
     run tinyq_bf16 cuda 1 --steps 3 && same_losses "$WORK/tinyq_bf16.cuda.out" "$WORK/tq_moec.out" 1e-5 &&
     MOERT_CUDA_GROUPED=moec run tinyq_bf16 cuda 1 --steps 1 --dump tq_moec.dump &&
     why=$(compare_dumps "$WORK/tinyq.cuda.dump" "$WORK/tq_moec.dump" 1e-3) &&
     why_cpu=$(compare_dumps "$WORK/tinyq.cpu.dump" "$WORK/tq_moec.dump" 3e-2); then
    ok "cuda host tinyq bf16 on moec's grouped GEMM: 12 expert GEMMs a step on it, 3 steps' losses as the fake GEMM's (1e-5), --dump within 1e-3 of the fake GEMM's ($why) and 3e-2 of the fp32 CPU program's"
  else
    bad "cuda host tinyq bf16 on moec's grouped GEMM (MOERT_CUDA_GROUPED=moec)" \
      "${why:-$(grep -h 'device\|^step\|rror' "$WORK/tq_moec.out" "$WORK/tinyq_bf16.cuda.out" 2>/dev/null | head -n 12)}"
  fi
  # The same GEMM on Hopper's warpgroup MMA (mk_expert_gemm_wg, its wgmma emulated through the
  # descriptors): the program carries it (built for sm_90) and, the fake device being sm_90, runs
  # it once the session's check at the start found it equal to mk_expert_gemm_tc; with
  # MOERT_CUDA_WGMMA=0 the mma.sync kernel runs (the same losses, --dump within 1e-3), with
  # MOERT_CUDA_WG_N=256 the kernel of 128 x 256 tiles (the same losses), and a wgmma
  # kernel one element off at the check (MOERT_FAKE_WG_WRONG=1) is turned down, the device line
  # says why, and the program trains on mma.sync to the same losses.
  if grep -q 'tensor cores, wgmma; not cuBLASLt' "$WORK/tq_moec.out" &&
     MOERT_CUDA_WGMMA=0 MOERT_CUDA_GROUPED=moec run tinyq_bf16 cuda 1 --steps 3 && cp "$WORK/tinyq_bf16.cuda.out" "$WORK/tq_mma.out" &&
     grep -q 'tensor cores, mma.sync, not wgmma: MOERT_CUDA_WGMMA=0;' "$WORK/tq_mma.out" &&
     same_losses "$WORK/tq_mma.out" "$WORK/tq_moec.out" 1e-5 &&
     MOERT_CUDA_WGMMA=0 MOERT_CUDA_GROUPED=moec run tinyq_bf16 cuda 1 --steps 1 --dump tq_mma.dump &&
     why=$(compare_dumps "$WORK/tq_mma.dump" "$WORK/tq_moec.dump" 1e-3) &&
     MOERT_CUDA_WG_N=256 MOERT_CUDA_GROUPED=moec run tinyq_bf16 cuda 1 --steps 3 &&
     grep -q 'tensor cores, wgmma on 128 x 256 tiles; not cuBLASLt' "$WORK/tinyq_bf16.cuda.out" &&
     same_losses "$WORK/tinyq_bf16.cuda.out" "$WORK/tq_moec.out" 1e-5 &&
     MOERT_FAKE_WG_WRONG=1 MOERT_CUDA_GROUPED=moec run tinyq_bf16 cuda 1 --steps 3 &&
     grep -q 'mma.sync, not wgmma: it differed from mk_expert_gemm_tc at the start' "$WORK/tinyq_bf16.cuda.out" &&
     same_losses "$WORK/tinyq_bf16.cuda.out" "$WORK/tq_moec.out" 1e-5; then
    ok "cuda host tinyq bf16 on moec's grouped GEMM on wgmma: used after the check at the start, the mma.sync kernel's losses (1e-5) and --dump ($why), on 128 x 256 tiles too (MOERT_CUDA_WG_N=256); a wgmma kernel one element off is turned down at the start"
  else
    bad "cuda host tinyq bf16 on moec's grouped GEMM on wgmma" \
      "${why:-$(grep -h 'device\|^step\|rror' "$WORK/tq_moec.out" "$WORK/tq_mma.out" "$WORK/tinyq_bf16.cuda.out" 2>/dev/null | head -n 12)}"
  fi
  # What a program embeds: the wgmma kernel's CUBIN for sm_90a beside a bf16 sm_90 program's kernels
  # (moec build -v says so), none with MOEC_WGMMA=0 at build time.
  if MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/tinyq_bf16.moe" --target cuda --emit c -v -o "$WORK/tq_wg.c" 2>"$WORK/wg.err" &&
     MOEC_WGMMA=0 MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/tinyq_bf16.moe" --target cuda --emit c -v -o "$WORK/tq_nowg.c" 2>"$WORK/nowg.err" &&
     grep -q "moec's grouped GEMM on wgmma (mk_expert_gemm_wg) for sm_90a" "$WORK/wg.err" &&
     grep -q '^#define WG_CUBIN wg_cubin' "$WORK/tq_wg.c" && ! grep -q 'mk_expert_gemm_wg' "$WORK/nowg.err" &&
     grep -q '^#define WG_CUBIN NULL' "$WORK/tq_nowg.c"; then
    ok "cuda host tinyq bf16: the program embeds moec's grouped GEMM on wgmma for sm_90a ($(grep -o '[0-9]* bytes, embedded beside' "$WORK/wg.err")), none with MOEC_WGMMA=0"
  else
    bad "cuda host tinyq bf16: the wgmma kernel embedded, or left out with MOEC_WGMMA=0" \
      "$(grep -h 'nvrtc\|rror' "$WORK/wg.err" "$WORK/nowg.err" 2>/dev/null | head -n 8)"
  fi
  if MOERT_CUDA_GROUPED=moec run lm_tc_bf16 cuda 1 --steps 1 --dump tc_moec.dump &&
     grep -q 'expert GEMMs a step over their filled rows (moec.s grouped GEMM' "$WORK/lm_tc_bf16.cuda.out" &&
     why=$(lm_dumps "$WORK/tc.cpu.dump" "$WORK/tc_moec.dump"); then
    ok "cuda host lm bf16 on moec's grouped GEMM (and attention on tensor cores): step 1 within lm_dumps' bounds of the fp32 CPU program's ($why)"
  else
    bad "cuda host lm bf16 on moec's grouped GEMM: step 1 against the fp32 CPU program" "${why:-$(tail -n 20 "$WORK/lm_tc_bf16.cuda.out")}"
  fi
fi

# bf16 operands made once: the parameters' bf16 copy P16 (written by the update's kernel,
# mk_adamw_ranges / mk_sgd_ranges, as it updates them; rounded at the first forward after an upload)
# is what the GEMMs read for a weight. Op by op (--no-fuse) a value rounded for one GEMM is read
# again, not rounded again, by the next GEMM on its stream (the backward's dY @ W^T then X^T @ dY):
# tiny's forward rounds each GEMM's activation (6 casts for 6 GEMMs), its backward 12 casts for 12
# GEMMs (24 without the reuse). Fused, a GEMM operand has a bf16 copy of its own that the fused
# kernel making it writes, or that is rounded once a step: fewer casts still (the backward reads
# the forward's copies of saved activations).
if "$MOEC" build "$WORK/tiny_bf16.moe" --target cuda --emit c -v -o "$WORK/tiny_bf16.c" 2>"$WORK/v.err" &&
   "$MOEC" build "$WORK/tiny_bf16.moe" --target cuda --no-fuse --emit c -v -o "$WORK/tiny_bf16n.c" 2>"$WORK/vn.err" &&
   fwd=$(grep -m1 '^# launches: forward' "$WORK/vn.err") && bwd=$(grep -m1 '^# launches: backward' "$WORK/vn.err") &&
   echo "$fwd" | grep -q '(6 bf16 casts),   6 GEMMs' && echo "$bwd" | grep -q '(12 bf16 casts),  12 GEMMs' &&
   ffwd=$(sed -n 's/^# launches: forward .*(\([0-9]*\) bf16 casts).*/\1/p' "$WORK/v.err") &&
   fbwd=$(sed -n 's/^# launches: backward .*(\([0-9]*\) bf16 casts).*/\1/p' "$WORK/v.err") &&
   [ -n "$ffwd" ] && [ -n "$fbwd" ] && [ "$ffwd" -lt 6 ] && [ "$fbwd" -lt 12 ] &&
   [ "$(grep -c 'rt_cuda_expert_gemm\(_rows\)\?(cu, RT_STREAM_COMPUTE, RT_CUDA_BF16, [^;]*(P16 + ' "$WORK/tiny_bf16.c")" -eq 8 ] &&
   grep -q 'launch_step([0-9]*, RT_STREAM_COMPUTE, mk_\(adamw\|sgd\)_ranges, .*PTR((P16 + 0))});' "$WORK/tiny_bf16.c" &&
   ! grep -q 'p16_fresh = false;   /\* rounded again' "$WORK/tiny_bf16.c" &&
   grep -q 'if (what & RT_DEVICE_PARAMS) p16_fresh = false;' "$WORK/tiny_bf16.c"; then
  ok "cuda host tiny bf16: weights read from P16, which the update writes; op by op a value's bf16 copy reused by the next GEMM ('${fwd#\# launches: }'; backward 12 casts for 12 GEMMs), fused $ffwd and $fbwd casts"
else
  bad "cuda host tiny bf16: P16 and the reused bf16 copies" "$(grep launches "$WORK/v.err" "$WORK/vn.err"; tail -n 5 "$WORK/v.err")"
fi

# The update in one launch (issue 39): the optimizer's kernel over a table of ranges, one per
# parameter tensor with its own lr and weight decay (mk_adamw_ranges, mk_sgd_ranges), for tiny's
# 10 tensors and the language model's 55 (its norms and biases not decayed: 32 runs of equal
# settings before); the golden runs hold the bits.
if "$MOEC" build lang/models/tiny.moe --target cuda --emit c -v -o "$WORK/tiny_upd.c" 2>"$WORK/u.err" &&
   grep -q '^# launches: update      1 kernels' "$WORK/u.err" &&
   [ "$(grep -c 'launch_step([0-9]*, RT_STREAM_COMPUTE, mk_adamw_ranges, .*I32(10)' "$WORK/tiny_upd.c")" -eq 1 ] &&
   "$MOEC" build lang/models/gpt_moe_bytes.moe --target cuda -v --emit c -o "$WORK/gmb_upd.c" 2>"$WORK/g.err" &&
   grep -q '^# launches: update      1 kernels' "$WORK/g.err" &&
   grep -q 'static const RtUpdateRange update_ranges\[55\]' "$WORK/gmb_upd.c" &&
   [ "$(grep -c ', (float)0},$' "$WORK/gmb_upd.c")" -gt 0 ] && [ "$(grep -c ', (float)0.10000000000000001},$' "$WORK/gmb_upd.c")" -gt 0 ]; then
  ok "cuda host: the update is one launch: tiny's 10 tensors, gpt_moe_bytes's 55 (decayed and not, one table of ranges)"
else
  bad "cuda host: the update's launches" "$(grep 'launches: update' "$WORK/u.err" "$WORK/g.err"; tail -n 3 "$WORK/u.err" "$WORK/g.err")"
fi

# --no-fuse (issue 39): the CUDA program op by op (the gate chain unfused, each loss reduced by one
# block, an update launch per tensor) trains as the fused one does, bit for bit on the fake device,
# and the fused program's "unfused" count (moec build -v) is what the --no-fuse build launches
# (the programs: tiny_nofuse.cuda, built above, and the fused one's -v of the update's check).
if [ -x "$WORK/tiny_nofuse.cuda" ] &&
   unf=$(sed -n 's/^# launches: \([0-9]*\) kernels, .* per step (unfused: \([0-9]*\) kernels)$/\1 \2/p' "$WORK/u.err") &&
   nf=$(sed -n 's/^# launches: \([0-9]*\) kernels, .* per step (--no-fuse: each op alone)$/\1/p' "$WORK/nf.err") &&
   [ -n "$nf" ] && [ "${unf#* }" = "$nf" ] && [ "${unf% *}" -lt "$nf" ] &&
   run tiny_nofuse cuda 1 --steps 3 --dump tiny_nofuse.dump && run tiny cuda 1 --steps 3 --dump tiny_fused.dump &&
   same_losses "$WORK/tiny.cuda.out" "$WORK/tiny_nofuse.cuda.out" 0 &&
   why=$(compare_dumps "$WORK/tiny_fused.dump" "$WORK/tiny_nofuse.dump" 0); then
  ok "cuda host: tiny --no-fuse ($nf kernels a step, fused ${unf% *}) trains as the fused program: losses and --dump equal ($why)"
else
  bad "cuda host: --no-fuse" "$(grep 'per step' "$WORK/u.err" "$WORK/nf.err"; tail -n 5 "$WORK/nf.err" "$WORK/tiny_nofuse.cuda.out" 2>/dev/null)"
fi

# The expert GEMMs over their filled rows (issue 65): mk_expert_counts counts each block of slots'
# filled rows on the device and rt_cuda_expert_gemm_rows multiplies those alone (the fake device
# zeroes the rows past the counts, then runs the padded GEMM); the forward's second GEMM, over
# act(h + b1), multiplies the first one's counts plus one and mk_expert_rows_fill copies the last
# row's product into the rest, as the CPU's GEMM copies a repeated row's. Each program trains to the bits of
# its MOEC_EXPERT_ROWS=all build (every slot): tiny (capacity 1.25), mixtral (dropless, SwiGLU: the
# gradient through products), tiny on dp2 x ep2 (a block of slots a source rank, 2 ranks) and
# gpt-oss's experts (grad_lm_oss: act.oss(h1 + b1, h3 + b3), the second GEMM over both first
# GEMMs' counts plus one). One
# row taken off a count (MOERT_FAKE_SHORT_ROWS=1) changes the gradients: a count too small shows.
sed 's/^layer block x 2/parallel { dp 2; ep 2; }\nlayer block x 2/' lang/models/tiny.moe >"$WORK/rows_ep.moe"
rows_check() {   # rows_check NAME MODEL P WANT: WANT the -v line's "R of E" (GEMMs over their rows of the expert GEMMs)
  local name=$1 model=$2 np=$3 want=$4 got why
  if ! MOEC_CUDA_FAKE=1 "$MOEC" build "$model" --target cuda -v -o "$WORK/$name.cuda" 2>"$WORK/$name.rows.err" ||
     ! MOEC_EXPERT_ROWS=all MOEC_CUDA_FAKE=1 "$MOEC" build "$model" --target cuda -v -o "$WORK/${name}_all.cuda" 2>"$WORK/$name.all.err"; then
    bad "cuda host rows $name: build" "$(tail -n 5 "$WORK/$name.rows.err" "$WORK/$name.all.err")"; return
  fi
  got=$(sed -n 's/^# expert GEMMs: \([0-9]* of [0-9]*\) a step over their filled rows only.*/\1/p' "$WORK/$name.rows.err")
  if [ "$got" != "$want" ] || ! grep -q "^# expert GEMMs: 0 of .* (MOEC_EXPERT_ROWS=all: every slot)" "$WORK/$name.all.err"; then
    bad "cuda host rows $name: '$got' expert GEMMs over their filled rows, $want expected" "$(grep -h '^# expert GEMMs' "$WORK/$name.rows.err" "$WORK/$name.all.err")"; return
  fi
  if ! run "$name" cuda "$np" --steps 3 --dump "$name.rows.dump" || ! run "${name}_all" cuda "$np" --steps 3 --dump "$name.all.dump"; then
    bad "cuda host rows $name: a program failed" "$(tail -n 5 "$WORK/$name.cuda.out" "$WORK/${name}_all.cuda.out")"; return
  fi
  if ! same_losses "$WORK/$name.cuda.out" "$WORK/${name}_all.cuda.out" 0 || ! why=$(compare_dumps "$WORK/$name.rows.dump" "$WORK/$name.all.dump" 0); then
    bad "cuda host rows $name: over the filled rows differs from every slot" "$(grep -h '^step' "$WORK/$name.cuda.out" "$WORK/${name}_all.cuda.out"; echo "$why")"; return
  fi
  ok "cuda host rows $name: $got expert GEMMs over their filled rows train to the bits of every slot (3 steps, $why)"
  # (The row the GEMM then leaves may hold what was there, which the fake device makes NaN: a loss
  # of NaN shows it too.)
  if (cd "$WORK" && MOERT_FAKE_SHORT_ROWS=1 timeout "$TIMEOUT" $([ "$np" = 1 ] || echo "$MPIRUN -np $np") "./$name.cuda" --steps 1 --dump "$name.short.dump" >"$name.short.out" 2>&1 </dev/null) &&
     ! compare_dumps "$WORK/$name.rows.dump" "$WORK/$name.short.dump" 0 >/dev/null; then
    ok "cuda host rows $name: a count one row short changes the step's gradients"
  elif grep -q '^step 1 .*loss nan' "$WORK/$name.short.out"; then
    ok "cuda host rows $name: a count one row short makes the step's loss NaN"
  else
    bad "cuda host rows $name: a count one row short went unseen" "$(tail -n 5 "$WORK/$name.short.out")"
  fi
}
rows_check rows_tiny lang/models/tiny.moe 1 "12 of 12"
rows_check rows_mixtral lang/models/mixtral.moe 1 "27 of 27"
rows_check rows_ep "$WORK/rows_ep.moe" 2 "12 of 12"
rows_check rows_oss tests/models/grad_lm_oss.moe 1 "27 of 27"

# The kernels over the expert slots (issue 65, codegen/launch.c's filled rows): a GEMM's counts
# bound its result and what keeps its zero rows zero, so a fused kernel over such a value reads
# the counts and takes the value as zeros past them without loading it, one whose results nothing
# reads past the counts skips those rows, and an expert GEMM whose result nothing reads past them
# is not zeroed there. The fake device writes NaN where a GPU leaves rows unwritten (MK_POISON in
# the kernels; its GEMM over the counted rows on rows past them the program did not zero), so a
# reader of them shows. The dropless layers of bench/gpu_compiled.sh (GPT's experts with biases
# and GELU, Mixtral's SwiGLU) and tiny (capacity 1.25) train to the bits of every slot, also with
# tokens of zeros (the batch's last three and its sixth: routed, their rows past the counts of
# the dispatched tokens, which the order's gathers still read). tiny --no-fuse built with
# MOEC_ROWS_UNREAD=all (a test hook: every such value taken as unread past the counts, though its
# bias kernel reads them) trains into NaN: a wrong decision shows.
. bench/layer_model.sh
layer_model bench/gpu_compiled.sh layer gpt_dropless 1x32x32x2 fp32 >"$WORK/slots_gpt.moe"
layer_model bench/gpu_compiled.sh layer mixtral_dropless 1x32x32x2 fp32 >"$WORK/slots_mixtral.moe"
cp lang/models/tiny.moe "$WORK/slots_tiny.moe"
slots_check() {   # slots_check NAME WANT: WANT the -v line's "G (S), L": kernels reading the counts, skipping, GEMMs not zeroed
  local name=$1 want=$2 got why
  if ! MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/$name.moe" --target cuda -v -o "$WORK/$name.cuda" 2>"$WORK/$name.err" ||
     ! MOEC_EXPERT_ROWS=all MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/$name.moe" --target cuda -o "$WORK/${name}_all.cuda" 2>"$WORK/$name.all.err"; then
    bad "cuda host slots $name: build" "$(tail -n 5 "$WORK/$name.err" "$WORK/$name.all.err")"; return
  fi
  got=$(sed -n "s/^# expert slots: \([0-9]*\) fused kernels a step read the counts (\([0-9]*\) of them skip the rows past them), \([0-9]*\) expert GEMMs' results are not zeroed past them.*/\1 (\2), \3/p" "$WORK/$name.err")
  if [ "$got" != "$want" ]; then
    bad "cuda host slots $name: '$got' kernels over the slots, $want expected" "$(grep -h '^# expert' "$WORK/$name.err")"; return
  fi
  if ! run "$name" cuda 1 --steps 3 --dump "$name.dump" || ! run "${name}_all" cuda 1 --steps 3 --dump "$name.all.dump"; then
    bad "cuda host slots $name: a program failed" "$(tail -n 5 "$WORK/$name.cuda.out" "$WORK/${name}_all.cuda.out")"; return
  fi
  if ! same_losses "$WORK/$name.cuda.out" "$WORK/${name}_all.cuda.out" 0 || ! why=$(compare_dumps "$WORK/$name.dump" "$WORK/$name.all.dump" 0); then
    bad "cuda host slots $name: differs from every slot" "$(grep -h '^step' "$WORK/$name.cuda.out" "$WORK/${name}_all.cuda.out"; echo "$why")"; return
  fi
  "$PY" -c 'import numpy as np, sys
x = np.load(sys.argv[1]); x[:, -3:, :] = 0; x[:, 5, :] = 0; np.save(sys.argv[2], x)' "$WORK/$name.dump/input.npy" "$WORK/$name.zeros.npy" &&
  run "$name" cuda 1 --steps 3 --input "$name.zeros.npy" --dump "$name.z.dump" &&
  run "${name}_all" cuda 1 --steps 3 --input "$name.zeros.npy" --dump "$name.z.all.dump" &&
  same_losses "$WORK/$name.cuda.out" "$WORK/${name}_all.cuda.out" 0 && why=$(compare_dumps "$WORK/$name.z.dump" "$WORK/$name.z.all.dump" 0) ||
    { bad "cuda host slots $name: with tokens of zeros, differs from every slot" "$(grep -h '^step' "$WORK/$name.cuda.out" "$WORK/${name}_all.cuda.out"; echo "${why:-}")"; return; }
  ok "cuda host slots $name: $got (kernels reading the counts (skipping), GEMMs not zeroed) train to the bits of every slot, tokens of zeros too (3 steps, $why)"
}
slots_check slots_gpt "4 (4), 4"
slots_check slots_mixtral "3 (3), 6"
slots_check slots_tiny "8 (8), 8"
# The counts from the routing (mk_expert_counts_route: the order's idx and loc, no scan of the
# data): the backward's counts are the forward's, so the forward's saved h + b1 and act, its second
# GEMM's result and bias, and the gradient of the dispatched tokens are written only below them.
# MOEC_EXPERT_ROWS=scan (every count from the data) keeps them over every slot, and trains to the
# same bits.
slots_twin() {   # slots_twin NAME: $WORK/NAME.cuda, a build of slots_gpt, on the batch with tokens of zeros
  run "$1" cuda 1 --steps 3 --input slots_gpt.zeros.npy --dump "$1.dump" &&   # against every slot's build
    same_losses "$WORK/$1.cuda.out" "$WORK/slots_gpt_all.cuda.out" 0 && compare_dumps "$WORK/$1.dump" "$WORK/slots_gpt.z.all.dump" 0
}
MOEC_EXPERT_ROWS=scan MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/slots_gpt.moe" --target cuda -v -o "$WORK/slots_scan.cuda" 2>"$WORK/slots_scan.err"
if grep -q "^# expert slots: 3 fused kernels a step read the counts (2 of them skip the rows past them), 2 expert GEMMs' results" "$WORK/slots_scan.err" &&
   why=$(slots_twin slots_scan); then
  ok "cuda host slots: the dropless GPT layer's counts from the routing (4 kernels skipping, 4 GEMMs not zeroed) against from the data (MOEC_EXPERT_ROWS=scan: 2 and 2), tokens of zeros: the same bits ($why)"
else
  bad "cuda host slots: counts from the routing against from the data" "$(grep -h '^# expert' "$WORK/slots_scan.err" "$WORK/slots_gpt.err"; tail -n 3 "$WORK/slots_scan.cuda.out")"
fi
# The orders' slot maps (CG_LOWER_MAP): order.encode and order.decode.grad_y find the choice that
# fills each slot row in a map their launch writes first (mk_slot_map), not by a pass over every
# choice for each 16 rows. Built with MOEC_SLOT_MAP=0 (that pass, and no order skipping rows past
# the counts: the map is what tells a block so), the dropless GPT layer trains to the same bits,
# tokens of zeros too; -v says what each finds its choices in.
MOEC_SLOT_MAP=0 MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/slots_gpt.moe" --target cuda -v -o "$WORK/slots_nomap.cuda" 2>"$WORK/slots_nomap.err"
maps=$(sed -n 's/^# slot maps: 2 kernels a step (mk_slot_map) let 2 orders over slot rows find their choices in about \([0-9.e+-]*\) MB of reads and writes, not the \([0-9.e+-]*\) MB of a pass .*/\1 \2/p' "$WORK/slots_gpt.err")
if [ -n "$maps" ] && awk -v a="${maps% *}" -v b="${maps#* }" 'BEGIN { exit !(a < b) }' &&
   grep -q "^# slot maps: none (MOEC_SLOT_MAP=0): 2 orders over slot rows read ${maps#* } MB of the routing" "$WORK/slots_nomap.err" &&
   grep -q "0 of the orders' kernels write none past the counts" "$WORK/slots_nomap.err" && why=$(slots_twin slots_nomap); then
  ok "cuda host slots: the dropless GPT layer's orders from their slot maps (${maps% *} MB) against a pass over every choice (MOEC_SLOT_MAP=0: ${maps#* } MB), tokens of zeros: the same bits ($why)"
else
  bad "cuda host slots: the orders' slot maps against a pass over every choice" "$(grep -h '^# \(slot\|expert\)' "$WORK/slots_nomap.err" "$WORK/slots_gpt.err"; tail -n 3 "$WORK/slots_nomap.cuda.out")"
fi
if MOEC_ROWS_UNREAD=all MOEC_CUDA_FAKE=1 "$MOEC" build lang/models/tiny.moe --target cuda --no-fuse -o "$WORK/slots_unread.cuda" 2>"$WORK/slots_unread.err" &&
   ! run slots_unread cuda 1 --steps 3 && grep -q '^step 2 .*loss nan' "$WORK/slots_unread.cuda.out"; then
  ok "cuda host slots: MOEC_ROWS_UNREAD=all (the rows a bias kernel reads taken as unread) trains into NaN on the fake device"
else
  bad "cuda host slots: a wrong 'unread' went unseen" "$(tail -n 5 "$WORK/slots_unread.err" "$WORK/slots_unread.cuda.out" 2>/dev/null)"
fi

# The fuse pass (issue 39): gpt_moe_bytes's elementwise chains (a norm's scale and bias, the q, k
# and v biases, bias + residual, expert bias + GELU, the gradient sums) run as generated kernels
# (codegen/fused.c; on the fake device compiled into the program as host C++); the program trains
# to the bits of its --no-fuse build (losses and every --dump tensor), launches fewer kernels and
# moves fewer bytes than op by op (its "unfused" numbers are the --no-fuse build's), launches at
# most 91 kernels a step besides the ones that count expert GEMMs' filled rows and write the
# orders' slot maps (issue 39: 40 % of the 228 its op-by-op program launched when the issue was
# filed, before either existed), and its kernel unit has the generated kernels.
if MOEC_CUDA_FAKE=1 "$MOEC" build lang/models/gpt_moe_bytes.moe --target cuda -v -o "$WORK/gmbf.cuda" 2>"$WORK/gf.err" &&
   MOEC_CUDA_FAKE=1 "$MOEC" build lang/models/gpt_moe_bytes.moe --target cuda --no-fuse -v -o "$WORK/gmbn.cuda" 2>"$WORK/gn.err" &&
   "$MOEC" build lang/models/gpt_moe_bytes.moe --target cuda --emit cuda -o "$WORK/gmbf.cu" 2>/dev/null &&
   grep -q '^MK_FUSED void mk_fuse_0(' "$WORK/gmbf.cu" && ! ls "$WORK"/*.fused.* >/dev/null 2>&1 &&
   fk=$(sed -n 's/^# launches: \([0-9]*\) kernels, .* per step (unfused: \([0-9]*\) kernels)$/\1 \2/p' "$WORK/gf.err") &&
   nk=$(sed -n 's/^# launches: \([0-9]*\) kernels, .* per step (--no-fuse: each op alone)$/\1/p' "$WORK/gn.err") &&
   mb=$(sed -n 's/^# kernel traffic: \([0-9.]*\) MB per step (unfused: \([0-9.]*\) MB)$/\1 \2/p' "$WORK/gf.err") &&
   groups=$(sed -n 's/^# fuse: \([0-9]*\) ops in \([0-9]*\) fused kernels.*/\2/p' "$WORK/gf.err") &&
   counts=$(sed -n 's/^# expert GEMMs: .*, which \([0-9]*\) of the kernels count (or set the rows past the counts)$/\1/p' "$WORK/gf.err") &&
   maps=$(sed -n 's/^# slot maps: \([0-9]*\) kernels a step (mk_slot_map).*/\1/p' "$WORK/gf.err") &&
   [ -n "$nk" ] && [ -n "$counts" ] && [ -n "$maps" ] && [ "${fk#* }" = "$nk" ] && [ "${fk% *}" -lt "$nk" ] &&
   [ $((${fk% *} - counts - maps)) -le 91 ] &&
   [ -n "$groups" ] && [ "$groups" -gt 10 ] &&
   awk -v a="${mb% *}" -v b="${mb#* }" 'BEGIN { exit !(a < b) }' &&
   grep -q "^# launches: a step .* kernels move ${mb#* } MB" "$WORK/gn.err" &&
   run gmbf cuda 1 --steps 2 --dump gmbf.dump && run gmbn cuda 1 --steps 2 --dump gmbn.dump &&
   same_losses "$WORK/gmbf.cuda.out" "$WORK/gmbn.cuda.out" 0 &&
   why=$(compare_dumps "$WORK/gmbf.dump" "$WORK/gmbn.dump" 0); then
  ok "cuda host: gpt_moe_bytes fused ($groups groups: ${fk% *} kernels a step, $counts of them counting rows, $maps slot maps, ${mb% *} MB) trains as --no-fuse ($nk kernels, ${mb#* } MB): losses and --dump equal ($why)"
else
  bad "cuda host: gpt_moe_bytes fused against --no-fuse" "$(grep -E 'per step|traffic|fuse' "$WORK/gf.err" "$WORK/gn.err"; tail -n 5 "$WORK/gf.err" "$WORK/gmbf.cuda.out" "$WORK/gmbn.cuda.out" 2>/dev/null)"
fi

# dtype bf16 (issue 39): every GEMM operand has a bf16 copy of its own, written by the fused kernel
# that makes the value (or rounded once a step before its first GEMM), instead of a cast per GEMM:
# gpt_moe_bytes in bf16 launches at most 10 % more kernels than in fp32, and its "unfused" count
# and traffic are what its --no-fuse build launches and moves. With its saved activations in fp32
# (MOEC_BF16_SAVED=0) it trains to the bits of that build; values only GEMMs read are stored in
# bf16 only either way, which changes no bit.
sed 's/dtype fp32;/dtype bf16;/' lang/models/gpt_moe_bytes.moe >"$WORK/gmb16.moe"
if grep -q 'dtype bf16;' "$WORK/gmb16.moe" &&
   MOEC_BF16_SAVED=0 MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/gmb16.moe" --target cuda -v -o "$WORK/gmb16f.cuda" 2>"$WORK/bf.err" &&
   grep -q '^# fuse: dtype bf16: [0-9]* GEMM operands and 0 more saved activations with a bf16 copy beside them, [1-9][0-9]* values stored in bf16 only' "$WORK/bf.err" &&
   MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/gmb16.moe" --target cuda --no-fuse -v -o "$WORK/gmb16n.cuda" 2>"$WORK/bn.err" &&
   bk=$(sed -n 's/^# launches: \([0-9]*\) kernels, .* per step (unfused: \([0-9]*\) kernels)$/\1 \2/p' "$WORK/bf.err") &&
   bn=$(sed -n 's/^# launches: \([0-9]*\) kernels, .* per step (--no-fuse: each op alone)$/\1/p' "$WORK/bn.err") &&
   f32=$(sed -n 's/^# launches: \([0-9]*\) kernels, .* per step (unfused: .*/\1/p' "$WORK/gf.err") &&
   [ -n "$bn" ] && [ -n "$f32" ] && [ "${bk#* }" = "$bn" ] && [ $((100 * ${bk% *})) -le $((110 * f32)) ] &&
   bmb=$(sed -n 's/^# kernel traffic: [0-9.]* MB per step (unfused: \([0-9.]*\) MB)$/\1/p' "$WORK/bf.err") &&
   [ -n "$bmb" ] && grep -q "^# launches: a step .* kernels move $bmb MB" "$WORK/bn.err" &&
   run gmb16f cuda 1 --steps 2 --dump gmb16f.dump && run gmb16n cuda 1 --steps 2 --dump gmb16n.dump &&
   same_losses "$WORK/gmb16f.cuda.out" "$WORK/gmb16n.cuda.out" 0 &&
   why=$(compare_dumps "$WORK/gmb16f.dump" "$WORK/gmb16n.dump" 0); then
  ok "cuda host: gpt_moe_bytes bf16 fused: ${bk% *} kernels a step against $f32 in fp32 (at most +10 %), $bn op by op; trains as --no-fuse ($why)"
else
  bad "cuda host: gpt_moe_bytes bf16 fused" "$(grep -E 'per step|copy|casts' "$WORK/bf.err" "$WORK/bn.err" "$WORK/gf.err"; tail -n 5 "$WORK/bf.err" "$WORK/gmb16f.cuda.out" 2>/dev/null)"
fi

# An activation's row (ir/activations.def) and its kernel twins agree: squared ReLU (act relu2) in a
# language model's gpt experts and its dense mlp trains to the same bits on the CPU and the fake
# device, each fused (expert.bias + act.relu2 from the row's expression) and op by op (rt_relu2,
# mk_relu2 and their gradients); in bf16 with fp32 saved activations the gradient's expression runs
# fused too (act.relu2.grad writing its bf16 copy) and equals the --no-fuse build.
relu2_run() {  # NAME MODEL [MOEC-BUILD-ARGS...]: WORK/NAME, 3 steps with --dump NAME.dump
  local name=$1 model=$2
  shift 2
  "$MOEC" build "$model" -o "$WORK/$name" "$@" 2>"$WORK/$name.err" && rm -rf "$WORK/$name.dump" &&
    (cd "$WORK" && timeout "$TIMEOUT" "./$name" --steps 3 --dump "$name.dump" >"$name.out" 2>&1 </dev/null)
}
sed 's/^model grad_lm_relu2 { /model grad_lm_relu2 { dtype bf16; /' tests/models/grad_lm_relu2.moe >"$WORK/relu2_16.moe"
r2=tests/models/grad_lm_relu2.moe
if relu2_run r2cpu "$r2" && relu2_run r2cpun "$r2" --no-fuse &&
   MOEC_CUDA_FAKE=1 relu2_run r2cuda "$r2" --target cuda && MOEC_CUDA_FAKE=1 relu2_run r2cudan "$r2" --target cuda --no-fuse &&
   "$MOEC" build "$r2" --target cuda --emit cuda -o "$WORK/r2.cu" 2>/dev/null && grep -q '^// ---- mk_fuse_[0-9]*: .*act\.relu2 ----$' "$WORK/r2.cu" &&
   same_losses "$WORK/r2cpu.out" "$WORK/r2cpun.out" 0 && same_losses "$WORK/r2cpu.out" "$WORK/r2cuda.out" 0 &&
   same_losses "$WORK/r2cpu.out" "$WORK/r2cudan.out" 0 && w1=$(compare_dumps "$WORK/r2cpu.dump" "$WORK/r2cpun.dump" 0) &&
   w2=$(compare_dumps "$WORK/r2cpu.dump" "$WORK/r2cuda.dump" 0) && w3=$(compare_dumps "$WORK/r2cpu.dump" "$WORK/r2cudan.dump" 0) &&
   MOEC_BF16_SAVED=0 MOEC_CUDA_FAKE=1 relu2_run r2f16 "$WORK/relu2_16.moe" --target cuda &&
   MOEC_CUDA_FAKE=1 relu2_run r2n16 "$WORK/relu2_16.moe" --target cuda --no-fuse &&
   MOEC_BF16_SAVED=0 "$MOEC" build "$WORK/relu2_16.moe" --target cuda --emit cuda -o "$WORK/r2_16.cu" 2>/dev/null &&
   grep -q '^// ---- mk_fuse_[0-9]*: act\.relu2\.grad ----$' "$WORK/r2_16.cu" &&
   same_losses "$WORK/r2f16.out" "$WORK/r2n16.out" 0 && w4=$(compare_dumps "$WORK/r2f16.dump" "$WORK/r2n16.dump" 0); then
  ok "cuda host: act relu2 (grad_lm_relu2) bit for bit: CPU fused = CPU --no-fuse = fake device fused ($w2) = --no-fuse; bf16 with the gradient fused = --no-fuse ($w4)"
else
  bad "cuda host: act relu2 (grad_lm_relu2)" "$(tail -n 3 "$WORK"/r2*.err "$WORK"/r2*.out 2>/dev/null | head -c 3000)"
fi

# Saved activations in bf16 (issue 39, the default): the backward's elementwise kernels read the
# forward values they need (the experts' pre-activation for GELU's gradient) from bf16 copies the
# forward's kernels write, so those fp32 values die with the forward. The memory plan counts it:
# the bf16 program's peak (with the parameters' bf16 copy) is below the fp32 program's, and below
# the one with saved activations in fp32; the kernels read the copies (a u16 pointer, widened); the
# losses stay within 1e-3 of the fp32-saved program's over 2 steps.
peak() { sed -n 's/^# memplan: peak .* per rank (\([0-9]*\) bytes)$/\1/p' "$1" | tail -n 1; }
if MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/gmb16.moe" --target cuda -v -o "$WORK/gmb16s.cuda" 2>"$WORK/bs.err" &&
   "$MOEC" build "$WORK/gmb16.moe" --target cuda --emit cuda -o "$WORK/gmb16s.cu" 2>/dev/null &&
   grep -q '^# fuse: dtype bf16: [0-9]* GEMM operands and [1-9][0-9]* more saved activations' "$WORK/bs.err" &&
   grep -q '^MK_FUSED void mk_fuse_[0-9]*(.*const u16 \*a[0-9]' "$WORK/gmb16s.cu" && grep -q 'mk_float_from_bf16(a[0-9]' "$WORK/gmb16s.cu" &&
   ps=$(peak "$WORK/bs.err") && p0=$(peak "$WORK/bf.err") && p32=$(peak "$WORK/gf.err") &&
   [ -n "$ps" ] && [ -n "$p0" ] && [ -n "$p32" ] && [ "$ps" -lt "$p0" ] && [ "$ps" -lt "$p32" ] &&
   run gmb16s cuda 1 --steps 2 && grep -q 'bf16 GEMM inputs' "$WORK/gmb16s.cuda.out" &&
   block=$(sed -n 's/^# device: .*, \([0-9.]*\) MiB of device memory in one block.*/\1/p' "$WORK/gmb16s.cuda.out") &&
   plan=$(sed -n 's/.*(the memory plan: \([0-9.]*\) MiB per rank)$/\1/p' "$WORK/gmb16s.cuda.out") &&
   [ -n "$block" ] && [ -n "$plan" ] && awk -v b="$block" -v p="$plan" 'BEGIN { exit !(b >= p && b <= 1.1 * p) }' &&
   awk 'FNR == NR && $1 == "step" { l[$2] = $4; next } $1 == "step" { d = $4 - l[$2]; if (d < 0) d = -d; if (d > 1e-3) bad = 1; n++ }
        END { exit !(n == 2 && !bad) }' "$WORK/gmb16f.cuda.out" "$WORK/gmb16s.cuda.out"; then
  ok "cuda host: gpt_moe_bytes bf16 with saved activations in bf16: peak $ps bytes (saved in fp32 $p0, the fp32 program $p32); the device block $block MiB for the plan's $plan MiB; losses within 1e-3 of the fp32-saved program's"
else
  bad "cuda host: gpt_moe_bytes bf16 with saved activations in bf16" "$(grep -E 'fuse|peak' "$WORK/bs.err" "$WORK/bf.err" "$WORK/gf.err"; grep -h '^step' "$WORK/gmb16f.cuda.out" "$WORK/gmb16s.cuda.out" 2>/dev/null; tail -n 5 "$WORK/bs.err")"
fi

# bf16 storage in functions on several streams: the language model on dp2·mp2·ep4 over 4 ranks
# with the fsmoe schedule (expert regions in 2 chunks on the compute, intra and inter streams), in
# bf16 with its saved activations and GEMM-only values in bf16, trains within 1e-3 of the fp32 CPU
# program's losses over 3 steps (memplan keeps a value's fp32 buffer and its copy alive for every
# op of such a function that may overlap a user of either).
sed 's/^layer block x 2/parallel { dp 2; mp 2; ep 4; }\nschedule { policy fsmoe; pipeline { forward 2; backward 2; } }\nlayer block x 2/' \
  tests/models/grad_lm_gpt.moe >"$WORK/lm_fs.moe"
sed 's/^model grad_lm_gpt { /model grad_lm_gpt { dtype bf16; /' "$WORK/lm_fs.moe" >"$WORK/lm_fs16.moe"
if grep -q 'policy fsmoe' "$WORK/lm_fs16.moe" && grep -q 'dtype bf16' "$WORK/lm_fs16.moe" &&
   MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/lm_fs16.moe" --target cuda -v -o "$WORK/lm_fs16.cuda" 2>"$WORK/fs16.err" &&
   "$MOEC" build "$WORK/lm_fs.moe" -o "$WORK/lm_fs16.cpu" 2>/dev/null &&
   grep -q '^# fuse: dtype bf16: [0-9]* GEMM operands and [1-9][0-9]* more saved activations.*, [1-9][0-9]* values stored in bf16 only' "$WORK/fs16.err" &&
   grep -q 'functions run concurrent streams' "$WORK/fs16.err" &&
   run lm_fs16 cuda 4 --steps 3 && run lm_fs16 cpu 4 --steps 3 &&
   awk 'FNR == NR && $1 == "step" { l[$2] = $4; next } $1 == "step" { d = $4 - l[$2]; if (d < 0) d = -d; if (d > 1e-3) bad = 1; n++ }
        END { exit !(n == 3 && !bad) }' "$WORK/lm_fs16.cpu.out" "$WORK/lm_fs16.cuda.out"; then
  ok "cuda host: the language model on dp2·mp2·ep4 with fsmoe streams in bf16 (bf16 storage) trains within 1e-3 of the fp32 CPU program ($(awk '$1 == "step" {printf "%s ", $4}' "$WORK/lm_fs16.cuda.out"))"
else
  bad "cuda host: the language model on dp2·mp2·ep4 with fsmoe streams in bf16" "$(grep -E 'fuse|streams' "$WORK/fs16.err"; grep -h '^step' "$WORK/lm_fs16.cpu.out" "$WORK/lm_fs16.cuda.out" 2>/dev/null; tail -n 5 "$WORK/lm_fs16.cuda.out" 2>/dev/null)"
fi

# bench/gpu_lm.sh, which a GPU session runs (a language model's step beside PyTorch's): its --quick
# model in fp32, bf16 (attention on tensor cores: heads of 16) and bf16_cc (on the CUDA cores) on
# the fake device, with CUDA graphs and op by op (the times say nothing; the script's path is checked).
if MOEC_CUDA_FAKE=1 LM_DIR=$WORK/lm bash bench/gpu_lm.sh --build --quick >"$WORK/lmb.out" 2>&1 &&
   MOEC_CUDA_FAKE=1 LM_DIR=$WORK/lm TORCH_PYTHON=false bash bench/gpu_lm.sh --quick --steps 3 >"$WORK/lmr.out" 2>&1 &&
   [ "$(grep -cE '^(fp32|bf16|bf16_cc) +[0-9.]+ +[0-9.]+ +- +-$' "$WORK/lmr.out")" -eq 3 ] && [ "$(tail -n 1 "$WORK/lmr.out")" = OK ] &&
   [ "$(grep -c '^# moec bf16 launches: ' "$WORK/lmr.out")" -eq 5 ] && grep -q '^# moec bf16 launches: [0-9]* kernels, [0-9]* GEMMs per step (unfused: ' "$WORK/lmr.out" &&
   grep -q '^# moec bf16 attention: 6 of 6 ops a step on tensor cores' "$WORK/lmr.out" &&
   grep -q '^# moec bf16_cc attention: 0 of 6 ops a step on tensor cores .* (MOEC_ATTN_TC=0)' "$WORK/lmr.out"; then
  ok "bench/gpu_lm.sh --quick on the fake device: fp32, bf16 (attention on tensor cores) and bf16_cc steps with the compiler's launch counts"
else
  bad "bench/gpu_lm.sh --quick on the fake device" "$(cat "$WORK/lmb.out" "$WORK/lmr.out" 2>/dev/null | tail -n 20)"
fi

# bench/gpu_compiled.sh, make bench-gpu's compiled layer: its --quick layer and its dropless twin
# (capacity *, with the line that sets its time against the capacity layer's) built in fp32 and bf16
# and trained on the fake device with --profile, whose device lines (the median forward and
# backward, the update: each step function ends waiting for the GPU) it reads; the forward and
# backward with the update make the whole step less the data's upload, within 10 % or 1 ms (each
# a median of steps 2..8 taken apart: a loaded host moves the sum of medians from the median sum).
# That last relation is of times: on a host loaded by other jobs it is measured a second time
# before it counts as failed (the rows, their numbers and OK must hold on the first).
compiled_runs() {
  MOEC_CUDA_FAKE=1 COMPILED_DIR=$WORK/layers bash bench/gpu_compiled.sh --quick --steps 8 >"$WORK/clr.out" 2>&1 &&
    MOEC_CUDA_FAKE=1 COMPILED_DIR=$WORK/layers bash bench/gpu_compiled.sh --quick --steps 8 --dtype bf16 >>"$WORK/clr.out" 2>&1 &&
    [ "$(grep -cE '^gpt +1x32x32x2 +(fp32|bf16)( +[0-9.]+){3} +[0-9]+ +[0-9]+ +[0-9.]+$' "$WORK/clr.out")" -eq 2 ] &&
    [ "$(grep -cE '^gpt_dropless +1x32x32x2 +(fp32|bf16)( +[0-9.]+){3} +[0-9]+ +[0-9]+ +[0-9.]+$' "$WORK/clr.out")" -eq 2 ] &&
    [ "$(grep -cE '^# gpt_dropless 1x32x32x2 (fp32|bf16): forward and backward [0-9.]+ ms, [0-9.]+x the capacity layer' "$WORK/clr.out")" -eq 2 ] &&
    grep -qE '^# gpt 1x32x32x2 bf16: forward and backward [0-9.]+ ms with the expert GEMMs padded \(MOERT_CUDA_GROUPED=0\), [0-9.]+ over the filled rows \(the fake device.s GEMM over the counted rows\): [0-9.]+x$' "$WORK/clr.out" &&
    grep -qE '^# gpt_dropless 1x32x32x2 bf16: forward and backward [0-9.]+ ms with the kernels over every slot \(MOEC_EXPERT_ROWS=gemm\), [0-9.]+ over the filled rows: [0-9.]+x$' "$WORK/clr.out" &&
    [ "$(grep -c '^OK$' "$WORK/clr.out")" -eq 2 ]
}
parts_make_step() { awk '$1 == "gpt" { d = $6 - $4 - $5; if (d < -1 - 0.1 * $6 || d > 1 + 0.1 * $6) bad = 1 } END { exit bad }' "$WORK/clr.out"; }
if MOEC_CUDA_FAKE=1 COMPILED_DIR=$WORK/layers bash bench/gpu_compiled.sh --build --quick >"$WORK/clb.out" 2>&1 &&
   compiled_runs && { parts_make_step || { compiled_runs && parts_make_step; }; }; then
  ok "bench/gpu_compiled.sh --quick on the fake device: the compiled layer and its dropless twin, forward and backward, update and step (--profile's device lines), fp32 and bf16, with the compiler's counts; bf16 with its expert GEMMs padded, the dropless layer with its kernels over every slot"
else
  bad "bench/gpu_compiled.sh --quick on the fake device" "$(cat "$WORK/clb.out" "$WORK/clr.out" 2>/dev/null | tail -n 20)"
fi

# The build cache (codegen/cache.c): a second build of a model takes NVRTC's images from it and
# writes the same program; MOEC_CACHE=off compiles again.
if MOEC_CUDA_IMAGES=both MOEC_CACHE=$WORK/cache "$MOEC" build lang/models/tiny.moe --target cuda --emit c -v -o "$WORK/bc1.c" 2>"$WORK/bc1.err" &&
   MOEC_CUDA_IMAGES=both MOEC_CACHE=$WORK/cache "$MOEC" build lang/models/tiny.moe --target cuda --emit c -v -o "$WORK/bc2.c" 2>"$WORK/bc2.err" &&
   MOEC_CUDA_IMAGES=both MOEC_CACHE=off "$MOEC" build lang/models/tiny.moe --target cuda --emit c -v -o "$WORK/bc3.c" 2>"$WORK/bc3.err" &&
   ! grep -q 'from the build cache' "$WORK/bc1.err" && grep -q '^# nvrtc: .*(from the build cache)' "$WORK/bc2.err" &&
   ! grep -q 'from the build cache' "$WORK/bc3.err" && cmp -s "$WORK/bc1.c" "$WORK/bc2.c" && cmp -s "$WORK/bc1.c" "$WORK/bc3.c" &&
   [ "$(ls "$WORK/cache" | wc -l)" -eq 2 ] &&
   MOEC_CUDA_IMAGES=ptx MOEC_CACHE=$WORK/cache "$MOEC" build lang/models/tiny.moe --target cuda --emit c -v -o "$WORK/bc4.c" 2>"$WORK/bc4.err" &&
   grep -q '^# nvrtc: PTX of sm_90 .*(from the build cache)' "$WORK/bc4.err" && [ "$(ls "$WORK/cache" | wc -l)" -eq 2 ] &&
   grep -q '^#define CUBIN NULL' "$WORK/bc4.c"; then
  ok "cuda host: the build cache gives NVRTC's images to a second build (the same program; MOEC_CACHE=off compiles), and their PTX to a build of MOEC_CUDA_IMAGES=ptx"
else
  bad "cuda host: the build cache" "$(grep -h nvrtc "$WORK"/bc*.err; ls "$WORK/cache" 2>&1)"
fi

# The real runtime: the acceptance line "the CUDA binary links".
CUDA_LIB=$BUILD/libmoert_cuda.a
if [ ! -f "$CUDA_LIB" ]; then
  skip "cuda host link" "no $CUDA_LIB (make builds it where cuBLAS and NCCL are)"
elif ! "$MOEC" build lang/models/tiny.moe --target cuda -o "$WORK/tiny.gpu" 2>"$WORK/err"; then
  bad "cuda host: tiny.moe --target cuda links with libmoert_cuda, cuBLAS and NCCL" "$(cat "$WORK/err")"
else
  libs=$(ldd "$WORK/tiny.gpu" | grep -oE 'lib(cublas|nccl)[^ ]*' | sort -u | tr '\n' ' ')
  ok "cuda host: tiny.moe --target cuda links with libmoert_cuda ($libs)"
  (cd "$WORK" && ./tiny.gpu --steps 1 >gpu.out 2>&1 </dev/null)
  status=$?
  if grep -q '^step 1 ' "$WORK/gpu.out"; then
    skip "cuda host: the CUDA binary without a GPU" "a GPU is present (tests/cuda/gpu.sh runs the CUDA binaries)"
  elif [ $status -eq 1 ] && grep -q "moert: error: no GPU: " "$WORK/gpu.out"; then
    ok "cuda host: without a GPU the CUDA binary says so and exits 1 ($(grep -o 'no GPU: [^.]*' "$WORK/gpu.out" | head -c 80))"
  else
    bad "cuda host: the CUDA binary without a GPU: exit status $status" "$(cat "$WORK/gpu.out")"
  fi
fi

# --target auto says what it picked and why.
if "$MOEC" build lang/models/tiny.moe --target auto -o "$WORK/tiny.auto" 2>"$WORK/err" && grep -q '^# target: auto -> ' "$WORK/err"; then
  ok "cuda host: --target auto says '$(grep '^# target: auto' "$WORK/err" | head -c 100)'"
else
  bad "cuda host: --target auto" "$(cat "$WORK/err")"
fi
exit $failed
