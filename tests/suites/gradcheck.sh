#!/usr/bin/env bash
# Whole-model gradients against finite differences (BIN --check-grad): the fixed models in
# tests/models/grad_*.moe, a planted error the check must catch, then a generated matrix: every
# gate x order x expert, k in {1, 2, 4} where the gate has k, with and without dropped tokens,
# dropless, `renormalize` against its default, and every record hook point. (Compression hooks
# are quantisers, not differentiable functions: their straight-through gradients are checked
# exactly against the numpy reference, tests/suites/ref.sh.)
. "$(dirname "$0")/../lib.sh"
work gradcheck
# One thread per check: the checks run side by side, one per core.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# The checks run side by side (spawn, tests/lib.sh), each in a folder of its own; collect prints
# their lines in this order at the end. The planted error first, in the foreground.
# The check can fail: a gradient planted 20 % too large (MOERT_CHECK_GRAD_PLANT) is reported, even
# though entries out of tolerance are measured a second time closer to the point.
if "$MOEC" build tests/models/grad_k2.moe -o "$WORK/gc.bin" 2>"$WORK/err" &&
   ! (cd "$WORK" && MOERT_CHECK_GRAD_PLANT=1 ./gc.bin --check-grad >"$WORK/gc" 2>&1) &&
   grep -q 'block1.moe.experts.w2 .*FAILED' "$WORK/gc" && ! grep -q 'experts.w1 .*FAILED' "$WORK/gc"; then
  ok "gradcheck fails on a planted gradient error (block1.moe.experts.w2 20 % off: $(awk '/entries checked/ {print $(NF-3), "entries out of tolerance"}' "$WORK/gc"))"
else
  bad "gradcheck on a planted gradient error" "$(cat "$WORK/gc" "$WORK/err" 2>/dev/null)"
fi
# The attention sinks' gradient can fail too: 10 % off in the sinks of a one-layer model (sliding
# window 3, where they carry weight enough to resolve along their gradient) is reported.
cat >"$WORK/sinks.moe" <<'EOF'
model sinks { batch 2; seqlen 8; embed 16; seed 29; vocab 32;
  position rope; norm rmsnorm; tie_embeddings false; optimizer sgd { lr 0.05; } }
layer slide {
  attention { heads 4; kv_heads 2; bias true; window 3; sinks true; }
  moe { experts 4 { ffn mixtral { hidden 16; } } gate gshard { k 2; bias true; renormalize true; capacity *; } }
}
EOF
if "$MOEC" build "$WORK/sinks.moe" -o "$WORK/sinks.bin" 2>"$WORK/err" &&
   (cd "$WORK" && ./sinks.bin --check-grad=slide0.attn.sinks >"$WORK/sk0" 2>&1) &&
   ! (cd "$WORK" && MOERT_CHECK_GRAD_PLANT=slide0.attn.sinks ./sinks.bin --check-grad=slide0.attn.sinks >"$WORK/sk" 2>&1) &&
   grep -q '^slide0.attn.sinks .*OK$' "$WORK/sk0" && grep -q '^slide0.attn.sinks .*FAILED$' "$WORK/sk"; then
  ok "gradcheck fails on a planted error in the attention sinks' gradient (slide0.attn.sinks 10 % off; unplanted: OK)"
else
  bad "gradcheck on a planted error in the attention sinks' gradient" "$(cat "$WORK/sk0" "$WORK/sk" "$WORK/err" 2>/dev/null)"
fi
# The header names the model's objective: cross-entropy for a language model, mse otherwise. (This
# run of grad_lm_gpt's check is also its line among the fixed models below, and the planted
# error's build of grad_k2 is its program there.)
"$MOEC" build tests/models/grad_lm_gpt.moe -o "$WORK/lm.bin" 2>"$WORK/err" && (cd "$WORK" && ./lm.bin --check-grad >"$WORK/lm" 2>&1)
lm_status=$?
if grep -q '^# gradient check of grad_lm_gpt at step 1: loss [0-9.]* (the objective: cross-entropy + ' "$WORK/lm" &&
   grep -q '(the objective: mse + ' "$WORK/gc"; then
  ok "gradcheck's header names the objective (cross-entropy for a language model, mse for the MoE stack)"
else
  bad "gradcheck's header" "$(head -n 2 "$WORK/lm" "$WORK/gc" "$WORK/err" 2>/dev/null)"
fi
gradcheck_one() {  # name folder (holding m.moe; or its program gc.bin; or the check's output gc and status rc)
  local name=$1 dir=$2
  if [ ! -f "$dir/rc" ]; then
    if [ ! -x "$dir/gc.bin" ] && ! "$MOEC" build "$dir/m.moe" -o "$dir/gc.bin" 2>"$dir/err"; then bad "gradcheck $name: build" "$(cat "$dir/err")"; return; fi
    (cd "$dir" && ./gc.bin --check-grad >"$dir/gc" 2>&1)
    echo $? >"$dir/rc"
  fi
  if [ "$(cat "$dir/rc")" = 0 ]; then
    ok "gradcheck $name ($(grep -c ' OK$' "$dir/gc") tensors, $(awk '/entries checked/ {print $2}' "$dir/gc") entries)"
  else
    bad "gradcheck $name" "$(cat "$dir/gc")"
  fi
}
n=0 ids=()
gradcheck() {  # name model-file: copied to a folder of its own, checked in the background
  n=$((n + 1))
  mkdir -p "$WORK/g$n"
  cp "$2" "$WORK/g$n/m.moe"
  case $2 in   # built (and run) above
    tests/models/grad_lm_gpt.moe) [ -x "$WORK/lm.bin" ] && cp "$WORK/lm" "$WORK/g$n/gc" && echo "$lm_status" >"$WORK/g$n/rc" ;;
    tests/models/grad_k2.moe) [ -x "$WORK/gc.bin" ] && cp "$WORK/gc.bin" "$WORK/g$n/gc.bin" ;;
  esac
  spawn "g$n" gradcheck_one "$1" "$WORK/g$n"
  ids+=("g$n")
}
# (grad_expert_oss, whose last layers reach gpt-oss's clamps, also with planted errors below)
for model in tests/models/grad_*.moe; do
  [ -f "$model" ] && [ "$model" != tests/models/grad_expert_oss.moe ] && gradcheck "$(basename "$model" .moe)" "$model"
