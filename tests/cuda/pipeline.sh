#!/usr/bin/env bash
# The CUDA target with microbatches and pipeline stages (lang/manual.md §6.1, docs/gpu.md) on the
# fake device (MOEC_CUDA_FAKE=1, tests/cuda/fake_cuda.cpp), each program against the CPU program of
# the same model: the losses of 3 steps and the step-1 --dump (the loss and every whole gradient,
# the mean over the microbatches) to the bit (tolerance 0). 3 steps run every step function of
# every slot and part of the gradients' sum op by op (step 1), capture it (step 2) and replay it
# (step 3: the forward of a slot used twice a step already at step 2):
#   - gradient accumulation on the device: the MoE stack (tests/models/grad_k2.moe, batch 6) with
#     microbatches 3 on one rank (the sum's first, middle and last parts, the mean's 1/3);
#   - pipeline stages: the GPT-style language model (tests/models/grad_lm_gpt.moe) on pp 2 with 4
#     microbatches (1f1b: two slots on stage 0; the tied embedding's gradient summed over the
#     first and last stage), on pp 2 x dp 2 x ep 2 (gpipe; the last microbatch adds the sum to the
#     gradients as its AllReduces reduce them) and on pp 2 x mp 2 x esp 2 (4 ranks each); pp 2's
#     --sample draws the CPU program's tokens.
# (tests/cuda/pipeline_models.sh writes the models.) Without the build cache (MOEC_CACHE) the
# builds take ~1 minute of the ~2 here.
# What the fake device cannot show (the GPU's arithmetic and streams) tests/cuda/gpu.sh checks on a
# GPU with the same models (make gpu-models builds them). Without the CUDA toolkit: one skip line.
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
  skip "cuda pipeline" "no CUDA toolkit (nothing at $CUDA/include/nvrtc.h)"
  exit 0
fi
if [ ! -f "$BUILD/cuda/libfake_cuda.a" ]; then
  bad "cuda pipeline: $BUILD/cuda/libfake_cuda.a is missing (make builds it where the CUDA toolkit is)"
  exit 1
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-cuda-pipeline.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=1
TIMEOUT=120

# The models (tests/cuda/gpu.sh builds those one GPU runs).
. tests/cuda/pipeline_models.sh
pipeline_models "$WORK"

# Both programs of every model, two builds at a time (NVRTC takes most of a CUDA build; the build
# cache, MOEC_CACHE, keeps its images between runs).
for name in $PIPELINE_MODELS; do
  [ "$(jobs -rp | wc -l)" -ge 2 ] && wait -n
  ( { "$MOEC" build "$WORK/$name.moe" -o "$WORK/$name.cpu" &&
      MOEC_CUDA_FAKE=1 "$MOEC" build "$WORK/$name.moe" --target cuda -o "$WORK/$name.cuda"; } >"$WORK/$name.build" 2>&1
    echo $? >"$WORK/$name.built" ) &
done
wait

# run NAME KIND ARGS...: WORK/NAME.KIND on the model's ranks, output in WORK/NAME.KIND.out.
run() {
  local name=$1 kind=$2 np
  shift 2
  np=$(pipeline_ranks "$name")
  (cd "$WORK" && timeout "$TIMEOUT" $MPIRUN -np "$np" "./$name.$kind" "$@" >"$name.$kind.out" 2>&1 </dev/null)
}

# compare NAME: both programs 3 steps with --dump of the first; the losses and every tensor to the bit.
compare() {
  local name=$1 label why
  label="cuda pipeline $name ($(pipeline_layout "$name"), $(pipeline_ranks "$name") rank(s))"
  if [ "$(cat "$WORK/$name.built" 2>/dev/null)" != 0 ]; then bad "$label: build" "$(tail -n 20 "$WORK/$name.build")"; return; fi
  for kind in cpu cuda; do
    if ! run "$name" "$kind" --steps 3 --dump "$name.$kind.dump"; then
      bad "$label: the $kind program failed" "$(grep -v '^\s*$' "$WORK/$name.$kind.out" | tail -n 20)"; return
    fi
  done
  if [ "$(losses "$WORK/$name.cuda.out" | wc -l)" -eq 3 ] && same_losses "$WORK/$name.cpu.out" "$WORK/$name.cuda.out" 0; then
    ok "$label: losses of 3 steps equal the CPU program's ($(losses "$WORK/$name.cuda.out" | tr '\n' ' '))"
  else
    bad "$label: losses differ from the CPU program's" "$(grep -h '^step' "$WORK/$name.cpu.out" "$WORK/$name.cuda.out")"
  fi
  if why=$(compare_dumps "$WORK/$name.cpu.dump" "$WORK/$name.cuda.dump" 0); then
    ok "$label: the step-1 loss and every whole gradient equal the CPU program's bit for bit ($why)"
  else
    bad "$label: --dump differs from the CPU program's" "$why"
  fi
}

for name in $PIPELINE_MODELS; do compare "$name"; done

# --sample through the stages: the last stage draws, the first feeds the tokens back.
if [ "$(cat "$WORK/lm_pp2.built" 2>/dev/null)" = 0 ]; then
  for kind in cpu cuda; do run lm_pp2 "$kind" --steps 2 --sample 12 --quiet || true; done
  for kind in cpu cuda; do sed -n '/^# sample/,$p' "$WORK/lm_pp2.$kind.out" >"$WORK/lm_pp2.$kind.sample"; done
  if [ -s "$WORK/lm_pp2.cuda.sample" ] && cmp -s "$WORK/lm_pp2.cpu.sample" "$WORK/lm_pp2.cuda.sample"; then
    ok "cuda pipeline lm_pp2: --sample 12 after 2 steps draws the CPU program's tokens ($(sed 1d "$WORK/lm_pp2.cuda.sample" | tr -d '\n' | cut -c1-60))"
  else
    bad "cuda pipeline lm_pp2: --sample differs from the CPU program's" "$(tail -n 5 "$WORK/lm_pp2.cpu.out" "$WORK/lm_pp2.cuda.out")"
  fi
fi
exit $failed
