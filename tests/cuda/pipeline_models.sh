# shellcheck shell=bash
# The models of the CUDA target's checks of microbatches and pipeline stages (sourced by
# tests/cuda/pipeline.sh, which runs them on the fake device, and tests/cuda/gpu.sh, on a GPU):
#   PIPELINE_MODELS         the fake device's (every layout; a build of a pp 2 model compiles two
#                           stages with NVRTC, ~25 s here without the build cache)
#   PIPELINE_GPU_MODELS     a GPU session's: those one GPU runs (one rank, or two stages that
#                           share no NCCL communicator; two ranks of one NCCL group cannot share a GPU)
#   pipeline_models DIR     writes DIR/NAME.moe of each
#   pipeline_layout NAME    its parallel block's fields
#   pipeline_ranks NAME     the ranks it runs on (pp x dp x mp)
# stack_*: the MoE stack of the gradient check (tests/models/grad_k2.moe) with 6 samples a step;
# lm_*: the GPT-style language model (tests/models/grad_lm_gpt.moe: tied embedding, a dense layer)
# with 3 MoE blocks and 4 samples a step (a DP rank's).
PIPELINE_MODELS="stack_m3 lm_pp2 lm_pp2_dpep lm_pp2_mpesp"
PIPELINE_GPU_MODELS="stack_m3 lm_m4 lm_pp2"

pipeline_layout() {
  case $1 in
  stack_m3) echo "microbatches 3;" ;;
  lm_m4) echo "microbatches 4;" ;;
  lm_pp2) echo "pp 2; microbatches 4;" ;;
  lm_pp2_dpep) echo "pp 2; dp 2; ep 2; microbatches 2; pp_schedule gpipe;" ;;
  lm_pp2_mpesp) echo "pp 2; mp 2; esp 2; microbatches 2;" ;;
  esac
}

pipeline_ranks() {
  case $1 in
  stack_m3 | lm_m4) echo 1 ;;
  lm_pp2) echo 2 ;;
  *) echo 4 ;;
  esac
}

pipeline_models() {
  local name
  for name in $PIPELINE_MODELS $PIPELINE_GPU_MODELS; do
    case $name in
    stack_*) sed "s/batch 2;/batch 6;/; s/^layer block x 2/parallel { $(pipeline_layout "$name") }\nlayer block x 2/" \
               tests/models/grad_k2.moe ;;
    lm_*) sed "s/batch 2;/batch 4;/; s/^layer block x 2/parallel { $(pipeline_layout "$name") }\nlayer block x 3/" \
            tests/models/grad_lm_gpt.moe ;;
    esac >"$1/$name.moe"
  done
}
