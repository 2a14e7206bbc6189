#!/usr/bin/python3
"""Holds language models built by `build/moec` (lang/manual.md §7.2) against the numpy reference
tests/ref/lm_ref.py.

For each config: writes F.moe (a model with `vocab`), random float32 weights of every parameter
(W.safetensors, whole tensors) and random tokens (tokens.npy, int32 [B, L+1] in [0, V)) into a
temporary folder, runs `moec build F.moe -o BIN` and `BIN --steps 1 --weights W.safetensors
--input tokens.npy --dump DIR`, and compares DIR/tokens.npy (exactly), DIR/logits.npy [B, L, V],
DIR/loss.npy (the total), DIR/ce.npy and DIR/grad/NAME.npy of every parameter with the
reference (float64), one line per tensor (`NAME ok` / `NAME FAIL err`):
    err = max|a - b| / max(max|b|, floor) <= 1e-5,
floor 1e-6, except `attn.bk` with learned positions, whose exact gradient is 0 (softmax is
shift-invariant) unless the layer has a qk_norm: it is compared relative to max|grad attn.wk| of its layer (float32 leaves
rounding noise of about 1e-7 of that). Weights and tokens are redrawn until no routing decision
is within 1e-4 of a tie, so float32 and float64 route the same way.

`--fake` runs no moec: the "binary" is lm_ref computing in float32 (its MoE layers stay
float64), which checks this harness (names, shapes, files, tolerances) and estimates the rounding
a float32 binary leaves; it is not a test of moec.

Models with `lora` (LoRA, issue 63) compare the gradients of the trained adapters (lora_A,
lora_B) only, fail on any grad/ file of a frozen parameter, check the header's `# trained: N
floats` against the adapters' size, and run `BIN --steps 0 --save C`: the checkpoint's initial
lora_A must equal lm_ref.lora_init (moert's uniform draw) bit for bit, lora_B be 0 and lora_scale
alpha/r. The weights file gives lora_A and lora_B random values (both non-zero) and lora_scale
alpha/r.

Any failure (a build, a run, a tensor out of tolerance) exits 1. Exits 77 when build/moec is
missing.

    /usr/bin/python3 tests/ref/test_lm_ref.py [--keep] [--only NAME[,NAME...]] [--list] [--fake]
Environment: MOEC (path of moec; default $BUILD/moec, BUILD default build), from the repo root.
"""
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import lm_ref  # noqa: E402
import moe_ref  # noqa: E402
from test_ref import moe_block  # noqa: E402

TOL = 1e-5
FLOOR = 1e-6
B, L, M, V, E, H, SEED = 2, 8, 16, 32, 4, 32, 7

GPT_FFN = dict(experts=E, hidden=H, ffn="gpt", act="gelu")
MIX_FFN = dict(experts=E, hidden=H, ffn="mixtral")
OSS_FFN = dict(experts=E, hidden=H, ffn="oss")
LOSSES = dict(aux_loss=0.01, z_loss=0.001)

