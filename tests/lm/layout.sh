#!/usr/bin/env bash
# Layout invariance of a language model: tests/models/grad_lm_gpt.moe on dp2·ep2 (2 ranks),
# dp2·mp2·ep4, dp4·ep2·esp2, dp4·ep4, dp2·mp2·ep2·esp2 (4 ranks) and dp4·mp2·ep4·esp2 (8 ranks)
# equal the single-rank run on the same global batch (batch dp·B, `groups dp·mp` so the routing
# groups match; MP shards attention by heads and the dense layer's mlp by hidden units): loss,
# logits and every whole gradient to 1e-5 of each tensor's largest element; and --check-grad passes
# on dp2·mp2·ep4. attn.bk's gradient is exactly zero with learned positions (softmax is shift-invariant),
# so it is held to 1e-5 of its layer's attn.wk gradient instead. One ok/FAIL line per layout.
# Then tests/models/grad_lm_qwen.moe (q/k/v biases without an o bias, head_dim apart from
# embed/heads, gates without renormalisation and a renormalised top-1) the same way on dp2·ep2,
# mp2·ep2 and dp2·mp2·ep2·esp2, with --check-grad on mp2·ep2.
# And tests/models/grad_lm_shared.moe (a shared SwiGLU expert beside the routed ones, gated by
# sigmoid(x·w) and ungated: replicated on every rank, its gradient summed over the world) on the
# same three layouts, with --check-grad on mp2·ep2.
# tests/models/grad_lm_qknorm.moe (Qwen3-MoE's per-head RMSNorm of q and k: each mp rank normalises
# its own heads, and the weight all heads share has its gradient summed over the world) and
# tests/models/grad_lm_window.moe (sliding windows of 3, 1 and the whole sequence) on the same
# three layouts, with --check-grad on mp2·ep2; tests/models/grad_lm_olmoe.moe (the norm over the
# whole width of q and k, which MP would split: refused there) on dp2·ep2 and dp4·ep2·esp2.
# tests/models/grad_lm_gorder.moe (order gshard, whose capacity buffers MP splits with the tokens;
# it did not build with mp > 1 before) on dp2·mp2·ep4 with --check-grad.
# tests/models/grad_lm_pooled.moe (`aux pooled`: one loss whose sums are reduced over every rank
# between the forward and the backward) on the same three layouts and dp4·ep4, with --check-grad
# on mp2·ep2.
# tests/models/grad_lm_glm.moe (GLM-4.5's parts: DeepSeek-V3's router with its correction bias, whose
# load is summed over the ranks, the partial rope, a dense first layer) on dp2·ep2 and on
# dp2·mp2·ep2·esp2 (4 ranks), with --check-grad there. tests/models/grad_lm_mla.moe (multi-head
# latent attention: MP splits its heads, the latent and the shared rope key replicated) on dp2·ep2,
# dp2·mp2·ep2·esp2 with --check-grad, and dp4·ep2·esp2. tests/models/grad_lm_sinks.moe (gpt-oss's
# attention sinks, split over MP with the heads, sliding windows, biased routers) on dp2·ep2,
# mp2·ep2 with --check-grad, and dp2·mp2·ep2·esp2.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
case "$MOEC" in /*) ;; *) MOEC=$(pwd)/$MOEC ;; esac
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-lm-layout.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
status=0
# entry "model:parallel body:ranks:dp:mp:check-grad (1: also --check-grad on this layout)"
for entry in "gpt:dp 2; ep 2;:2:2:1:0" "gpt:dp 2; mp 2; ep 4;:4:2:2:1" "gpt:dp 4; ep 2; esp 2;:4:4:1:0" \
             "gpt:dp 4; ep 4;:4:4:1:0" "gpt:dp 2; mp 2; ep 2; esp 2;:4:2:2:0" "gpt:dp 4; mp 2; ep 4; esp 2;:8:4:2:0" \
             "qwen:dp 2; ep 2;:2:2:1:0" "qwen:mp 2; ep 2;:2:1:2:1" "qwen:dp 2; mp 2; ep 2; esp 2;:4:2:2:0" \
             "shared:dp 2; ep 2;:2:2:1:0" "shared:mp 2; ep 2;:2:1:2:1" "shared:dp 2; mp 2; ep 2; esp 2;:4:2:2:0" \
             "qknorm:dp 2; ep 2;:2:2:1:0" "qknorm:mp 2; ep 2;:2:1:2:1" "qknorm:dp 2; mp 2; ep 2; esp 2;:4:2:2:0" \
             "window:dp 2; ep 2;:2:2:1:0" "window:mp 2; ep 2;:2:1:2:1" "window:dp 2; mp 2; ep 2; esp 2;:4:2:2:0" \
             "olmoe:dp 2; ep 2;:2:2:1:0" "olmoe:dp 4; ep 2; esp 2;:4:4:1:0" \
             "gorder:dp 2; mp 2; ep 4;:4:2:2:1" \
             "pooled:dp 2; ep 2;:2:2:1:0" "pooled:mp 2; ep 2;:2:1:2:1" "pooled:dp 2; mp 2; ep 2; esp 2;:4:2:2:0" \
             "pooled:dp 4; ep 4;:4:4:1:0" \
             "glm:dp 2; ep 2;:2:2:1:0" "glm:dp 2; mp 2; ep 2; esp 2;:4:2:2:1" \
             "mla:dp 2; ep 2;:2:2:1:0" "mla:dp 2; mp 2; ep 2; esp 2;:4:2:2:1" "mla:dp 4; ep 2; esp 2;:4:4:1:0" \
             "sinks:dp 2; ep 2;:2:2:1:0" "sinks:mp 2; ep 2;:2:1:2:1" "sinks:dp 2; mp 2; ep 2; esp 2;:4:2:2:0"; do
  IFS=: read -r model lay np dp mp grad <<<"$entry"
  M=$(pwd)/tests/models/grad_lm_$model.moe
  [ "$model" = gpt ] && lay_name="{ $lay }" || lay_name="$model { $lay }"
  # The single-rank twin depends on the model, dp and mp only: layouts that share them (gpt's
  # dp4·ep2·esp2 and dp4·ep4; dp2·mp2·ep4 and dp2·mp2·ep2·esp2) compare with one build and run.
  one=one.$model.$dp.$mp
  sed "s/^layer block x 2/parallel { $lay }\nlayer block x 2/" "$M" >"$WORK/many.moe"
  if [ ! -d "$WORK/$one.d" ]; then
    sed "s/batch 2;/batch $((2 * dp));/; s/capacity 0.5;/capacity 0.5; groups $((dp * mp));/" "$M" >"$WORK/$one.moe"
    if ! "$MOEC" build "$WORK/$one.moe" -o "$WORK/$one" 2>"$WORK/err"; then
      echo "FAIL  lm layout $lay_name: moec build (one rank)"; sed 's/^/      /' "$WORK/err" | head; status=1; continue
    fi
    if ! (cd "$WORK" && "./$one" --steps 1 --dump "$one.d" >one.out 2>&1); then
      echo "FAIL  lm layout $lay_name: the run on one rank failed"; tail -n 5 "$WORK/one.out" | sed 's/^/      /'; rm -rf "$WORK/$one.d"; status=1; continue
    fi
  fi
  if ! "$MOEC" build "$WORK/many.moe" -o "$WORK/many" 2>"$WORK/err"; then
    echo "FAIL  lm layout $lay_name: moec build"; sed 's/^/      /' "$WORK/err" | head; status=1; continue
  fi
  rm -rf "$WORK/d2"
  if ! (cd "$WORK" && $MPIRUN -np "$np" ./many --steps 1 --dump d2 >many.out 2>&1); then
    echo "FAIL  lm layout $lay_name: a run failed"; tail -n 5 "$WORK/many.out" | sed 's/^/      /'; status=1; continue
  fi
  if why=$(/usr/bin/python3 - "$WORK/$one.d" "$WORK/d2" <<'PY'
import glob, os, sys
import numpy as np
a_dir, b_dir = sys.argv[1], sys.argv[2]
worst, n, bad = 0.0, 0, []
for f in sorted(glob.glob(os.path.join(a_dir, "**", "*.npy"), recursive=True)):
    rel = os.path.relpath(f, a_dir)
    a = np.load(f).astype(np.float64); b = np.load(os.path.join(b_dir, rel)).astype(np.float64)
    if a.shape != b.shape:
        bad.append("%s: shape %s against %s" % (rel, a.shape, b.shape)); continue
    scale = np.abs(a).max()
    if rel.endswith("attn.bk.npy"):
        scale = np.abs(np.load(f.replace("attn.bk", "attn.wk"))).max()
    e = np.abs(a - b).max() / max(scale, 1e-30)
    worst = max(worst, e); n += 1
    if e > 1e-5: bad.append("%s: %.3e" % (rel, e))
if bad:
    print("; ".join(bad[:8])); sys.exit(1)
print("%d tensors, worst %.2e" % (n, worst))
PY
  ); then echo "ok    lm layout $lay_name on $np ranks = one rank (loss, logits, every gradient: $why)"
  else echo "FAIL  lm layout $lay_name differs from one rank: $why"; status=1; fi
  # The layouts with MP and EP: --check-grad on their ranks too (every rank perturbs its copy).
  if [ "$grad" = 1 ]; then
    if (cd "$WORK" && timeout 300 $MPIRUN -np "$np" ./many --check-grad >grad.out 2>&1) && [ "$(tail -n 1 "$WORK/grad.out")" = OK ]; then
      echo "ok    lm --check-grad on $lay_name ($(grep -o '[0-9]* entries checked, [0-9]* skipped' "$WORK/grad.out"))"
    else
      echo "FAIL  lm --check-grad on $lay_name"; grep -v ' OK$' "$WORK/grad.out" | tail -n 8 | sed 's/^/      /'; status=1
    fi
  fi
done
exit $status
