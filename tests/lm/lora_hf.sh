#!/usr/bin/env bash
# LoRA adapters in PEFT's form in make test (lang/manual.md §19; against PEFT itself: make interop,
# tests/interop/lora.py): the numpy Mixtral checkpoint of tests/lm/hf_fixture.py imported with
# `moec import-hf --lora`, built and trained.
#   - import-hf writes the lora block and PREFIX.hf/adapter_config.json naming the checkpoint;
#   - --export-hf writes adapter_config.json (r, lora_alpha, target_modules, target_parameters,
#     base_model_name_or_path) and adapter_model.safetensors under PEFT's names and shapes, each
#     tensor the trained moec adapter in PEFT's layout (experts: lora_A [r·E, in] as [E, r, in],
#     lora_B [out, r·E] as [out, r, E], gate and up in one gate_up_proj);
#   - --adapter reads an exported adapter back bit for bit, on one rank, dp2·ep2, dp2·mp2·ep2·esp2 and pp 2;
#   - --export-hf --merge writes W + (alpha/r)·A·B in the full checkpoint's names (the checkpoint
#     itself, bit for bit, while B is zero);
#   - DeepSeek-V3's latent attention (a checkpoint exported from a variant of
#     tests/models/grad_lm_mla.moe, with and without q_lora): targets q k v o name q_a_proj and
#     q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj, each tensor the trained moec
#     adapter transposed; --adapter reads it back bit for bit on one rank and on dp2·mp2·ep4;
#     --merge adds (alpha/r)·B·A to those weights;
#   - mismatched adapters (r, alpha, targets) and misused options are refused with a sentence.
# Prints ok/FAIL lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
. tests/mpi/common.sh
case "$MOEC" in /*) ;; *) MOEC=$(pwd)/$MOEC ;; esac
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-lora-hf.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
FIX="$PY tests/lm/hf_fixture.py"
export OMP_NUM_THREADS=1

$FIX make "$WORK/mx" || { bad "hf_fixture.py make"; exit 1; }
# read_st for the checks below (hf_fixture.py runs its command when imported)
sed -n '/^def to_bf16_bits/,/^def write_st/p; /^def read_st/,/^    return out/p' tests/lm/hf_fixture.py |
  grep -v '^def write_st' | { echo "import json, struct"; echo "import numpy as np"; cat; } >"$WORK/st.py"
if ! (cd "$WORK" && "$MOEC" import-hf mx -o lm --batch 2 --seqlen 16 --optimizer sgd --lr 0.05 --lora 4 \
        >imp.out 2>&1) || ! grep -q '^  lora { r 4; alpha 8; targets q k v o experts; }$' "$WORK/lm.moe" ||
   ! $PY -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])) != {"base_model_name_or_path": "mx"})' \
        "$WORK/lm.hf/adapter_config.json"; then
  bad "import-hf --lora 4 writes the lora block and lm.hf/adapter_config.json" "$(cat "$WORK/imp.out" "$WORK/lm.moe" 2>/dev/null | tail -n 20)"
  exit 1
fi
ok "import-hf --lora 4: 'lora { r 4; alpha 8; targets q k v o experts; }' in the .moe, lm.hf/adapter_config.json names the checkpoint (base_model_name_or_path \"mx\")"
if ! "$MOEC" build "$WORK/lm.moe" -o "$WORK/lm" 2>"$WORK/err"; then bad "build the LoRA model" "$(cat "$WORK/err")"; exit 1; fi

# Two SGD steps, then the adapter and a checkpoint of the trained parameters.
if ! (cd "$WORK" && ./lm --steps 2 --weights lm.safetensors --export-hf ad --save ck >run.out 2>&1) ||
   ! grep -q '^# wrote ad/adapter_config.json and ad/adapter_model.safetensors (a PEFT LoRA adapter)$' "$WORK/run.out"; then
  bad "--export-hf of the LoRA model" "$(tail -n 5 "$WORK/run.out")"; exit 1
fi
if $PY - "$WORK" >"$WORK/check.out" 2>&1 <<'EOF'
import glob, json, os, sys
import numpy as np
work = sys.argv[1]
sys.path.insert(0, work)
from st import read_st
ad = os.path.join(work, "ad")
assert sorted(os.listdir(ad)) == ["adapter_config.json", "adapter_model.safetensors"], os.listdir(ad)
cfg = json.load(open(os.path.join(ad, "adapter_config.json")))
want = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": ["experts.gate_up_proj", "experts.down_proj"], "base_model_name_or_path": "mx",
        "use_rslora": False, "use_dora": False}
diff = {k: cfg.get(k) for k in want if cfg.get(k) != want[k]}
assert not diff, diff
peft = read_st(os.path.join(ad, "adapter_model.safetensors"))
moec = {}
for f in glob.glob(os.path.join(work, "ck.rank*.safetensors")):
    moec.update(read_st(f))
r, E, M, I, Q, KV = 4, 4, 32, 40, 32, 16
pre = "base_model.model.model.layers.%d."
shapes = {}
for l in range(2):
    for p, out in (("q", Q), ("k", KV), ("v", KV), ("o", M)):
        shapes[pre % l + f"self_attn.{p}_proj.lora_A.weight"] = (r, Q if p == "o" else M)
        shapes[pre % l + f"self_attn.{p}_proj.lora_B.weight"] = (out, r)
    shapes[pre % l + "mlp.experts.base_layer.lora_A.weight"] = (r * E, M)   # gate_up_proj
    shapes[pre % l + "mlp.experts.base_layer.lora_B.weight"] = (2 * I, r * E)
    shapes[pre % l + "mlp.experts.lora_A.weight"] = (r * E, I)              # down_proj
    shapes[pre % l + "mlp.experts.lora_B.weight"] = (M, r * E)
got = {k: tuple(v.shape) for k, v in peft.items()}
assert got == shapes, (sorted(set(got) ^ set(shapes)), [(k, got[k], shapes[k]) for k in got if k in shapes and got[k] != shapes[k]])
# Each tensor is the trained moec adapter in PEFT's layout.
for l in range(2):
    m = f"moe{l}."
    for p in "qkvo":
        assert np.array_equal(peft[pre % l + f"self_attn.{p}_proj.lora_A.weight"], moec[m + f"attn.w{p}.lora_A"].T)
        assert np.array_equal(peft[pre % l + f"self_attn.{p}_proj.lora_B.weight"], moec[m + f"attn.w{p}.lora_B"].T)
    A1, B1, B3 = (moec[m + "moe.experts." + n] for n in ("w1.lora_A", "w1.lora_B", "w3.lora_B"))
    A2, B2 = moec[m + "moe.experts.w2.lora_A"], moec[m + "moe.experts.w2.lora_B"]
    assert m + "moe.experts.w3.lora_A" not in moec   # w3 shares w1's A
    # lora_A [r·E, in] is [E, r, in]: moec's A [E, in, r] transposed per expert
    assert np.array_equal(peft[pre % l + "mlp.experts.base_layer.lora_A.weight"].reshape(E, r, M), A1.transpose(0, 2, 1))
    assert np.array_equal(peft[pre % l + "mlp.experts.lora_A.weight"].reshape(E, r, I), A2.transpose(0, 2, 1))
    # lora_B [out, r·E] is [out, r, E] (the expert index the fast one): moec's B [E, r, out] as [out, r, E]
    gu = peft[pre % l + "mlp.experts.base_layer.lora_B.weight"].reshape(2 * I, r, E)
    assert np.array_equal(gu[:I], B1.transpose(2, 1, 0)) and np.array_equal(gu[I:], B3.transpose(2, 1, 0))
    assert np.array_equal(peft[pre % l + "mlp.experts.lora_B.weight"].reshape(M, r, E), B2.transpose(2, 1, 0))
    assert np.abs(B1).max() > 0 and np.abs(B2).max() > 0
print(f"{len(peft)} tensors")
EOF
then
  ok "--export-hf after 2 steps: adapter_config.json (peft_type LORA, r 4, lora_alpha 8, target_modules q/k/v/o_proj, target_parameters experts.gate_up_proj and experts.down_proj, base_model_name_or_path mx) and adapter_model.safetensors with PEFT's names and shapes ($(cat "$WORK/check.out")), each the trained moec adapter in PEFT's layout (experts [r·E, in] / [out, r·E], gate and up in one, w3 sharing w1's A)"
else
  bad "the exported adapter's files, names, shapes or layout" "$(cat "$WORK/check.out")"
fi

# --adapter: the exported adapter back, bit for bit (one rank, then dp2·ep2 with the experts' adapters split).
if (cd "$WORK" && ./lm --steps 0 --weights lm.safetensors --adapter ad --export-hf ad1 --quiet >rt.out 2>&1) &&
   cmp -s "$WORK/ad/adapter_model.safetensors" "$WORK/ad1/adapter_model.safetensors" &&
   cmp -s "$WORK/ad/adapter_config.json" "$WORK/ad1/adapter_config.json"; then
  ok "--adapter then --steps 0 --export-hf writes the adapter back bit for bit"
else
  bad "--adapter round trip" "$(cat "$WORK/rt.out")"
fi
first=$(grep -n '^layer ' "$WORK/lm.moe" | head -n 1 | cut -d: -f1)
for layout in "a 2 dp 2; ep 2;" "b 4 dp 2; mp 2; ep 2; esp 2;" "c 2 pp 2;"; do
  read -r id np par <<<"$layout"
  { head -n $((first - 1)) "$WORK/lm.moe"; echo "parallel { $par }"; tail -n +"$first" "$WORK/lm.moe"; } >"$WORK/lm$id.moe"
  if "$MOEC" build "$WORK/lm$id.moe" -o "$WORK/lm$id" 2>"$WORK/err" &&
     (cd "$WORK" && $MPIRUN -np "$np" ./lm$id --steps 0 --weights lm.safetensors --adapter ad --export-hf ad$id --quiet >rt$id.out 2>&1) &&
     cmp -s "$WORK/ad/adapter_model.safetensors" "$WORK/ad$id/adapter_model.safetensors"; then
    ok "--adapter on parallel { $par } ($np ranks, each its part of the adapters) then --export-hf: the adapter back bit for bit"
  else
    bad "--adapter on parallel { $par }" "$(cat "$WORK/err" "$WORK/rt$id.out" 2>/dev/null | tail -n 8)"
  fi
done

# --merge: with B zero the checkpoint itself; after training W + (alpha/r)·A·B.
if (cd "$WORK" && ./lm --steps 0 --weights lm.safetensors --export-hf m0 --merge --quiet >m0.out 2>&1) &&
   same=$($FIX same "$WORK/mx/model.safetensors" "$WORK/m0/model.safetensors" 2>&1) &&
   [ -f "$WORK/m0/config.json" ] && [ ! -f "$WORK/m0/adapter_config.json" ]; then
  ok "--export-hf --merge before training (B = 0): config.json and model.safetensors, the checkpoint itself ($same)"
else
  bad "--merge with B = 0 is not the checkpoint" "$(cat "$WORK/m0.out") ${same:-}"
fi
if (cd "$WORK" && ./lm --steps 0 --weights lm.safetensors --adapter ad --export-hf m1 --merge --quiet >m1.out 2>&1) &&
   $PY - "$WORK" >"$WORK/merge.out" 2>&1 <<'EOF'
import os, sys
import numpy as np
work = sys.argv[1]
sys.path.insert(0, work)
from st import read_st
base, merged = read_st(os.path.join(work, "mx/model.safetensors")), read_st(os.path.join(work, "m1/model.safetensors"))
ad = read_st(os.path.join(work, "ad/adapter_model.safetensors"))
assert sorted(base) == sorted(merged)
pre, s, r, E, I = "base_model.model.model.layers.%d.", 8 / 4, 4, 4, 40
worst, changed = 0.0, 0
def delta(a, b):   # PEFT's dense delta: scaling * B @ A, torch's [out, in]
    return s * b.astype(np.float64) @ a.astype(np.float64)
for name in base:
    want = base[name].astype(np.float64)
    for l in range(2):
        for p in "qkvo":
            if name == f"model.layers.{l}.self_attn.{p}_proj.weight":
                want = want + delta(ad[pre % l + f"self_attn.{p}_proj.lora_A.weight"], ad[pre % l + f"self_attn.{p}_proj.lora_B.weight"])
        for e in range(E):
            for w, key, rows in (("w1", "base_layer.", slice(0, I)), ("w3", "base_layer.", slice(I, 2 * I)), ("w2", "", slice(None))):
                if name == f"model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight":
                    A = ad[pre % l + f"mlp.experts.{key}lora_A.weight"].reshape(E, r, -1)[e]
                    B = ad[pre % l + f"mlp.experts.{key}lora_B.weight"]
                    B = B.reshape(B.shape[0], r, E)[rows, :, e]
                    want = want + delta(A, B)
    if np.array_equal(want, base[name]):   # not adapted: as it was
        assert np.array_equal(merged[name], base[name]), name
        continue
    changed += 1
    worst = max(worst, float(np.abs(merged[name] - want).max() / max(np.abs(want).max(), 1e-30)))
assert changed == 2 * (4 + 3 * E), changed
assert worst < 1e-6, worst
print(f"{changed} weights merged, within {worst:.1e} of W + (alpha/r)·B·A")
EOF
then
  ok "--export-hf --merge with the trained adapter: $(cat "$WORK/merge.out") (numpy from the adapter's tensors), the others bit for bit"
else
  bad "--merge with the trained adapter" "$(cat "$WORK/m1.out" "$WORK/merge.out" 2>/dev/null | tail -n 8)"
fi

# Qwen2-MoE (a dense layer, the shared expert): every target, the MLPs' weights as target_parameters.
if $FIX make "$WORK/qw" --family qwen2_moe &&
   (cd "$WORK" && "$MOEC" import-hf qw -o qwl --batch 2 --seqlen 8 --lora 2 --lora-alpha 4 \
      --lora-targets "q k v o experts shared mlp" >qimp.out 2>&1) &&
   grep -q '^  lora { r 2; alpha 4; targets q k v o experts shared mlp; }$' "$WORK/qwl.moe" &&
   "$MOEC" build "$WORK/qwl.moe" -o "$WORK/qwl" 2>"$WORK/err" &&
   (cd "$WORK" && ./qwl --steps 1 --weights qwl.safetensors --export-hf qad --quiet >q.out 2>&1) &&
   $PY - "$WORK" >"$WORK/qcheck.out" 2>&1 <<'EOF'
import json, os, sys
work = sys.argv[1]
sys.path.insert(0, work)
from st import read_st
cfg = json.load(open(os.path.join(work, "qad/adapter_config.json")))
mlp = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"], cfg["target_modules"]
assert cfg["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"] + ["mlp." + w for w in mlp] + \
    ["shared_expert." + w for w in mlp], cfg["target_parameters"]
assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (2, 4, "qw"), cfg
t = read_st(os.path.join(work, "qad/adapter_model.safetensors"))
pre = "base_model.model.model.layers.%d."
want = {pre % 1 + "mlp.gate_proj.lora_A.weight": (2, 32), pre % 1 + "mlp.down_proj.lora_B.weight": (32, 2),
        pre % 0 + "mlp.shared_expert.up_proj.lora_A.weight": (2, 32),
        pre % 2 + "mlp.shared_expert.down_proj.lora_A.weight": (2, 36),
        pre % 0 + "mlp.experts.base_layer.lora_B.weight": (48, 8), pre % 2 + "mlp.experts.lora_A.weight": (8, 24)}
for k, shape in want.items():
    assert k in t and tuple(t[k].shape) == shape, (k, shape)
assert not any("layers.1.mlp.experts" in k or "layers.1.mlp.shared" in k for k in t)   # layer 1 is dense
print(f"{len(t)} tensors")
EOF
then
  ok "Qwen2-MoE with targets q k v o experts shared mlp: target_modules q/k/v/o_proj, target_parameters the experts' tensors and the dense layer's and shared expert's weights (mlp.gate_proj.weight, shared_expert.gate_proj.weight, ...), $(cat "$WORK/qcheck.out") under PEFT's names"
else
  bad "Qwen2-MoE's adapter with every target" "$(cat "$WORK/qimp.out" "$WORK/err" "$WORK/q.out" "$WORK/qcheck.out" 2>/dev/null | tail -n 8)"
fi

# DeepSeek-V3 (latent attention): the projections' PEFT names, --adapter on one rank and dp2·mp2·ep4, --merge.
mla_case() {   # ID MLA-BLOCK MODULES: the checkpoint of grad_lm_mla.moe with every layer's attention MLA-BLOCK
  local id=$1 block=$2 modules=$3 first
  sed "s/mla { kv_lora 10; nope 6; rope 4; v 8; }/$block/; s/mla { q_lora 12; kv_lora 10; nope 6; rope 4; v 6; }/$block/" \
    tests/models/grad_lm_mla.moe >"$WORK/$id.moe"
  if ! { "$MOEC" build "$WORK/$id.moe" -o "$WORK/$id" 2>"$WORK/err" &&
         (cd "$WORK" && ./$id --steps 0 --export-hf ${id}hf --quiet >$id.out 2>&1 &&
          "$MOEC" import-hf ${id}hf -o ${id}l --batch 2 --seqlen 8 --optimizer sgd --lr 0.05 --lora 2 >>$id.out 2>&1) &&
         grep -q '^  lora { r 2; alpha 8; targets q k v o experts; }$' "$WORK/${id}l.moe" &&
         "$MOEC" build "$WORK/${id}l.moe" -o "$WORK/${id}l" 2>"$WORK/err" &&
         first=$(grep -n '^layer ' "$WORK/${id}l.moe" | head -n 1 | cut -d: -f1) &&
         { head -n $((first - 1)) "$WORK/${id}l.moe" | sed 's/batch 2;/batch 1;/'; echo "parallel { dp 2; mp 2; ep 4; }"
           tail -n +"$first" "$WORK/${id}l.moe"; } >"$WORK/${id}p.moe" &&
         "$MOEC" build "$WORK/${id}p.moe" -o "$WORK/${id}p" 2>"$WORK/err" &&
         (cd "$WORK" && ./${id}l --steps 2 --weights ${id}l.safetensors --export-hf ${id}ad --save ${id}ck --quiet >>$id.out 2>&1 &&
          ./${id}l --steps 0 --weights ${id}l.safetensors --adapter ${id}ad --export-hf ${id}ad1 --quiet >>$id.out 2>&1 &&
          $MPIRUN -np 4 ./${id}p --steps 0 --weights ${id}l.safetensors --adapter ${id}ad --export-hf ${id}ad4 --quiet >>$id.out 2>&1 &&
          ./${id}l --steps 0 --weights ${id}l.safetensors --adapter ${id}ad --export-hf ${id}m --merge --quiet >>$id.out 2>&1); }; then
    bad "DeepSeek-V3 $id: import-hf --lora, build, --export-hf, --adapter, --merge" "$(cat "$WORK/err" "$WORK/$id.out" 2>/dev/null | tail -n 8)"
    return
  fi
  if cmp -s "$WORK/${id}ad/adapter_model.safetensors" "$WORK/${id}ad1/adapter_model.safetensors" &&
     cmp -s "$WORK/${id}ad/adapter_model.safetensors" "$WORK/${id}ad4/adapter_model.safetensors" &&
     $PY - "$WORK" "$id" "$modules" >"$WORK/${id}check.out" 2>&1 <<'EOF'
import glob, json, os, sys
import numpy as np
work, id, modules = sys.argv[1], sys.argv[2], sys.argv[3].split()
sys.path.insert(0, work)
from st import read_st
cfg = json.load(open(os.path.join(work, id + "ad/adapter_config.json")))
assert cfg["target_modules"] == modules, cfg["target_modules"]
assert cfg["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"], cfg["target_parameters"]
peft = read_st(os.path.join(work, id + "ad/adapter_model.safetensors"))
moec = {}
for f in glob.glob(os.path.join(work, id + "ck.rank*.safetensors")):
    moec.update(read_st(f))
base, merged = read_st(os.path.join(work, id + "hf/model.safetensors")), read_st(os.path.join(work, id + "m/model.safetensors"))
moec_w = {"q_proj": "wq", "q_a_proj": "wq_a", "q_b_proj": "wq_b", "kv_a_proj_with_mqa": "wkv_a", "kv_b_proj": "wkv_b",
          "o_proj": "wo"}
pre, n, worst = "base_model.model.model.layers.%d.self_attn.%s.lora_%s.weight", 0, 0.0
for l, layer in enumerate(["dense0", "moe0", "moe1"]):
    for mod in modules:
        a, b = peft[pre % (l, mod, "A")], peft[pre % (l, mod, "B")]
        w = "%s.attn.%s" % (layer, moec_w[mod])
        assert np.array_equal(a, moec[w + ".lora_A"].T) and np.array_equal(b, moec[w + ".lora_B"].T), w
        assert np.abs(b).max() > 0, w   # trained
        name = "model.layers.%d.self_attn.%s.weight" % (l, mod)
        want = base[name].astype(np.float64) + 8 / 2 * b.astype(np.float64) @ a.astype(np.float64)
        worst = max(worst, float(np.abs(merged[name] - want).max() / np.abs(want).max()))
        n += 2
assert not [k for k in peft if "self_attn" in k and k.split(".")[-3] not in modules]
assert worst < 1e-6, worst
print(f"{n} attention tensors of {len(peft)}, merged within {worst:.1e}")
EOF
  then
    ok "DeepSeek-V3 $id: targets q k v o experts as target_modules $modules; $(cat "$WORK/${id}check.out") of W + (alpha/r)·B·A; --adapter on one rank and dp2·mp2·ep4 then --export-hf: the adapter back bit for bit"
  else
    bad "DeepSeek-V3 $id: the adapter of the latent attention" "$(cat "$WORK/${id}check.out" "$WORK/$id.out" 2>/dev/null | tail -n 8)"
  fi
}
mla_case dsq "mla { q_lora 12; kv_lora 10; nope 6; rope 4; v 6; }" "q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj"
mla_case ds "mla { kv_lora 10; nope 6; rope 4; v 8; }" "q_proj kv_a_proj_with_mqa kv_b_proj o_proj"

# Refusals, each a sentence naming both sides.
refused() {   # WHAT PATTERN CMD...: CMD fails and its output has PATTERN
  local what=$1 pattern=$2
  shift 2
  if (cd "$WORK" && "$@" >ref.out 2>&1); then bad "$what: accepted"; return; fi
  if grep -qF -- "$pattern" "$WORK/ref.out"; then ok "$what: $(grep -F -- "$pattern" "$WORK/ref.out" | head -n 1 | sed 's/^moert: error: //; s/^moec import-hf: error: //')"
  else bad "$what: not the expected sentence" "$(cat "$WORK/ref.out")"; fi
}
sed 's/lora { r 4; alpha 8;/lora { r 8; alpha 8;/' "$WORK/lm.moe" >"$WORK/r8.moe"
sed 's/lora { r 4; alpha 8;/lora { r 4; alpha 16;/' "$WORK/lm.moe" >"$WORK/a16.moe"
sed 's/targets q k v o experts;/targets q v experts;/' "$WORK/lm.moe" >"$WORK/qv.moe"
grep -v '^  lora {' "$WORK/lm.moe" >"$WORK/full.moe"
for m in r8 a16 qv full; do "$MOEC" build "$WORK/$m.moe" -o "$WORK/$m" 2>"$WORK/err" || bad "build $m.moe" "$(cat "$WORK/err")"; done
refused "an adapter of another r" "--adapter 'ad' has r 4 and lora_alpha 8; model 'mx' has r 8 and alpha 8 (its lora block)" \
  ./r8 --steps 0 --weights lm.safetensors --adapter ad
refused "an adapter of another alpha" "--adapter 'ad' has r 4 and lora_alpha 8; model 'mx' has r 4 and alpha 16 (its lora block)" \
  ./a16 --steps 0 --weights lm.safetensors --adapter ad
refused "an adapter of other targets" "the model's target_modules q_proj and v_proj, target_parameters experts.gate_up_proj and experts.down_proj (lora targets q v experts)" \
  ./qv --steps 0 --weights lm.safetensors --adapter ad
refused "--adapter on a model without lora" "--adapter: model 'mx' has no lora block" ./full --steps 0 --weights lm.safetensors --adapter ad
refused "--merge without --export-hf" "--merge needs --export-hf DIR" ./lm --steps 0 --weights lm.safetensors --merge
refused "--adapter with --resume" "--adapter and --resume cannot be combined" ./lm --steps 3 --resume ck --adapter ad
mkdir -p "$WORK/bad"
cp "$WORK/ad/adapter_model.safetensors" "$WORK/bad/"
$PY - "$WORK/ad/adapter_config.json" "$WORK/bad/adapter_config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["use_rslora"] = True
json.dump(c, open(sys.argv[2], "w"))
EOF
refused "an rsLoRA adapter" "--adapter 'bad' scales by lora_alpha/sqrt(r) (use_rslora); moec's adapters by alpha/r" \
  ./lm --steps 0 --weights lm.safetensors --adapter bad
refused "a folder without an adapter" "--adapter: cannot read 'mx/adapter_config.json'" ./lm --steps 0 --weights lm.safetensors --adapter mx
refused "import-hf --lora-targets shared on Mixtral" "--lora-targets shared: mx (mixtral) has no shared expert" \
  "$MOEC" import-hf mx -o x --lora 4 --lora-targets q,shared
refused "import-hf --lora-targets with an unknown word" "unknown target 'gate_proj': the targets are q, k, v, o, experts, shared and mlp" \
  "$MOEC" import-hf mx -o x --lora 4 --lora-targets q,gate_proj
refused "import-hf --lora-alpha without --lora" "--lora-alpha needs --lora R" "$MOEC" import-hf mx -o x --lora-alpha 16
refused "import-hf --lora-targets k without v on DeepSeek-V3" "--lora-targets k without v: dsqhf (deepseek_v3) has latent attention" \
  "$MOEC" import-hf dsqhf -o x --lora 2 --lora-targets q,k,o
exit $failed