# (name, model fields (lm_ref.LMModel keywords; theta / eps only when written), layer items
# (lm_ref.LMModel items), options: expect "drops" / "nodrop")
CONFIGS = [
    # GPT-2 style (the example of the brief): layernorm, learned positions, attention biases,
    # tied embeddings; two MoE layers and a dense one
    ("a_gpt", dict(position="learned", norm="layernorm", tie_embeddings=True),
     [("block", 2, dict(attention=dict(heads=2),
                        moe=dict(GPT_FFN, k=2, capacity=1.0, **LOSSES))),
      ("dense", 1, dict(attention=dict(heads=2), mlp=dict(ffn="gpt", hidden=H, act="gelu")))],
     {}),
    # Llama/Mixtral style: rmsnorm, rope, GQA 4/2 without biases, mixtral experts, k 1 with
    # gate noise, untied head
    ("b_llama", dict(position="rope", norm="rmsnorm", tie_embeddings=False),
     [("block", 2, dict(attention=dict(heads=4, kv_heads=2, bias=False),
                        moe=dict(MIX_FFN, k=1, capacity=1.0, noise=1.0, **LOSSES)))],
     dict(expect="drops")),
    # a dense layer first (the MoE layer's gate noise is global layer 1's), rope with its own
    # theta, layernorm with its own eps, MQA (kv_heads 1), groups 2, a mixtral mlp last
    ("c_dense_first", dict(position="rope", theta=500.0, norm="layernorm", eps=1e-6,
                           tie_embeddings=False),
     [("dense", 1, dict(attention=dict(heads=2, kv_heads=1),
                        mlp=dict(ffn="gpt", hidden=H, act="gelu", bias=False))),
      ("moe", 1, dict(attention=dict(heads=4),
                      moe=dict(GPT_FFN, k=2, capacity=0.75, groups=2, noise=1.0, aux_loss=0.05,
                               z_loss=0.01))),
      ("tail", 1, dict(attention=dict(heads=2, bias=False), mlp=dict(ffn="mixtral", hidden=H)))],
     dict(expect="drops")),
    # the other gates inside a language model: sigmoid, xmoe (noise, gshard order),
    # expert_choice (groups 2), softmoe; rmsnorm with its own eps, learned positions, tied
    ("d_gates", dict(position="learned", norm="rmsnorm", eps=1e-6, tie_embeddings=True),
     [("sig", 1, dict(attention=dict(heads=2),
                      moe=dict(MIX_FFN, gate="sigmoid", k=2, capacity=1.0, **LOSSES))),
      ("xm", 1, dict(attention=dict(heads=2, bias=False),
                     moe=dict(GPT_FFN, gate="xmoe", k=1, capacity=1.0, proj=8, noise=1.0,
                              order="gshard", z_loss=0.01))),
      ("ec", 1, dict(attention=dict(heads=4, kv_heads=2),
                     moe=dict(GPT_FFN, gate="expert_choice", k=1, capacity=1.0, groups=2,
                              z_loss=0.01))),
      ("soft", 1, dict(attention=dict(heads=2), moe=dict(MIX_FFN, gate="softmoe", slots=2)))],
     {}),
    # dropless gshard k 2 with groups 2 (gshard order), relu experts without bias
    ("e_dropless", dict(position="rope", norm="rmsnorm", tie_embeddings=True),
     [("block", 2, dict(attention=dict(heads=2, kv_heads=2),
                        moe=dict(GPT_FFN, act="relu", bias=False, k=2, capacity="*", groups=2,
                                 order="gshard", noise=1.0, **LOSSES)))],
     dict(expect="nodrop")),
    # Qwen2-MoE / Qwen3-MoE style (lang/manual.md §19): q, k, v biases without an o bias (`bias qkv`),
    # heads of head_dim 6 apart from embed/heads = 4 (Wq [16, 24], Wo [24, 16]), the raw
    # softmax scores as gates (`renormalize false`, dropless); a dense layer of head_dim 2
    ("f_qwen", dict(position="rope", norm="rmsnorm", eps=1e-6, tie_embeddings=False),
     [("block", 2, dict(attention=dict(heads=4, kv_heads=2, head_dim=6, bias="qkv"),
                        moe=dict(MIX_FFN, k=2, capacity="*", renormalize=False, **LOSSES))),
      ("dense", 1, dict(attention=dict(heads=4, kv_heads=4, head_dim=2, bias="qkv"),
                        mlp=dict(ffn="mixtral", hidden=H)))],
     dict(expect="nodrop")),
    # learned positions with head_dim 10 and 3 (odd: no rope) and bias qkv (bk's gradient is 0),
    # Mixtral's top-1 renormalised (every gate 1) with drops, xmoe k 2 not renormalised
    ("g_head_dim_renorm", dict(position="learned", norm="layernorm", tie_embeddings=True),
     [("mx", 1, dict(attention=dict(heads=2, head_dim=10, bias="qkv"),
                     moe=dict(GPT_FFN, k=1, capacity=0.75, renormalize=True, noise=1.0,
                              **LOSSES))),
      ("xm", 1, dict(attention=dict(heads=4, kv_heads=1, head_dim=3, bias="qkv"),
                     moe=dict(GPT_FFN, gate="xmoe", k=2, capacity=1.0, proj=8,
                              renormalize=False, z_loss=0.01)))],
     dict(expect="drops")),
    # Qwen2-MoE (lang/manual.md §19): the routed experts' raw softmax scores as gates plus the shared
    # SwiGLU expert times sigmoid(x.wsg) per token (`shared { ffn mixtral { hidden 24; } gate
    # sigmoid; }`), q/k/v biases; then an ungated shared expert (DeepSeek's) beside a top-1
    ("h_qwen2_shared", dict(position="rope", norm="rmsnorm", eps=1e-6, tie_embeddings=False),
     [("block", 2, dict(attention=dict(heads=4, kv_heads=2, bias="qkv"),
                        moe=dict(MIX_FFN, k=2, capacity=0.75, renormalize=False, shared_hidden=24,
                                 shared_gate=True, noise=1.0, **LOSSES))),
      ("top1", 1, dict(attention=dict(heads=2, bias="qkv"),
                       moe=dict(MIX_FFN, k=1, capacity="*", shared_hidden=8, **LOSSES)))],
     dict(expect="drops")),
    # Qwen3-MoE (lang/manual.md §19): RMSNorm of each head of q and k (`qk_norm head`: q_norm.weight and
    # k_norm.weight [head_dim], shared by the heads) after the projections, before rope, head_dim
    # 6 apart from embed/heads, GQA 4/2, no biases, renormalised top-2; then Mixtral's sliding
    # window (`window 3` of seqlen 8: query i sees keys i-2..i) under the per-head norm, and a
    # window of 1 (each query sees only itself)
    ("i_qwen3_norm_window", dict(position="rope", norm="rmsnorm", eps=1e-6, tie_embeddings=False),
     [("block", 2, dict(attention=dict(heads=4, kv_heads=2, head_dim=6, bias=False, qk_norm="head"),
                        moe=dict(MIX_FFN, k=2, capacity="*", renormalize=True, **LOSSES))),
      ("win", 1, dict(attention=dict(heads=4, kv_heads=2, head_dim=6, bias=False, qk_norm="head",
                                     window=3),
                      moe=dict(MIX_FFN, k=2, capacity=0.75, **LOSSES))),
      ("one", 1, dict(attention=dict(heads=2, kv_heads=1, bias=False, window=1),
                      mlp=dict(ffn="mixtral", hidden=H)))],
     dict(expect="drops")),
    # OLMoE (lang/manual.md §19): RMSNorm over the whole width of q (weight [H*d]) and k ([KV*d]), the
    # raw softmax scores as gates (dropless); learned positions with q/k/v biases and a window of
    # 5 in the second layer, layernorm (whose eps the qk norm shares), tied embeddings
    ("j_olmoe_window", dict(position="learned", norm="layernorm", eps=1e-6, tie_embeddings=True),
     [("block", 1, dict(attention=dict(heads=4, kv_heads=2, bias="qkv", qk_norm="whole"),
                        moe=dict(MIX_FFN, k=2, capacity="*", renormalize=False, **LOSSES))),
      ("win", 1, dict(attention=dict(heads=2, bias=True, qk_norm="whole", window=5),
                      moe=dict(GPT_FFN, k=1, capacity="*", **LOSSES)))],
     dict(expect="nodrop")),
    # transformers' load-balancing loss (`aux pooled`): one loss over a renormalised top-2 layer
    # with drops and a raw-score top-1 one, Mixtral-style; the per-group aux in a gpt layer beside
    ("k_pooled_aux", dict(position="rope", norm="rmsnorm", eps=1e-5, tie_embeddings=False),
     [("block", 2, dict(attention=dict(heads=4, kv_heads=2, bias=False),
                        moe=dict(MIX_FFN, k=2, capacity=0.75, renormalize=True, aux_loss=0.2,
                                 aux="pooled", z_loss=0.001))),
      ("top1", 1, dict(attention=dict(heads=2, bias=False),
                       moe=dict(MIX_FFN, k=1, capacity="*", aux_loss=0.2, aux="pooled"))),
      ("grp", 1, dict(attention=dict(heads=2, bias=False),
                      moe=dict(GPT_FFN, k=1, capacity=1.0, **LOSSES)))],
     dict(expect="drops")),
    # DeepSeek-V2/V3's multi-head latent attention: with q LoRA and biases (the down projections'
    # and o), yarn (both mscales: the scores scaled too; untruncated) and rope on adjacent pairs;
    # then without q LoRA, v narrower than nope + rope, a window of 3 and sinks
    ("m_deepseek_mla", dict(position="rope", norm="rmsnorm", eps=1e-6, tie_embeddings=False, interleave=True,
                            yarn=dict(factor=4.0, original=4, beta_fast=32.0, beta_slow=1.0, mscale=0.8,
                                      mscale_all_dim=0.6, truncate=False)),
     [("ql", 1, dict(attention=dict(heads=4, bias=True, mla=dict(q_lora=6, kv_lora=5, nope=4, rope=4, v=6)),
                     moe=dict(MIX_FFN, k=2, capacity="*", renormalize=True, **LOSSES))),
      ("kv", 1, dict(attention=dict(heads=2, bias=False, window=3, sinks=True,
                                    mla=dict(q_lora=0, kv_lora=4, nope=6, rope=2, v=4)),
                     moe=dict(MIX_FFN, k=2, capacity=0.75, **LOSSES)))],
     dict(expect="drops")),
    # gpt-oss's attention: learned sinks (a logit per head in each row's softmax, no value) under a
    # sliding window of 3 and over the whole sequence, q/k/v and o biases, GQA 4/2; its router
    # (a bias is the gate's own; top-k then softmax over the chosen: renormalised)
    ("l_gpt_oss_sinks", dict(position="rope", norm="rmsnorm", eps=1e-5, tie_embeddings=False),
     [("slide", 1, dict(attention=dict(heads=4, kv_heads=2, bias=True, window=3, sinks=True),
                        moe=dict(MIX_FFN, k=2, capacity="*", renormalize=True, **LOSSES))),
      ("full", 1, dict(attention=dict(heads=4, kv_heads=2, bias=True, sinks=True),
                       moe=dict(MIX_FFN, k=2, capacity=0.75, renormalize=True, **LOSSES)))],
     dict(expect="drops")),
    # LoRA (issue 63): only the adapters lora_A [in, r] and lora_B [r, out] are trained, each
    # adapted weight's output + ((x.A) * lora_scale).B; every other parameter frozen (no grad/
    # file). GPT-style with targets q k v o mlp: the four attention projections (after their
    # biases), a gpt mlp with biases and a mixtral mlp (w1 w3 w2); the MoE layers' experts stay
    # frozen
    ("n_lora_gpt", dict(position="learned", norm="layernorm", tie_embeddings=True,
                        lora=dict(r=2, alpha=6.0, targets=("q", "k", "v", "o", "mlp"))),
     [("block", 2, dict(attention=dict(heads=2),
                        moe=dict(GPT_FFN, k=2, capacity=1.0, **LOSSES))),
      ("dense", 1, dict(attention=dict(heads=2), mlp=dict(ffn="gpt", hidden=H, act="gelu"))),
      ("tail", 1, dict(attention=dict(heads=4, kv_heads=2, bias=False), mlp=dict(ffn="mixtral", hidden=H)))],
     {}),
    # Mixtral-style with targets q v experts (r 3: alpha/r 4/3 is no power of two): per-expert
    # adapters A [E, in, r], B [E, r, out] on w1 w3 w2 of the routed experts (w3 with w1's A and
    # scale, its own B: PEFT's one adapter of gate_up_proj), GQA 4/2 without
    # biases, k 2 with drops and gate noise
    ("o_lora_mixtral", dict(position="rope", norm="rmsnorm", tie_embeddings=False,
                            lora=dict(r=3, alpha=4.0, targets=("q", "v", "experts"))),
     [("block", 2, dict(attention=dict(heads=4, kv_heads=2, bias=False),
                        moe=dict(MIX_FFN, k=2, capacity=1.0, noise=1.0, **LOSSES)))],
     dict(expect="drops")),
    # targets shared experts: Qwen2-MoE's gated shared expert (its w1 w3 w2 adapted, then times
    # sigmoid(x.wsg)) beside mixtral experts; an ungated shared expert beside gpt experts with
    # biases (the adapters before b1, b2); gpt-oss's experts (before b1 b3 b2), no shared expert
    ("p_lora_shared", dict(position="rope", norm="rmsnorm", eps=1e-6, tie_embeddings=False,
                           lora=dict(r=4, alpha=10.0, targets=("shared", "experts"))),
     [("qw", 1, dict(attention=dict(heads=4, kv_heads=2, bias="qkv"),
                     moe=dict(MIX_FFN, k=2, capacity=0.75, renormalize=False, shared_hidden=24,
                              shared_gate=True, noise=1.0, **LOSSES))),
      ("ds", 1, dict(attention=dict(heads=2, bias=False),
                     moe=dict(GPT_FFN, act="relu", k=1, capacity="*", shared_hidden=8, **LOSSES))),
      ("oss", 1, dict(attention=dict(heads=2, bias=True),
                      moe=dict(OSS_FFN, k=2, capacity="*", renormalize=True, **LOSSES)))],
     dict(expect="drops")),
    # targets q k v o experts on DeepSeek's latent attention: q's wq_a and wq_b (q_lora) or wq, the
    # latent's wkv_a and wkv_b (k and v together), wo, and the routed experts; m_deepseek_mla's
    # layers (biases on the down projections before their adapters, yarn, rope on adjacent pairs)
    ("q_lora_mla", dict(position="rope", norm="rmsnorm", eps=1e-6, tie_embeddings=False, interleave=True,
                        yarn=dict(factor=4.0, original=4, beta_fast=32.0, beta_slow=1.0, mscale=0.8,
                                  mscale_all_dim=0.6, truncate=False),
                        lora=dict(r=2, alpha=4.0, targets=("q", "k", "v", "o", "experts"))),
     [("ql", 1, dict(attention=dict(heads=4, bias=True, mla=dict(q_lora=6, kv_lora=5, nope=4, rope=4, v=6)),
                     moe=dict(MIX_FFN, k=2, capacity="*", renormalize=True, **LOSSES))),
      ("kv", 1, dict(attention=dict(heads=2, bias=False, mla=dict(q_lora=0, kv_lora=4, nope=6, rope=2, v=4)),
                     moe=dict(MIX_FFN, k=2, capacity=0.75, **LOSSES)))],
     dict(expect="drops")),
    # squared ReLU (act relu2): gpt experts with drops, then a dense mlp without biases
    ("q_relu2", dict(position="rope", norm="rmsnorm", tie_embeddings=True),
     [("block", 2, dict(attention=dict(heads=2),
                        moe=dict(GPT_FFN, act="relu2", k=2, capacity=0.75, noise=1.0, **LOSSES))),
      ("dense", 1, dict(attention=dict(heads=2), mlp=dict(ffn="gpt", hidden=H, act="relu2", bias=False)))],
     dict(expect="drops")),
]


