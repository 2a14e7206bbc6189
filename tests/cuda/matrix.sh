#!/usr/bin/env bash
# The gate x order x expert matrix for the CUDA target: writes DIR/NAME.moe for each model and
# prints the names, one a line. Every configuration of the CPU gradient-check matrix
# (tests/suites/gradcheck.sh: gshard, sigmoid and xmoe with k 1, 2, 4 and capacity 4.0 or 0.6; gshard
# dropless; expert_choice k 1, 2 with groups; softmoe slots 1, 2; each under order tutel and
# gshard and with ffn gpt (GELU, biases) or ffn mixtral (SwiGLU)) is one layer of a small stack;
# a stack holds the layers of one gate and capacity (3 layers) or the other gates (5 layers),
# deep enough to share a build and shallow enough that the activations stay small: 28 models,
# then matrix_ORDER_oss_token and _other (ffn oss, gpt-oss's experts, under each gate: the token
# choice gates with drops, then dropless, expert choice and soft MoE), matrix_hooks (record hooks
# at all six points) and matrix_renorm (`renormalize` against its default: gshard and xmoe with
# k 1 renormalised, every gate 1, and k 2 with the raw scores; sigmoid scores renormalised).
#
#   bash tests/cuda/matrix.sh DIR      # tests/cuda/host.sh (fake device), tests/cuda/gpu.sh
#
# Names: matrix_ORDER_EXPERT_GROUP, GROUP one of gshard4, gshard06, sigmoid4, sigmoid06, xmoe4,
# xmoe06 (the gate and capacity 4.0 or 0.6), other; matrix_ORDER_oss_token, _oss_other.
set -eu
dir=${1:?usage: matrix.sh DIR}
mkdir -p "$dir"

# stack ORDER EXPERT-BLOCK LAYER...: a model of one layer per argument (each the gate block and
# the expert count, separated by '|', and optional extra statements after a second '|').
stack() {
  local order=$1 eblock=$2 i=0 spec gate experts extra
  shift 2
  printf 'model m { batch 2; seqlen 8; embed 16; seed 5; optimizer sgd { lr 0.001; } }\n'
  for spec in "$@"; do
    i=$((i + 1))
    IFS='|' read -r gate experts extra <<<"$spec"
    printf 'layer l%d { moe { experts %s { %s } gate %s order %s; %s } }\n' \
      "$i" "$experts" "$eblock" "$gate" "$order" "$extra"
  done
}

for expert in gpt mixtral; do
  case $expert in
    gpt) eblock="ffn gpt { hidden 24; act gelu; bias true; }" ;;
    mixtral) eblock="ffn mixtral { hidden 24; }" ;;
  esac
  for order in tutel gshard; do
    for gate in gshard sigmoid xmoe; do
      extra=""; [ $gate = xmoe ] && extra="proj 8;"
      for cap in 4.0 0.6; do
        layers=()
        for k in 1 2 4; do
          layers+=("$gate { k $k; capacity $cap; noise 0.5; aux_loss 0.1; z_loss 0.01; $extra }|8")
        done
        tag=4; [ $cap = 0.6 ] && tag=06
        name=matrix_${order}_${expert}_${gate}$tag
        stack $order "$eblock" "${layers[@]}" >"$dir/$name.moe"
        echo "$name"
      done
    done
    layers=("gshard { k 2; capacity *; noise 0.5; aux_loss 0.1; }|4")
    for k in 1 2; do layers+=("expert_choice { k $k; capacity 0.75; noise 0.5; z_loss 0.01; groups 2; }|4"); done
    for slots in 1 2; do layers+=("softmoe { slots $slots; }|4"); done
    stack $order "$eblock" "${layers[@]}" >"$dir/matrix_${order}_${expert}_other.moe"
    echo "matrix_${order}_${expert}_other"
  done
done
# gpt-oss's experts (ffn oss: clamped SwiGLU with biases) under every gate, two stacks of 3 per
# order (the CPU matrix runs each configuration of it as a model of its own).
for order in tutel gshard; do
  stack $order "ffn oss { hidden 24; }" "gshard { k 2; capacity 0.6; noise 0.5; aux_loss 0.1; z_loss 0.01; bias true; }|8" \
    "sigmoid { k 1; capacity 4.0; noise 0.5; aux_loss 0.1; }|8" "xmoe { k 2; capacity 0.6; proj 8; z_loss 0.01; }|8" \
    >"$dir/matrix_${order}_oss_token.moe"
  stack $order "ffn oss { hidden 24; }" "gshard { k 2; capacity *; noise 0.5; aux_loss 0.1; }|4" \
    "expert_choice { k 2; capacity 0.75; groups 2; }|4" "softmoe { slots 2; }|4" >"$dir/matrix_${order}_oss_other.moe"
  echo "matrix_${order}_oss_token"
  echo "matrix_${order}_oss_other"
done
hooks=""
for p in before_moe_start before_dispatch after_dispatch before_combine after_combine before_moe_end; do
  hooks="$hooks hook $p record;"
done
stack tutel "ffn gpt { hidden 24; }" "gshard { k 2; capacity 0.8; aux_loss 0.1; }|4|$hooks" \
  "gshard { k 1; capacity 0.8; aux_loss 0.1; }|4|$hooks" >"$dir/matrix_hooks.moe"
echo matrix_hooks
stack tutel "ffn gpt { hidden 24; }" \
  "gshard { k 1; capacity 0.6; noise 0.5; aux_loss 0.1; z_loss 0.01; renormalize true; }|8" \
  "gshard { k 2; capacity 0.6; noise 0.5; aux_loss 0.1; z_loss 0.01; renormalize false; }|8" \
  "xmoe { k 1; capacity 0.6; noise 0.5; aux_loss 0.1; proj 8; renormalize true; }|8" \
  "xmoe { k 2; capacity 0.6; noise 0.5; z_loss 0.01; proj 8; renormalize false; }|8" \
  "sigmoid { k 2; capacity 0.6; noise 0.5; aux_loss 0.1; renormalize true; }|8" >"$dir/matrix_renorm.moe"
echo matrix_renorm
