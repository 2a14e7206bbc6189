#!/usr/bin/env bash
# Hugging Face checkpoints in make test (lang/manual.md §19; the comparison with transformers itself is
# make interop): a Mixtral checkpoint written by tests/lm/hf_fixture.py with numpy.
#   - moec import-hf writes a model that builds and trains; --steps 0 --export-hf writes back
#     every tensor bit for bit (and a config.json with the same architecture);
#   - the same numbers as BF16 over 3 shards, and as F16, import to the same moec weights;
#   - the imported model on dp2·mp2·ep4 (4 ranks) gives the single-rank losses;
#   - config values and tensors it cannot represent are refused with a sentence naming them;
#   - --export-hf of a model that is no family is refused before training, saying why.
# Prints ok/FAIL lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
case "$MOEC" in /*) ;; *) MOEC=$(pwd)/$MOEC ;; esac
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-hf.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
. tests/mpi/common.sh
FIX="$PY tests/lm/hf_fixture.py"
export OMP_NUM_THREADS=1

$FIX make "$WORK/mx" || { bad "hf_fixture.py make"; exit 1; }
if ! "$MOEC" import-hf "$WORK/mx" -o "$WORK/mx" --batch 2 --seqlen 16 >"$WORK/imp.out" 2>&1; then
  bad "import-hf of a Mixtral checkpoint" "$(cat "$WORK/imp.out")"; exit 1
fi
if ! "$MOEC" build "$WORK/mx.moe" -o "$WORK/mxbin" 2>"$WORK/err"; then bad "build the imported model" "$(cat "$WORK/err")"; exit 1; fi
if (cd "$WORK" && ./mxbin --steps 0 --weights mx.safetensors --export-hf out >exp.out 2>&1) &&
   same=$($FIX same "$WORK/mx/model.safetensors" "$WORK/out/model.safetensors" 2>&1); then
  ok "Mixtral import-hf, then --steps 0 --export-hf: $same"
else
  bad "Mixtral import-hf then --export-hf is not the checkpoint" "$(cat "$WORK/exp.out") ${same:-}"
fi
if $PY - "$WORK/mx/config.json" "$WORK/out/config.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
keys = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "rms_norm_eps", "tie_word_embeddings"]
diff = [k for k in keys if a[k] != b[k]]
diff += [] if a["rope_parameters"]["rope_theta"] == b["rope_parameters"]["rope_theta"] else ["rope_theta"]
if diff:
    print("differ:", ", ".join(diff))
sys.exit(1 if diff else 0)
EOF
then ok "the exported config.json has the checkpoint's architecture"
else bad "the exported config.json differs from the checkpoint's"
fi
# The export keeps the imported config: import-hf keeps config.json (and generation_config.json)
# in PREFIX.hf, which the .moe names (hf_config); after training, the exported config.json is the
# checkpoint's key by key, generation_config.json carries its token ids, and nothing is listed as
# changed. A model that changes a value the config holds (its aux loss) exports its own value and
# lists it; a checkpoint's own generation_config.json is exported as it is.
cfgdiff() {   # A B: the keys whose values differ, "key: a -> b" per line (as JSON values)
  $PY - "$1" "$2" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
for k in list(a) + [k for k in b if k not in a]:
    if a.get(k, "<absent>") != b.get(k, "<absent>"):
        print("%s: %s -> %s" % (k, json.dumps(a.get(k, "<absent>")), json.dumps(b.get(k, "<absent>"))))
EOF
}
echo '{"_from_model_config": true, "bos_token_id": 1, "eos_token_id": 2, "transformers_version": "5.24.0"}' >"$WORK/gen_want.json"
if (cd "$WORK" && ./mxbin --steps 2 --weights mx.safetensors --export-hf kept >kept.out 2>&1) &&
   d=$(cfgdiff "$WORK/mx/config.json" "$WORK/kept/config.json") && [ -z "$d" ] &&
   ! grep -q "config.json: the model's own values" "$WORK/kept.out" &&
   [ -z "$(cfgdiff "$WORK/kept/generation_config.json" "$WORK/gen_want.json")" ]; then
  ok "import-hf, 2 steps, --export-hf: config.json key by key the checkpoint's ($(grep -c ':' "$WORK/kept/config.json") lines: max_position_embeddings 64, not the seqlen 16; router_aux_loss_coef, bos/eos_token_id, use_cache, initializer_range kept), generation_config.json with bos 1 and eos 2"
else
  bad "the exported config differs from the imported one" "$(tail -n 3 "$WORK/kept.out"; echo "${d:-}"; cat "$WORK/kept/generation_config.json" 2>/dev/null)"
fi
sed 's/gate gshard { k 2;/gate gshard { k 2; aux_loss 0.05; aux pooled;/' "$WORK/mx.moe" >"$WORK/mxaux.moe"
if "$MOEC" build "$WORK/mxaux.moe" -o "$WORK/mxaux" 2>"$WORK/err" &&
   (cd "$WORK" && ./mxaux --steps 1 --weights mx.safetensors --export-hf auxout >aux.out 2>&1) &&
   grep -qF "# config.json: the model's own values for: router_aux_loss_coef: 0.02 -> 0.05; output_router_logits: false -> true" "$WORK/aux.out" &&
   [ "$(cfgdiff "$WORK/mx/config.json" "$WORK/auxout/config.json" | tr '\n' ' ')" = "router_aux_loss_coef: 0.02 -> 0.05 output_router_logits: false -> true " ]; then
  ok "a model that sets aux_loss 0.05 and aux pooled exports them, the rest as imported, and lists what it changed: $(grep -o 'router_aux.*' "$WORK/aux.out")"
else
  bad "the changed aux loss in the export" "$(cat "$WORK/err" "$WORK/aux.out" 2>/dev/null | tail -n 4; cfgdiff "$WORK/mx/config.json" "$WORK/auxout/config.json")"
fi
mkdir -p "$WORK/gen"
cp "$WORK/mx/"* "$WORK/gen/"
printf '{\n  "bos_token_id": 1,\n  "eos_token_id": [2, 5],\n  "max_new_tokens": 20,\n  "temperature": 0.7\n}\n' >"$WORK/gen/generation_config.json"
if "$MOEC" import-hf "$WORK/gen" -o "$WORK/gen/imp" --batch 2 --seqlen 16 >"$WORK/gen.out" 2>&1 &&
   "$MOEC" build "$WORK/gen/imp.moe" -o "$WORK/gen/bin" 2>"$WORK/err" &&
   (cd "$WORK/gen" && ./bin --steps 0 --weights imp.safetensors --export-hf out >exp.out 2>&1) &&
   [ -f "$WORK/gen/out/generation_config.json" ] &&
   [ -z "$(cfgdiff "$WORK/gen/generation_config.json" "$WORK/gen/out/generation_config.json")" ]; then
  ok "a checkpoint's generation_config.json (eos [2, 5], max_new_tokens, temperature) is exported as it is"
else
  bad "the checkpoint's generation_config.json" "$(cat "$WORK/gen.out" "$WORK/err" "$WORK/gen/exp.out" 2>/dev/null | tail -n 4; cat "$WORK/gen/out/generation_config.json" 2>/dev/null)"
fi
# GLM-4.5 (glm4_moe): the gradient-check model of its parts (a dense first layer, partial rope,
# q/k norms and biases, DeepSeek-V3's router with its correction bias, a shared expert) exports a
# glm4_moe checkpoint after 2 steps; import-hf reads it back (the router, the partial rope) and its
# --steps 0 export is the same checkpoint bit for bit. (Against transformers itself: make interop.)
if "$MOEC" build tests/models/grad_lm_glm.moe -o "$WORK/glm" 2>"$WORK/err" &&
   (cd "$WORK" && ./glm --steps 2 --export-hf glmhf >glme.out 2>&1) &&
   $PY - "$WORK/glmhf/config.json" >"$WORK/glmcfg" 2>&1 <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
want = {"model_type": "glm4_moe", "first_k_dense_replace": 1, "n_routed_experts": 8, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "use_qk_norm": True,
        "attention_bias": True, "head_dim": 8}
bad = {k: (c.get(k), v) for k, v in want.items() if c.get(k) != v}
if c.get("rope_parameters", {}).get("partial_rotary_factor") != 0.5:
    bad["partial_rotary_factor"] = c.get("rope_parameters")
print(bad or "ok")
sys.exit(1 if bad else 0)
EOF
then
  if "$MOEC" import-hf "$WORK/glmhf" -o "$WORK/glmre" --batch 2 --seqlen 8 --optimizer sgd --lr 0.01 >"$WORK/imp.out" 2>&1 &&
     grep -q 'gate sigmoid { k 2; capacity \*; renormalize true; expert_groups 4; topk_groups 2; scale 2.5; balance bias 0; }' "$WORK/glmre.moe" &&
     grep -q 'position rope { theta 10000; partial 0.5; }' "$WORK/glmre.moe" &&
     "$MOEC" build "$WORK/glmre.moe" -o "$WORK/glmrebin" 2>"$WORK/err" &&
     (cd "$WORK" && ./glmrebin --steps 0 --weights glmre.safetensors --export-hf glmhf2 >re0.out 2>&1) &&
     same=$($FIX same "$WORK/glmhf/model.safetensors" "$WORK/glmhf2/model.safetensors" 2>&1); then
    ok "GLM-4.5: --export-hf writes a glm4_moe checkpoint (e_score_correction_bias, partial_rotary_factor, n_group, ...); import-hf reads it back and --steps 0 exports it again: $same"
  else
    bad "GLM-4.5: import-hf of the exported checkpoint" "$(cat "$WORK/imp.out" "$WORK/err" "$WORK/re0.out" 2>/dev/null | tail -n 5; grep -n 'gate\|position' "$WORK/glmre.moe" 2>/dev/null)"
  fi
else
  bad "GLM-4.5: --export-hf of tests/models/grad_lm_glm.moe" "$(cat "$WORK/err" "$WORK/glme.out" "$WORK/glmcfg" 2>/dev/null | tail -n 5)"
fi
# gpt-oss (gpt_oss): tests/models/grad_lm_oss.moe (sinks, sliding and full layers, head_dim 6, yarn
# without truncation, `ffn oss` experts, the router's bias, aux pooled) exports a gpt_oss checkpoint
# after 2 steps (layer_types, sliding_window, swiglu_*, truncate); import-hf reads it back (the
# windows by layer, the sinks, the experts' interleaved gate_up_proj) and its --steps 0 export is
# the same checkpoint bit for bit.
if "$MOEC" build tests/models/grad_lm_oss.moe -o "$WORK/oss" 2>"$WORK/err" &&
   (cd "$WORK" && ./oss --steps 2 --export-hf osshf >osse.out 2>&1) &&
   $PY - "$WORK/osshf/config.json" >"$WORK/osscfg" 2>&1 <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
want = {"model_type": "gpt_oss", "num_local_experts": 4, "intermediate_size": 12, "head_dim": 6,
        "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "sliding_window": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "output_router_logits": True, "router_aux_loss_coef": 0.01}
bad = {k: (c.get(k), v) for k, v in want.items() if c.get(k) != v}
if c.get("rope_parameters", {}).get("truncate") is not False:
    bad["truncate"] = c.get("rope_parameters")
print(bad or "ok")
sys.exit(1 if bad else 0)
EOF
then
  if "$MOEC" import-hf "$WORK/osshf" -o "$WORK/ossre" --batch 2 --seqlen 8 --optimizer sgd --lr 0.05 >"$WORK/imp.out" 2>&1 &&
     grep -q 'gate gshard { k 2; capacity \*; renormalize true; bias true; aux_loss 0.01; aux pooled; }' "$WORK/ossre.moe" &&
     grep -q 'attention { heads 4; kv_heads 2; bias true; head_dim 6; window 3; sinks true; }' "$WORK/ossre.moe" &&
     grep -q 'attention { heads 4; kv_heads 2; bias true; head_dim 6; sinks true; }' "$WORK/ossre.moe" &&
     grep -q 'experts 4 { ffn oss { hidden 12; } }' "$WORK/ossre.moe" && grep -q 'truncate false;' "$WORK/ossre.moe" &&
     "$MOEC" build "$WORK/ossre.moe" -o "$WORK/ossrebin" 2>"$WORK/err" &&
     (cd "$WORK" && ./ossrebin --steps 0 --weights ossre.safetensors --export-hf osshf2 >re0.out 2>&1) &&
     same=$($FIX same "$WORK/osshf/model.safetensors" "$WORK/osshf2/model.safetensors" 2>&1); then
    ok "gpt-oss: --export-hf writes a gpt_oss checkpoint (sinks, layer_types, gate_up_proj, truncate false, ...); import-hf reads it back and --steps 0 exports it again: $same"
  else
    bad "gpt-oss: import-hf of the exported checkpoint" "$(cat "$WORK/imp.out" "$WORK/err" "$WORK/re0.out" 2>/dev/null | tail -n 5; grep -n 'gate\|attention\|ffn' "$WORK/ossre.moe" 2>/dev/null)"
  fi
else
  bad "gpt-oss: --export-hf of tests/models/grad_lm_oss.moe" "$(cat "$WORK/err" "$WORK/osse.out" "$WORK/osscfg" 2>/dev/null | tail -n 5)"
fi
# gpt-oss's refusals, on the checkpoint exported above: a clamp or gain other than 'ffn oss''s, a
# layer type other than sliding or full, sliding layers without a window, an unknown yarn key.
oss_refused() {  # label expected-text python-statement-on-c
  rm -rf "$WORK/ossr"; cp -r "$WORK/osshf" "$WORK/ossr"
  $PY -c "import json; p='$WORK/ossr/config.json'; c = json.load(open(p)); $3; json.dump(c, open(p, 'w'))"
  if "$MOEC" import-hf "$WORK/ossr" -o "$WORK/ossr/x" --seqlen 8 >"$WORK/r.out" 2>&1; then
    bad "import-hf accepted gpt-oss's $1"
  elif grep -q -- "$2" "$WORK/r.out"; then
    ok "import-hf refuses gpt-oss's $1: $(head -n 1 "$WORK/r.out" | sed 's/.*error: //')"
  else
    bad "import-hf refused gpt-oss's $1 without saying '$2'" "$(cat "$WORK/r.out")"
  fi
}
if [ -f "$WORK/osshf/config.json" ]; then
  oss_refused "swiglu_limit 6" "clamps at 7" "c['swiglu_limit'] = 6.0"
  oss_refused "swiglu_alpha 1.5" "has alpha 1.702" "c['swiglu_alpha'] = 1.5"
  oss_refused "chunked attention" 'are "sliding_attention" (a window) or "full_attention"' "c['layer_types'][1] = 'chunked_attention'"
  oss_refused "layer_types of the wrong length" "the type of each of the num_hidden_layers layers" "c['layer_types'].pop()"
  oss_refused "sliding layers without a window" '"sliding_window" is not a number' "c['sliding_window'] = None"
  oss_refused "an attention_factor" "takes rope_theta, factor" "c['rope_parameters']['attention_factor'] = 2.0"
fi
# And the export's: a gpt-oss model (its hf_config) whose layers lose the sinks, the experts or the
# router's bias is refused by the build, naming the part. (sed expression|what the error says|label)
while IFS='|' read -r expr says label; do
  [ -f "$WORK/ossre.moe" ] || { bad "gpt-oss export refusals: no imported model"; break; }
  sed "$expr" "$WORK/ossre.moe" >"$WORK/ossx.moe"
  if ! "$MOEC" build "$WORK/ossx.moe" -o "$WORK/ossx" 2>"$WORK/err" &&
     grep -qF "$says" "$WORK/err" && grep -q "ossx.moe:[0-9]*:[0-9]*: error: " "$WORK/err"; then
    ok "a gpt-oss model with $label is refused: $(head -n 1 "$WORK/err" | sed "s|$WORK/||g" | cut -c1-150)"
  else
    bad "a gpt-oss model with $label" "$(cat "$WORK/err" 2>/dev/null | tail -n 4)"
  fi
done <<'EOF'
0,/ sinks true;/s/ sinks true;//|has no attention sinks; gpt-oss's attention has them in every layer|a layer without sinks
0,/ffn oss/s/ffn oss/ffn mixtral/|experts; gpt-oss's are the clamped SwiGLU with biases ('ffn oss')|SwiGLU experts
0,/ bias true; aux_loss/s/ bias true; aux_loss/ aux_loss/|has no router bias; gpt-oss's router has a bias|a router without its bias
EOF
# A router bias (`bias true`, gpt-oss's) is no Mixtral setting, nor is DeepSeek's choice (a
# correction bias, a group limit, a scale): a model that names its Hugging Face config (hf_config)
# and has one is refused by the build, naming it. (statement|what the error says|label)
while IFS='|' read -r stmt says label; do
  sed "s/gate gshard { k 2;/gate gshard { k 2; $stmt/" "$WORK/mx.moe" >"$WORK/mxr.moe"
  if ! "$MOEC" build "$WORK/mxr.moe" -o "$WORK/mxr" 2>"$WORK/err" &&
     grep -qF "$says" "$WORK/err" && grep -q "mxr.moe:[0-9]*:[0-9]*: error: " "$WORK/err"; then
    ok "a Mixtral with $label is refused: $(head -n 1 "$WORK/err" | sed "s|$WORK/||g" | cut -c1-150)"
  else
    bad "a Mixtral with $label" "$(cat "$WORK/err" 2>/dev/null | tail -n 4)"
  fi
done <<'EOF'
bias true;|has a router bias ('bias true'); Mixtral's router has none|a router bias
balance bias 0.001;|has DeepSeek's choice ('balance bias'); Mixtral's router is a plain top-k|'balance bias'
expert_groups 2;|has DeepSeek's choice ('expert_groups'); Mixtral's router is a plain top-k|'expert_groups'
scale 2.5;|has DeepSeek's choice ('scale'); Mixtral's router is a plain top-k|'scale'
EOF
sed 's/^hf_config "mx.hf";/hf_config "nowhere.hf";/' "$WORK/mx.moe" >"$WORK/nohf.moe"
if ! "$MOEC" build "$WORK/nohf.moe" -o "$WORK/nohf" 2>"$WORK/err" &&
   grep -q "nohf.moe:[0-9]*:[0-9]*: error: cannot read '.*nowhere.hf/config.json': No such file or directory" "$WORK/err"; then
  ok "hf_config naming a missing folder: $(head -n 1 "$WORK/err" | sed "s|$WORK/||g" | cut -c1-160)"
else
  bad "hf_config naming a missing folder" "$(cat "$WORK/err")"
fi

if (cd "$WORK" && ./mxbin --steps 3 --weights mx.safetensors >train.out 2>&1) && [ "$(losses "$WORK/train.out" | wc -l)" = 3 ]; then
  ok "the imported model trains from its weights: losses $(losses "$WORK/train.out" | tr '\n' ' ')"
else
  bad "the imported model does not train" "$(tail -n 5 "$WORK/train.out")"
fi

# BF16 over shards and F16 hold the same numbers: the same moec weights.
for form in "bf16 --bf16-shards 3" "f16 --f16"; do
  set -- $form
  name=$1; shift
  $FIX make "$WORK/$name" "$@"
  if "$MOEC" import-hf "$WORK/$name" -o "$WORK/$name" --batch 2 --seqlen 16 >"$WORK/$name.out" 2>&1 &&
     same=$($FIX same "$WORK/mx.safetensors" "$WORK/$name.safetensors" 2>&1); then
    ok "import-hf of the same checkpoint as $name ($*): the moec weights equal the F32 import's: $same"
  else
    bad "import-hf as $name differs from the F32 import" "$(cat "$WORK/$name.out") ${same:-}"
  fi
done

# Layouts: dp2·mp2·ep2 on 4 ranks equals one rank (global batch 4 windows).
sed 's/batch 2;/batch 4;/' "$WORK/mx.moe" >"$WORK/one.moe"
sed '0,/^layer /s//parallel { dp 2; mp 2; ep 4; esp 1; }\nlayer /' "$WORK/mx.moe" >"$WORK/four.moe"
if "$MOEC" build "$WORK/one.moe" -o "$WORK/one" 2>"$WORK/err" && "$MOEC" build "$WORK/four.moe" -o "$WORK/four" 2>>"$WORK/err" &&
   (cd "$WORK" && ./one --steps 3 --weights mx.safetensors >one.out 2>&1) &&
   (cd "$WORK" && timeout 300 $MPIRUN -np 4 ./four --steps 3 --weights mx.safetensors >four.out 2>&1 </dev/null) &&
   same_losses "$WORK/one.out" "$WORK/four.out"; then
  ok "the imported model on dp2·mp2·ep4 (4 ranks) has the single-rank losses: $(losses "$WORK/four.out" | tr '\n' ' ')"
else
  bad "the imported model on 4 ranks differs from one rank" "$(cat "$WORK/err"; paste <(losses "$WORK/one.out") <(losses "$WORK/four.out"); tail -n 5 "$WORK/four.out")"
fi

# Qwen2-MoE (a dense layer among the MoE ones, the shared expert, q/k/v biases): the export gives
# the checkpoint back, and dp2·mp2·ep2·esp2 (4 ranks) equals one rank.
$FIX make "$WORK/q2" --family qwen2_moe
if "$MOEC" import-hf "$WORK/q2" -o "$WORK/q2" --batch 4 --seqlen 16 >"$WORK/q2.out" 2>&1 &&
   "$MOEC" build "$WORK/q2.moe" -o "$WORK/q2one" 2>"$WORK/err" &&
   (cd "$WORK" && ./q2one --steps 0 --weights q2.safetensors --export-hf q2out >q2exp.out 2>&1) &&
   same=$($FIX same "$WORK/q2/model.safetensors" "$WORK/q2out/model.safetensors" 2>&1); then
  ok "Qwen2-MoE import-hf, then --steps 0 --export-hf: $same"
else
  bad "Qwen2-MoE import-hf then --export-hf is not the checkpoint" "$(cat "$WORK/q2.out" "$WORK/err" "$WORK/q2exp.out" 2>/dev/null) ${same:-}"
fi
if [ -f "$WORK/q2out/config.json" ] && d=$(cfgdiff "$WORK/q2/config.json" "$WORK/q2out/config.json") && [ -z "$d" ]; then
  ok "Qwen2-MoE import-hf then --export-hf: config.json key by key the checkpoint's (mlp_only_layers, intermediate_size, qkv_bias, ...)"
else
  bad "Qwen2-MoE's exported config.json differs from the checkpoint's" "${d:-no export}"
fi
sed 's/batch 4;/batch 2;/; 0,/^layer /s//parallel { dp 2; mp 2; ep 2; esp 2; }\nlayer /' "$WORK/q2.moe" >"$WORK/q2four.moe"
if "$MOEC" build "$WORK/q2four.moe" -o "$WORK/q2four" 2>"$WORK/err" &&
   (cd "$WORK" && ./q2one --steps 3 --weights q2.safetensors >q2one.out 2>&1) &&
   (cd "$WORK" && timeout 300 $MPIRUN -np 4 ./q2four --steps 3 --weights q2.safetensors >q2four.out 2>&1 </dev/null) &&
   same_losses "$WORK/q2one.out" "$WORK/q2four.out"; then
  ok "the imported Qwen2-MoE on dp2·mp2·ep2·esp2 (4 ranks) has the single-rank losses: $(losses "$WORK/q2four.out" | tr '\n' ' ')"
else
  bad "the imported Qwen2-MoE on 4 ranks differs from one rank" "$(cat "$WORK/err"; paste <(losses "$WORK/q2one.out") <(losses "$WORK/q2four.out"); tail -n 5 "$WORK/q2four.out")"
fi

# --check-grad on the imported families (one rank, and Mixtral on dp2·mp2·ep4): it passes, and a
# gradient planted 10 % off in an attention projection, an expert, a norm, the head or the
# router fails it (tests/gradplant.sh).
. tests/gradplant.sh
grad_planted "of the imported Mixtral" "$WORK" ./mxbin --weights mx.safetensors
grad_planted "of the imported Qwen2-MoE" "$WORK" ./q2one --weights q2.safetensors
grad_planted "of the imported Mixtral on dp2·mp2·ep4 (4 ranks)" "$WORK" timeout 300 $MPIRUN -np 4 ./four --weights mx.safetensors

# Mixtral's sliding window shorter than the sequence: the attention's window, exported back.
$FIX make "$WORK/sw" --config sliding_window=8
if "$MOEC" import-hf "$WORK/sw" -o "$WORK/sw" --batch 2 --seqlen 16 >"$WORK/sw.out" 2>&1 && grep -q 'window 8;' "$WORK/sw.moe" &&
   "$MOEC" build "$WORK/sw.moe" -o "$WORK/swbin" 2>"$WORK/err" &&
   (cd "$WORK" && ./swbin --steps 0 --weights sw.safetensors --export-hf swout >swexp.out 2>&1) &&
   grep -q '"sliding_window":[[:space:]]*8' "$WORK/swout/config.json"; then
  ok "Mixtral with sliding_window 8 < seqlen 16: imported as 'window 8', exported back as sliding_window 8"
else
  bad "Mixtral with a sliding window" "$(cat "$WORK/sw.out" "$WORK/err" "$WORK/swexp.out" 2>/dev/null; grep window "$WORK/sw.moe")"
fi

# output_router_logits true: transformers' load-balancing loss in the objective, imported as
# `aux pooled` with router_aux_loss_coef (0.02 in the fixture), trained with it (aux in the step
# line) and exported back as output_router_logits true with the coefficient.
$FIX make "$WORK/rl" --config output_router_logits=true
if "$MOEC" import-hf "$WORK/rl" -o "$WORK/rl" --batch 2 --seqlen 16 >"$WORK/rl.out" 2>&1 &&
   grep -q 'aux_loss 0.02; aux pooled;' "$WORK/rl.moe" && "$MOEC" build "$WORK/rl.moe" -o "$WORK/rlbin" 2>"$WORK/err" &&
   (cd "$WORK" && ./rlbin --steps 1 --weights rl.safetensors --export-hf rlout >rlexp.out 2>&1) &&
   grep -q '"output_router_logits":[[:space:]]*true' "$WORK/rlout/config.json" &&
   grep -q '"router_aux_loss_coef":[[:space:]]*0.02' "$WORK/rlout/config.json" &&
   aux=$(awk '/^step 1 /{for (i = 1; i < NF; i++) if ($i == "aux") print $(i + 1)}' "$WORK/rlexp.out") &&
   awk -v a="$aux" 'BEGIN { exit !(a > 0.5) }'; then
  ok "output_router_logits true: imported as 'aux_loss 0.02; aux pooled;', trained (aux $aux), exported back as true with 0.02"
else
  bad "output_router_logits true" "$(cat "$WORK/rl.out" "$WORK/err" "$WORK/rlexp.out" 2>/dev/null; grep gate "$WORK/rl.moe")"
fi

# Refusals, each a sentence naming what it refuses.
refused() {  # label expected-text fixture-args...
  local label=$1 want=$2; shift 2
  rm -rf "$WORK/r"; $FIX make "$WORK/r" "$@"
  if "$MOEC" import-hf "$WORK/r" -o "$WORK/r" --seqlen 16 >"$WORK/r.out" 2>&1; then
    bad "import-hf accepted $label"
  elif grep -q -- "$want" "$WORK/r.out"; then
    ok "import-hf refuses $label: $(head -n 1 "$WORK/r.out")"
  else
    bad "import-hf refused $label without saying '$want'" "$(cat "$WORK/r.out")"
  fi
}
refused "an unknown config key" '"moe_layer_freq": 2 is a key moec does not know' --config moe_layer_freq=2
refused "router jitter" '"router_jitter_noise": 0.1' --config router_jitter_noise=0.1
refused "output_router_logits not a boolean" '"output_router_logits": 1 is not something moec can represent: it must be true or false' --config output_router_logits=1
refused "a negative router_aux_loss_coef with output_router_logits" '"router_aux_loss_coef": -1 is not something' --config output_router_logits=true --config router_aux_loss_coef=-1
refused "a family moec does not read" 'model_type "llama4" is not a family moec reads' --config model_type='"llama4"'
refused "a missing tensor" "has no tensor 'model.layers.1.block_sparse_moe.experts.2.w3.weight'" --drop model.layers.1.block_sparse_moe.experts.2.w3.weight
refused "a tensor it does not know" "tensor 'model.layers.0.mlp.shared_expert_gate.weight' is not part of" --extra model.layers.0.mlp.shared_expert_gate.weight
refused "a tensor of the wrong shape" "is \[40, 32\]; config.json makes it \[48, 32\]" --claim intermediate_size=48
if "$MOEC" import-hf "$WORK/mx" -o "$WORK/x" --seqlen 100 >"$WORK/r.out" 2>&1; then
  bad "import-hf accepted --seqlen past max_position_embeddings"
elif grep -q "max_position_embeddings 64" "$WORK/r.out"; then ok "import-hf refuses --seqlen past max_position_embeddings: $(cat "$WORK/r.out")"
else bad "import-hf --seqlen 100: unclear refusal" "$(cat "$WORK/r.out")"
fi

# --export-hf of a model of no family: refused before training, with the reason.
"$MOEC" build lang/models/gpt_moe_bytes.moe -o "$WORK/gpt" 2>"$WORK/err"
if (cd "$WORK" && ./gpt --steps 2 --export-hf o2 >gpt.out 2>&1); then
  bad "--export-hf of gpt_moe_bytes (learned positions) was accepted"
elif grep -q "cannot be written as a Hugging Face checkpoint: .*position" "$WORK/gpt.out" && ! grep -q '^step' "$WORK/gpt.out"; then
  ok "--export-hf of a model of no family is refused before training: $(grep error "$WORK/gpt.out")"
else
  bad "--export-hf of gpt_moe_bytes: unclear refusal" "$(cat "$WORK/gpt.out")"
fi

# What a run writes after training (--save, --export-hf, --log, --dump, --record) and the sample's
# prompt are checked before the first step: a mistake in one ends the run before any training
# and writes nothing; a Hugging Face folder given to --weights gets the command that converts it.
early() {  # LABEL EXPECTED-WORDS ARGS...
  local label=$1 want=$2
  shift 2
  rm -rf "$WORK/e1" "$WORK/c1"*
  if (cd "$WORK" && ./mxbin "$@" >early.out 2>&1); then bad "$label: the run did not fail" "$(tail -n 3 "$WORK/early.out")"
  elif grep -q '^step ' "$WORK/early.out"; then bad "$label: it failed after training" "$(tail -n 3 "$WORK/early.out")"
  elif ! grep -qF -- "$want" "$WORK/early.out"; then bad "$label: not the expected message ($want)" "$(cat "$WORK/early.out")"
  elif [ -e "$WORK/e1" ] || [ -e "$WORK/c1" ]; then bad "$label: it wrote $(ls -d "$WORK"/e1 "$WORK"/c1 2>/dev/null)"
  else ok "$label: refused before the first step, nothing written ($(grep -m1 'error' "$WORK/early.out" | cut -c1-150))"; fi
}
early "a prompt the vocabulary lacks, with --export-hf and --save" "is not below vocab 64" \
  --steps 3 --weights mx.safetensors --sample 5 --prompt "The " --export-hf e1 --save c1
touch "$WORK/afile"
early "--save in a folder that does not exist" "the folder 'nowhere' does not exist" --steps 3 --save nowhere/c1
early "--export-hf onto a file" "it exists and is not a folder" --steps 3 --save c1 --export-hf afile
early "--log in a folder that is a file" "'afile' is not a folder" --steps 3 --log afile/log.jsonl
early "--prompt without --sample" "give --sample N too" --steps 3 --save c1 --prompt "1 2"
early "--weights of a Hugging Face folder" "moec import-hf DIR -o PREFIX" --steps 1 --weights mx
if (cd "$WORK" && ./mxbin --steps 2 --weights mx.safetensors --sample 4 --prompt "1 2" --save c2 --export-hf e2 >late.out 2>&1) &&
   [ -f "$WORK/c2" ] && [ -f "$WORK/e2/config.json" ] && grep -q '^# sample: 4 tokens after a 3-token prompt' "$WORK/late.out"; then
  ok "--save, --export-hf and --sample in one run: the checkpoint and the export written, then the sample"
else
  bad "--save, --export-hf and --sample in one run" "$(tail -n 5 "$WORK/late.out")"
fi
exit $failed