def make_model(fields, items):
    return lm_ref.LMModel(vocab=V, batch=B, seqlen=L, embed=M, items=items, seed=SEED, **fields)


def lm_text(model_name, fields, items):
    """The .moe source of a config (lang/manual.md §7.2's syntax)."""
    pos = fields.get("position", "learned") + ";"          # a block takes no `;` after it
    if fields.get("position") == "rope" and ("theta" in fields or "yarn" in fields or "interleave" in fields):
        inner = "theta %r;" % float(fields.get("theta", 10000.0))
        if fields.get("interleave"):
            inner += " interleave true;"
        y = fields.get("yarn")
        if y:
            inner += " yarn { factor %r; original %d; beta_fast %r; beta_slow %r;" % (
                float(y["factor"]), y["original"], float(y.get("beta_fast", 32.0)), float(y.get("beta_slow", 1.0)))
            for k in ("mscale", "mscale_all_dim"):
                if y.get(k):
                    inner += " %s %r;" % (k, float(y[k]))
            inner += "" if y.get("truncate", True) else " truncate false;"
            inner += " }"
        pos = "rope { %s }" % inner
    norm = fields.get("norm", "layernorm") + ";"
    if "eps" in fields:
        norm = norm[:-1] + " { eps %r; }" % float(fields["eps"])
    out = ["# generated by tests/ref/test_lm_ref.py",
           "model %s {" % model_name,
           "  dtype fp32;", "  batch %d;" % B, "  seqlen %d;" % L, "  embed %d;" % M,
           "  seed %d;" % SEED, "  vocab %d;" % V, "  position %s" % pos, "  norm %s" % norm,
           "  tie_embeddings %s;" % ("true" if fields.get("tie_embeddings", True) else "false"),
           "  optimizer sgd { lr 0.01; }"]
    lo = fields.get("lora")
    if lo:
        out.append("  lora { r %d; alpha %r; targets %s; }" % (lo["r"], float(lo["alpha"]), " ".join(lo["targets"])))
    out += ["}", ""]
    for name, repeat, kw in items:
        at = kw["attention"]
        fields_at = ["heads %d;" % at["heads"]]
        if "kv_heads" in at:
            fields_at.append("kv_heads %d;" % at["kv_heads"])
        if at.get("head_dim") is not None:
            fields_at.append("head_dim %d;" % at["head_dim"])
        if "bias" in at:
            fields_at.append("bias %s;" % {True: "true", False: "false", "qkv": "qkv"}[at["bias"]])
        if at.get("qk_norm"):
            fields_at.append("qk_norm %s;" % at["qk_norm"])
        if at.get("window"):
            fields_at.append("window %d;" % at["window"])
        if at.get("sinks"):
            fields_at.append("sinks true;")
        if at.get("mla"):
            m = at["mla"]
            fields_at.append("mla { %skv_lora %d; nope %d; rope %d; v %d; }" % (
                "q_lora %d; " % m["q_lora"] if m.get("q_lora") else "", m["kv_lora"], m["nope"], m["rope"], m["v"]))
        out.append("layer %s%s {" % (name, " x %d" % repeat if repeat != 1 else ""))
        out.append("  attention { %s }" % " ".join(fields_at))
        if "moe" in kw:
            out += moe_block(kw["moe"], indent="  ")
        else:
            mlp = kw["mlp"]
            if mlp.get("ffn", "gpt") == "mixtral":
                ffn = "ffn mixtral { hidden %d; }" % mlp["hidden"]
            else:
                ffn = "ffn gpt { hidden %d; act %s; bias %s; }" % (
                    mlp["hidden"], mlp.get("act", "gelu"), "true" if mlp.get("bias", True) else "false")
            out.append("  mlp { %s }" % ffn)
        out += ["}", ""]
    return "\n".join(out)


