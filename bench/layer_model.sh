# The single-GPU MoE layer of make bench-gpu as a .moe file, for the scripts that build it
# (bench/gpu_predict.sh, bench/gpu_compiled.sh; sourced):
#
#   layer_model SCRIPT NAME FFN BxLxMxHSCALE DTYPE [SCHEDULE]
#
# prints model NAME (batch B, seqlen L, embed M, AdamW) with one layer of 8 experts (ffn gpt with
# hidden H = HSCALE*M, bias and GELU, or ffn mixtral), gate gshard top-2 at capacity 1.2 with aux
# loss 0.01 and order tutel, and the SCHEDULE statement when one is given; 1 for an unknown FFN.
# FFN_dropless (gpt_dropless, mixtral_dropless): the same layer without dropping (capacity *).
layer_model() {
  local b l m h ffn capacity=1.2
  IFS=x read -r b l m h <<<"$4"
  case $3 in *_dropless) capacity="*" ;; esac
  case ${3%_dropless} in
    gpt) ffn="ffn gpt { hidden $((m * h)); act gelu; bias true; }" ;;
    mixtral) ffn="ffn mixtral { hidden $((m * h)); }" ;;
    *) echo "$1: unknown ffn '$3' (gpt or mixtral)" >&2; return 1 ;;
  esac
  echo "# $1: one MoE layer, B $b L $l M $m H $((m * h)) ($3, $5)"
  echo "model $2 { dtype $5; batch $b; seqlen $l; embed $m; seed 1; optimizer adamw { lr 0.0003; } }"
  [ -z "${6:-}" ] || echo "$6"
  cat <<EOM
layer block {
  moe {
    experts 8 { $ffn }
    gate gshard { k 2; capacity $capacity; aux_loss 0.01; }
    order tutel;
  }
}
EOM
}