done
matrix_model() {  # gate-block order expert-block experts extra-moe-statements
  printf 'model m { batch 2; seqlen 8; embed 16; seed 5; optimizer sgd { lr 0.05; } }\n'
  printf 'layer b x 2 { moe { experts %s { %s } gate %s order %s; %s } }\n' "$4" "$3" "$1" "$2" "${5:-}"
}
expert_block() {  # gpt | mixtral | oss
  case $1 in
    gpt) echo "ffn gpt { hidden 24; act gelu; bias true; }" ;;
    mixtral | oss) echo "ffn $1 { hidden 24; }" ;;
  esac
}
for expert in gpt mixtral oss; do
  eblock=$(expert_block $expert)
  for order in tutel gshard; do
    for gate in gshard sigmoid xmoe; do
      extra=""; [ $gate = xmoe ] && extra="proj 8;"
      for k in 1 2 4; do
        for cap in 4.0 0.6; do
          drop=$([ $cap = 0.6 ] && echo "with drops" || echo "no drops")
          matrix_model "$gate { k $k; capacity $cap; noise 0.5; aux_loss 0.1; z_loss 0.01; $extra }" $order "$eblock" 8 >"$WORK/m.moe"
          gradcheck "$gate k=$k $drop, order $order, ffn $expert" "$WORK/m.moe"
        done
      done
    done
    matrix_model "gshard { k 2; capacity *; noise 0.5; aux_loss 0.1; }" $order "$eblock" 4 >"$WORK/m.moe"
    gradcheck "gshard k=2 dropless, order $order, ffn $expert" "$WORK/m.moe"
    for k in 1 2; do
      matrix_model "expert_choice { k $k; capacity 0.75; noise 0.5; z_loss 0.01; groups 2; }" $order "$eblock" 4 >"$WORK/m.moe"
      gradcheck "expert_choice k=$k groups 2, order $order, ffn $expert" "$WORK/m.moe"
    done
    for slots in 1 2; do
      matrix_model "softmoe { slots $slots; }" $order "$eblock" 4 >"$WORK/m.moe"
      gradcheck "softmoe slots=$slots, order $order, ffn $expert" "$WORK/m.moe"
    done
  done
done
# `renormalize` against its default: k 1 renormalised (every gate exactly 1, the router learns
# from the aux and z losses only) and k 2 with the raw softmax scores, gshard and xmoe; sigmoid
# scores renormalised (DeepSeek-V3's norm_topk_prob).
for order in tutel gshard; do
  for spec in "gshard|1|true|gpt" "gshard|2|false|mixtral" "xmoe|2|false|gpt" "xmoe|1|true|mixtral" "sigmoid|2|true|mixtral" \
              "gshard|2|true|oss"; do
    IFS='|' read -r gate k renorm expert <<<"$spec"
    eblock=$(expert_block "$expert")
    extra=""; [ $gate = xmoe ] && extra="proj 8;"
    matrix_model "$gate { k $k; capacity 0.6; noise 0.5; aux_loss 0.1; z_loss 0.01; renormalize $renorm; $extra }" $order "$eblock" 8 >"$WORK/m.moe"
    gradcheck "$gate k=$k renormalize $renorm with drops, order $order, ffn $expert" "$WORK/m.moe"
  done
done
# Every shipped model (lang/models; the paper's full-size ones are for planning, not a CPU
# check) and gpt-oss's clamped experts: the whole check passes, and planted errors fail it
# (tests/gradplant.sh).
. tests/gradplant.sh
planted_one() {  # name folder (holding m.moe)
  if ! "$MOEC" build "$2/m.moe" -o "$2/gc.bin" 2>"$2/err"; then bad "gradcheck $1: build" "$(cat "$2/err")"; return; fi
  grad_planted "$1" "$2" ./gc.bin
}
for model in lang/models/*.moe tests/models/grad_expert_oss.moe; do
  n=$((n + 1))
  mkdir -p "$WORK/g$n"
  cp "$model" "$WORK/g$n/m.moe"
  spawn "g$n" planted_one "$(basename "$model" .moe)" "$WORK/g$n"
  ids+=("g$n")
done
hooks=""; for p in before_moe_start before_dispatch after_dispatch before_combine after_combine before_moe_end; do hooks="$hooks hook $p record;"; done
matrix_model "gshard { k 2; capacity 0.8; aux_loss 0.1; }" tutel "ffn gpt { hidden 24; }" 4 "$hooks" >"$WORK/m.moe"
gradcheck "record hooks at all six points" "$WORK/m.moe"
collect "${ids[@]}"
exit $failed