def draw(model, rng):
    """float32 weights of every parameter (norm weights near 1; lora_A and lora_B random, both
    non-zero, so that every adapter has a gradient; lora_scale alpha/r) and int32 tokens [B, L+1]."""
    params = {}
    for n, sh in model.param_shapes().items():
        if n.endswith(".lora_scale"):                       # the frozen alpha/r, every element
            v = np.full(sh, model.lora["alpha"] / model.lora["r"])
        elif n.endswith("norm.weight"):
            v = 1.0 + 0.2 * rng.standard_normal(sh)
        elif n.endswith("norm.bias"):
            v = 0.1 * rng.standard_normal(sh)
        elif n.endswith("gate.temperature"):
            v = np.asarray(0.5 + 0.3 * rng.random())
        elif n.startswith("embed."):
            v = 0.5 * rng.standard_normal(sh)
        elif n.endswith((".lora_A", ".lora_B")):          # x.A.B*s about half of x.W
            v = 0.2 * rng.standard_normal(sh)
        else:
            v = 0.3 * rng.standard_normal(sh)
        params[n] = np.asarray(v, dtype=np.float32)
    return params, lm_ref.random_tokens(model, rng)


# ---------------------------------------------------------------- report
class Report:
    def __init__(self):
        self.failures = []
        self.worst = (0.0, "")
        self.count = 0
        print("# moec language models: binary (fp32) vs tests/ref/lm_ref.py (float64)")
        print("# err = max|a-b| / max(max|ref|, floor) per tensor, tolerance %g, floor %g "
              "(learned-position attn.bk: max|grad attn.wk|)" % (TOL, FLOOR))

    def row(self, config, name, got, want, tol=TOL, floor=FLOOR):
        want = np.asarray(want, dtype=np.float64)
        tag = "%s %s" % (config, name)
        if got is None:
            print("  %s FAIL missing" % tag)
            self.failures.append(tag + " missing")
            return
        got = np.asarray(got, dtype=np.float64)
        if got.size == 1 and want.size == 1:        # a scalar dumped as [] or [1]
            got, want = got.reshape(()), want.reshape(())
        if got.shape != want.shape:
            print("  %s FAIL shape %s, reference %s" % (tag, got.shape, want.shape))
            self.failures.append("%s shape %s != %s" % (tag, got.shape, want.shape))
            return
        diff = float(np.abs(got - want).max()) if got.size else 0.0
        scale = max(float(np.abs(want).max()) if want.size else 0.0, floor)
        err = diff / scale if np.isfinite(diff) else math.inf
        self.count += 1
        if err > self.worst[0] or not self.worst[1]:
            self.worst = (err, tag)
        if err <= tol:
            print("  %s ok %.2e (scale %.3e, %d values)" % (tag, err, scale, want.size))
        else:
            print("  %s FAIL %.3e (scale %.3e, max|diff| %.3e, %d values)"
                  % (tag, err, scale, diff, want.size))
            self.failures.append("%s err %.3e" % (tag, err))

    def note(self, msg):
        print("# " + msg)

    def fail(self, msg):
        print("# FAILED: " + msg)
        self.failures.append(msg)


def run(cmd, cwd=None):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def load(dump, rel):
    p = os.path.join(dump, rel)
    return moe_ref.load_npy(p) if os.path.exists(p) else None


def step_line(stdout):
    for line in stdout.splitlines():
        if re.match(r"\s*step\s+1\b", line):
            return line
    return None


def check_step_line(rep, cname, stdout, want):
    """The `step 1` line: loss and ce (when printed) to their printed precision; aux, z and the
    gradient norm are noted (the line's exact form for language models is not fixed)."""
    gnorm = math.sqrt(sum(float((g ** 2).sum()) for g in want["grads"].values()))
    rep.note("%s: ref loss %.6f ce %.6f aux %.6f z %.6f (unweighted sums over MoE layers), "
             "grad norm %.6f" % (cname, want["loss"], want["ce"], want["aux"], want["z"], gnorm))
    line = step_line(stdout)
    if line is None:
        rep.fail("%s: no `step 1 ...` line in the binary's stdout:\n%s" % (cname, stdout))
        return
    rep.note("%s: bin line: %s" % (cname, line.strip()))
    for label, ref_v in (("loss", want["loss"]), ("ce", want["ce"])):
        m = re.search(r"\b%s\s+([-+0-9.eEinfna]+)" % label, line)
        if m:
            try:
                got = float(m.group(1))
            except ValueError:
                got = math.nan
            decimals = len(m.group(1).split(".")[1]) if "." in m.group(1) and "e" not in m.group(1).lower() else 6
            if not abs(got - ref_v) <= 0.51 * 10.0 ** -decimals + TOL * abs(ref_v):
                rep.fail("%s: step line %s %s, reference %.8f" % (cname, label, m.group(1), ref_v))


def check_trained_line(rep, cname, stdout, floats):
    """The header's `# trained: N floats (P %), the rest frozen` line (runtime/main.c), when
    printed: N must be the reference's count of lora_A and lora_B values."""
    m = re.search(r"^# trained: (\d+) floats", stdout, re.M)
    if m is None:
        rep.note("%s: no `# trained: N floats` line in the binary's stdout" % cname)
    elif int(m.group(1)) != floats:
        rep.fail("%s: the binary trains %s floats, the reference's adapters have %d" % (cname, m.group(1), floats))
    else:
        print("  %s trained floats ok (%d, the adapters' lora_A and lora_B)" % (cname, floats))


def check_lora_init(rep, cname, model, bin_path, d):
    """`BIN --steps 0 --save C` writes the initial parameters (nothing trained): every lora_A
    must equal lm_ref.lora_init's uniform formula bit for bit, every lora_B be 0 and every
    lora_scale (float)(alpha/r)."""
    ck = os.path.join(d, "init.ckpt")
    r = run([bin_path, "--steps", "0", "--save", ck, "--quiet"], cwd=d)
    shard = ck + ".rank0-of-1.safetensors"
    if r.returncode != 0 or not os.path.exists(shard):
        rep.fail("%s: `--steps 0 --save` exited %d, %s:\n%s%s" % (cname, r.returncode, shard, r.stdout, r.stderr))
        return
    got, _ = moe_ref.load_safetensors(shard)
    shapes, counts = model.param_shapes(), {}
    names = sorted(n for n in shapes if ".lora_" in n)
    unknown = sorted(n for n in got if ".lora_" in n and n not in shapes)
    if unknown:
        rep.fail("%s: init: adapter tensors the reference does not have: %s" % (cname, ", ".join(unknown)))
    for name in names:
        part = name.rsplit(".", 1)[1]
        want = lm_ref.lora_init(model, name, shapes[name])
        g = got.get(name)
        if g is None or g.dtype != np.float32 or g.shape != want.shape:
            rep.fail("%s: init %s: %s, reference float32 %s" % (
                cname, name, "missing" if g is None else "%s %s" % (g.dtype, g.shape), want.shape))
            continue
        differ = g.view(np.uint32) != want.view(np.uint32)
        if differ.any():
            i = int(np.argmax(differ.ravel()))
            rep.fail("%s: init %s: %d of %d values differ (first at %d: %r, reference %r)" % (
                cname, name, int(differ.sum()), want.size, i, float(g.ravel()[i]), float(want.ravel()[i])))
            continue
        counts[part] = counts.get(part, 0) + want.size
        if part == "lora_A":
            print("  %s init %s exact (%d values, within +-%.4f)" % (
                cname, name, want.size, float(np.float32(1 / math.sqrt(shapes[name][-2])))))
    print("  %s init lora_B zeros ok (%d values), lora_scale %r ok (%d values)" % (
        cname, counts.get("lora_B", 0), float(np.float32(model.lora["alpha"] / model.lora["r"])),
        counts.get("lora_scale", 0)))


def build(moec, d, tag, src, first):
    moe = os.path.join(d, tag + ".moe")
    open(moe, "w").write(src)
    bin_path = os.path.join(d, tag + ".bin")
    r = run([moec, "build", moe, "-o", bin_path], cwd=ROOT)
    if r.returncode != 0 or not os.path.exists(bin_path):
        msg = (r.stdout + r.stderr).strip()
        return None, "moec build exited %d:\n%s" % (r.returncode, msg)
    return bin_path, None


def fake_binary(model, w_path, t_path, dump):
    """--fake: what the binary would dump, from lm_ref in float32, read from the same files."""
    params, _ = moe_ref.load_safetensors(w_path)
    tokens = moe_ref.load_npy(t_path)
    r = lm_ref.forward(model, params, tokens, dtype=np.float32)
    os.makedirs(os.path.join(dump, "grad"))
    moe_ref.save_npy(os.path.join(dump, "tokens.npy"), tokens)
    moe_ref.save_npy(os.path.join(dump, "logits.npy"), r["logits"].astype(np.float32))
    moe_ref.save_npy(os.path.join(dump, "loss.npy"), np.float32(r["loss"]))
    moe_ref.save_npy(os.path.join(dump, "ce.npy"), np.float32(r["ce"]))
    for n, g in r["grads"].items():
        moe_ref.save_npy(os.path.join(dump, "grad", n + ".npy"), np.asarray(g, dtype=np.float32))
    return "step 1  loss %.6f  ce %.6f  aux %.6f  z %.6f  (fake: lm_ref in float32)" % (
        r["loss"], r["ce"], r["aux"], r["z"])


def run_config(rep, moec, cname, fields, items, opts, tmp, first):
    d = os.path.join(tmp, cname)
    os.makedirs(d)
    model = make_model(fields, items)
    shapes = model.param_shapes()
    for attempt in range(20):
        rng = np.random.default_rng(4000 + 31 * attempt + len(cname))
        params, tokens = draw(model, rng)
        want = lm_ref.forward(model, params, tokens)
        if want["margin"] > 1e-4:
            break
    dropped = sum(st["dropped"] for st in want["stats"])
    routed = sum(st["routed"] for st in want["stats"])
    rep.note("%s: %s; %d parameters (%d values), routing margin %.2e (draw %d), dropped %d/%d"
             % (cname, ", ".join("%s(%s)" % (ly.name, ly.moe.gate if ly.moe else "mlp " + ly.mlp.ffn)
                                 for ly in model.layers),
                len(shapes), sum(int(np.prod(s)) for s in shapes.values()), want["margin"],
                attempt, dropped, routed))
    if want["margin"] <= 1e-4:
        rep.fail("%s: no draw keeps the routing 1e-4 away from a tie" % cname)
    if opts.get("expect") == "drops" and dropped == 0:
        rep.fail("%s: the config is meant to drop choices; the reference drops none" % cname)
    if opts.get("expect") == "nodrop" and dropped:
        rep.fail("%s: the config is meant to drop nothing; the reference drops %d" % (cname, dropped))
    w_path, t_path = os.path.join(d, "W.safetensors"), os.path.join(d, "tokens.npy")
    moe_ref.save_safetensors(w_path, params)
    moe_ref.save_npy(t_path, tokens)

    dump = os.path.join(d, "A.dump")
    if moec is None:
        stdout = fake_binary(model, w_path, t_path, dump)
    else:
        bin_path, err = build(moec, d, "A", lm_text("lm_" + cname, fields, items), first)
        if bin_path is None:
            rep.fail("%s: %s" % (cname, err))
            return
        r = run([bin_path, "--steps", "1", "--weights", w_path, "--input", t_path, "--dump", dump],
                cwd=d)
        if r.returncode != 0:
            rep.fail("%s: binary exited %d:\n%s%s" % (cname, r.returncode, r.stdout, r.stderr))
            return
        stdout = r.stdout
        if model.lora:
            check_lora_init(rep, cname, model, bin_path, d)
    got_t = load(dump, "tokens.npy")
    if got_t is None or got_t.shape != tokens.shape or not np.array_equal(got_t, tokens):
        rep.fail("%s: dumped tokens.npy %s differ from the input" % (
            cname, "missing" if got_t is None else "%s %s" % (got_t.dtype, got_t.shape)))
    else:
        print("  %s tokens ok (exact, %d values)" % (cname, tokens.size))
    rep.row(cname, "logits", load(dump, "logits.npy"), want["logits"])
    rep.row(cname, "loss", load(dump, "loss.npy"), np.float64(want["loss"]))
    rep.row(cname, "ce", load(dump, "ce.npy"), np.float64(want["ce"]))
    trained = {n for n in shapes if model.trained(n)}
    for name in sorted(trained):
        floor = FLOOR
        qk_norm = any(ly.attn.qk_norm for ly in model.layers if name.startswith(ly.name + "."))
        if name.endswith(".attn.bk") and model.position == "learned" and not qk_norm:
            floor = max(FLOOR, float(np.abs(want["grads"][name[:-2] + "wk"]).max()))
        rep.row(cname, name, load(dump, os.path.join("grad", name + ".npy")), want["grads"][name],
                floor=floor)
    gdir = os.path.join(dump, "grad")
    dumped = {f[:-4] for f in os.listdir(gdir) if f.endswith(".npy")} if os.path.isdir(gdir) else set()
    extra = sorted(dumped - set(shapes))
    if extra:
        rep.fail("%s: unexpected gradient dumps %s" % (cname, extra))
    frozen = set(shapes) - trained
    if frozen:      # lora: a frozen parameter has no gradient, so no grad/NAME.npy
        bad = sorted(dumped & frozen)
        if bad:
            rep.fail("%s: grad/ files of frozen parameters: %s" % (cname, ", ".join(bad)))
        else:
            print("  %s frozen ok (no grad/ file for any of the %d frozen parameters, %d values; "
                  "%d trained, %d values)" % (cname, len(frozen), sum(int(np.prod(shapes[n])) for n in frozen),
                                              len(trained), sum(int(np.prod(shapes[n])) for n in trained)))
        check_trained_line(rep, cname, stdout, sum(int(np.prod(shapes[n])) for n in trained))
    check_step_line(rep, cname, stdout, want)
    got_loss = load(dump, "loss.npy")
    if got_loss is not None and abs(float(np.ravel(got_loss)[0]) - want["loss"]) > TOL * abs(want["loss"]):
        alt = lm_ref.forward(model, params, tokens, want_grads=False, z_noisy=False)
        quiet = lm_ref.forward(model, params, tokens, want_grads=False, training=False)
        rep.note("%s: loss differs; with z on the clean logits the reference gives %.8f, without "
                 "gate noise %.8f (ce %.8f), binary %.8f" % (cname, alt["loss"], quiet["loss"],
                                                            quiet["ce"], float(np.ravel(got_loss)[0])))


def main():
    keep = "--keep" in sys.argv
    only = set(sys.argv[sys.argv.index("--only") + 1].split(",")) if "--only" in sys.argv else None
    if "--list" in sys.argv:
        for cname, _, _, _ in CONFIGS:
            print(cname)
        return 0
    build_dir = os.environ.get("BUILD", "build")
    moec = os.environ.get("MOEC", os.path.join(ROOT, build_dir, "moec") if not os.path.isabs(build_dir)
                          else os.path.join(build_dir, "moec"))
    if "--fake" in sys.argv:
        moec = None
        print("# --fake: the binary is lm_ref in float32 (checks this harness, not moec)")
    elif not os.path.exists(moec):
        print("skipped: build/moec missing")
        return 77
    rep = Report()
    tmp = tempfile.mkdtemp(prefix="moec_lm_ref_")
    first = True
    try:
        for cname, fields, items, opts in CONFIGS:
            if only and cname not in only:
                continue
            try:
                run_config(rep, moec, cname, fields, items, opts, tmp, first)
            except subprocess.TimeoutExpired as e:
                rep.fail("%s: timed out: %s" % (cname, e))
            first = False
    finally:
        if keep:
            print("# kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print("# %d tensors compared; worst err %.4e (%s), tolerance %g"
          % (rep.count, rep.worst[0], rep.worst[1], TOL))
    if rep.failures:
        for f in rep.failures:
            print("# failure: " + f.splitlines()[0])
        print("FAILED")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
